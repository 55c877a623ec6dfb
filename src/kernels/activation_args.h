// Host-side argument checks shared by the activation kernels' entry points (docs/semantics.md,
// Errors: a moe::Error naming the argument before anything is launched).
#pragma once

#include <cstdint>

#include "moe/activation.h"
#include "moe/tensor.h"

namespace moe::kernels {

// A default-constructed TensorView (no dimensions) stands for an absent optional argument.
inline bool is_absent(const TensorView& t) { return t.ndim == 0; }

struct ActivationDims {
  int64_t R = 0, F = 0, in_cols = 0;
  int groups = 0;  // E when group_offsets is given
};

// Checks params, h [R, fc1_out] and the F-column tensor `cols` [R, F] (named cols_name), and the
// optional probs [R] and group_offsets [E + 1].
ActivationDims check_activation_args(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                                     const TensorView& group_offsets, const TensorView& cols,
                                     const char* cols_name);

// An optional fp32 [R] per-row vector (probs, dprobs).
void check_row_vector(const TensorView& t, const char* name, int64_t R);

}  // namespace moe::kernels
