// Host-side argument checks of the bias kernels (a moe::Error naming the argument;
// docs/semantics.md, Errors).
#pragma once

#include <cstdint>
#include <initializer_list>

#include "moe/bias_ops.h"

namespace moe::kernels {

struct BiasDims {
  int64_t R = 0, N = 0;
  int E = 0;
};

// dy / y: bf16 [R, N], N a positive multiple of 8, 16-byte aligned; group_offsets int32 [E + 1].
BiasDims check_grouped_matrix(const TensorView& m, const char* name, const TensorView& group_offsets);
// rows: E rows of N elements of one of `dtypes`, exactly one of stacked / table set.
void check_expert_rows(const ExpertRows& rows, const char* name, const BiasDims& d, std::initializer_list<DType> dtypes);

}  // namespace moe::kernels
