// Byte ranges of tensors: whether two overlap, and the ranges of an op's bound parameters and
// gradients with the check that no gradient shares a byte with a weight or with another gradient: a
// weight gradient written over a weight (or over another gradient) would change what a later GEMM of
// the same step reads, silently. Weights may share memory with each other (they are only read).
#pragma once

#include <cstdint>
#include <vector>

#include "moe/grouped_experts.h"
#include "moe/tensor.h"

namespace moe {

struct BoundRange {
  const char* name = "";  // the argument, e.g. "fc1.weight grad"
  int expert = -1;        // the view's expert in a per-expert binding; -1: single grouped
  uintptr_t begin = 0, end = 0;
};

// Appends the non-empty byte ranges of the views bound as `name` (one view: single grouped).
void add_bound_ranges(std::vector<BoundRange>& out, const std::vector<TensorView>& views, const char* name);

// The non-empty byte ranges of a binding's four tensor lists, named as their arguments ("fc1.weight",
// ... or, for gradients, "fc1.weight grad", ...).
std::vector<BoundRange> expert_tensor_ranges(const ExpertTensors& t, bool grads);

// Refuses (moe::Error naming both arguments, from `call`) a gradient range overlapping another
// gradient range or a weight range.
void check_gradients_apart(const std::vector<BoundRange>& grads, const std::vector<BoundRange>& weights,
                           const char* call);

}  // namespace moe
