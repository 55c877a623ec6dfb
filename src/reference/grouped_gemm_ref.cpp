// CPU reference of the grouped expert products (docs/semantics.md, Expert MLP): plain triple loops
// in fp64, one group at a time. This is the executable spec the CUTLASS kernels are tested against,
// so it stays obvious.
#include "reference/grouped_gemm_ref.h"

#include "moe/error.h"

namespace moe::ref {
namespace {

void check_groups(const Groups& g, int64_t N, int64_t K) {
  MOE_CHECK(g.offset.size() == g.rows.size(), "argument 'groups': offset has ", g.offset.size(),
            " entries but rows has ", g.rows.size());
  MOE_CHECK(N >= 0 && K >= 0, "argument 'N'/'K': expected >= 0, got N=", N, " K=", K);
  for (int e = 0; e < g.count(); ++e)
    MOE_CHECK(g.offset[e] >= 0 && g.rows[e] >= 0, "argument 'groups': group ", e, " has offset ", g.offset[e],
              " and rows ", g.rows[e], ", expected both >= 0");
}

}  // namespace

void grouped_fprop(const Groups& g, const double* X, const double* const* W, int64_t N, int64_t K, double* Y) {
  check_groups(g, N, K);
  for (int e = 0; e < g.count(); ++e) {
    const double* w = W[e];
    for (int64_t r = g.offset[e]; r < g.offset[e] + g.rows[e]; ++r) {
      const double* x = X + r * K;
      for (int64_t n = 0; n < N; ++n) {
        double acc = 0;
        for (int64_t k = 0; k < K; ++k) acc += x[k] * w[n * K + k];
        Y[r * N + n] = acc;
      }
    }
  }
}

void grouped_dgrad(const Groups& g, const double* dY, const double* const* W, int64_t N, int64_t K, double* dX) {
  check_groups(g, N, K);
  for (int e = 0; e < g.count(); ++e) {
    const double* w = W[e];
    for (int64_t r = g.offset[e]; r < g.offset[e] + g.rows[e]; ++r) {
      const double* dy = dY + r * N;
      for (int64_t k = 0; k < K; ++k) {
        double acc = 0;
        for (int64_t n = 0; n < N; ++n) acc += dy[n] * w[n * K + k];
        dX[r * K + k] = acc;
      }
    }
  }
}

void grouped_wgrad(const Groups& g, const double* dY, const double* X, int64_t N, int64_t K, double* const* dW,
                   bool accumulate) {
  check_groups(g, N, K);
  for (int e = 0; e < g.count(); ++e) {
    double* dw = dW[e];
    // Accumulating an empty group must leave main_grad bitwise untouched (even -0.0 entries).
    if (accumulate && g.rows[e] == 0) continue;
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t k = 0; k < K; ++k) {
        // Sum over the group's rows (the ragged reduction dimension); zero for an empty group.
        double acc = 0;
        for (int64_t r = g.offset[e]; r < g.offset[e] + g.rows[e]; ++r) acc += dY[r * N + n] * X[r * K + k];
        dw[n * K + k] = accumulate ? dw[n * K + k] + acc : acc;
      }
    }
  }
}

}  // namespace moe::ref
