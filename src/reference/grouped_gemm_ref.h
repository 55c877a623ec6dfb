// CPU reference of the three grouped products of the experts (docs/semantics.md, Expert MLP), fp64
// accumulation. Groups are row ranges [offset[e], offset[e] + rows[e]) of the token-side matrices;
// the weight of group e is weights[e] (a pointer table: single-grouped layout = pointers into one
// block).
#pragma once

#include <cstdint>
#include <vector>

namespace moe::ref {

struct Groups {
  std::vector<int64_t> offset;  // [E] first row of each group
  std::vector<int64_t> rows;    // [E] rows of each group
  int count() const { return static_cast<int>(offset.size()); }
};

// fprop: Y_e [rows, N] = X_e [rows, K] * W_e^T,  W_e [N, K].  Rows outside every group untouched.
void grouped_fprop(const Groups& g, const double* X, const double* const* W, int64_t N, int64_t K, double* Y);

// dgrad: dX_e [rows, K] = dY_e [rows, N] * W_e,  W_e [N, K].
void grouped_dgrad(const Groups& g, const double* dY, const double* const* W, int64_t N, int64_t K, double* dX);

// wgrad: dW_e [N, K] = dY_e^T X_e (ragged K = rows). accumulate: dW_e += ...; an empty group writes
// zeros (or leaves dW_e untouched when accumulating).
void grouped_wgrad(const Groups& g, const double* dY, const double* X, int64_t N, int64_t K, double* const* dW,
                   bool accumulate);

}  // namespace moe::ref
