// CPU reference of the gated activations with prob scaling (docs/semantics.md, Activations),
// forward and backward. Arithmetic in fp64 (so finite differences can check the backward), on
// logical columns mapped through the GLU interleave.
#pragma once

#include <cstdint>

#include "moe/activation.h"

namespace moe::ref {

// h [rows, fc1_out] -> out [rows, F] = act(h) * p[row] (p may be null: 1).
void activation_forward(const ActivationParams& params, const double* h, const double* p, int64_t rows, int64_t F,
                        double* out);

// d_out [rows, F] -> dh [rows, fc1_out] and, when dp is non-null, dp[row] = sum_j d_out * act_unscaled
// (the prob's gradient through the activation).
void activation_backward(const ActivationParams& params, const double* h, const double* p, const double* d_out,
                         int64_t rows, int64_t F, double* dh, double* dp);

}  // namespace moe::ref
