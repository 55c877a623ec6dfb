// CPU reference of the grouped expert products: hand-computed cases, the gradient relations between
// fprop, dgrad and wgrad (finite differences in fp64), empty groups and accumulate mode.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "moe/error.h"
#include "reference/grouped_gemm_ref.h"

namespace moe::ref {
namespace {

std::vector<double> random_vec(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<double> v(n);
  for (double& x : v) x = u(rng);
  return v;
}

std::vector<const double*> const_ptrs(const std::vector<std::vector<double>>& w) {
  std::vector<const double*> p;
  for (const auto& m : w) p.push_back(m.data());
  return p;
}
std::vector<double*> mut_ptrs(std::vector<std::vector<double>>& w) {
  std::vector<double*> p;
  for (auto& m : w) p.push_back(m.data());
  return p;
}

// Two experts, N = 2, K = 3; expert 0 owns row 0, expert 1 rows 1-2; row 3 belongs to no group.
TEST(GroupedGemmRef, HandComputedFpropDgradWgrad) {
  Groups g{{0, 1}, {1, 2}};
  const int64_t N = 2, K = 3;
  std::vector<double> X = {1, 2, 3,  //
                           0, 1, 0,  //
                           2, 0, 1,  //
                           9, 9, 9};
  std::vector<double> W0 = {1, 0, 0,   // row n=0
                            0, 1, 1};  // row n=1
  std::vector<double> W1 = {1, 1, 1,   //
                            2, 0, -1};
  std::vector<const double*> W = {W0.data(), W1.data()};

  std::vector<double> Y(4 * N, -7.0);
  grouped_fprop(g, X.data(), W.data(), N, K, Y.data());
  // Y0 = [1 2 3].W0^T = [1, 5]; Y1 = [0 1 0].W1^T = [1, 0]; Y2 = [2 0 1].W1^T = [3, 3].
  EXPECT_EQ(Y, (std::vector<double>{1, 5, 1, 0, 3, 3, -7, -7}));  // row 3 untouched

  std::vector<double> dY = {1, -1,  //
                            2, 1,   //
                            0, 3,   //
                            5, 5};
  std::vector<double> dX(4 * K, -7.0);
  grouped_dgrad(g, dY.data(), W.data(), N, K, dX.data());
  // dX0 = [1 -1].W0 = [1, -1, -1]; dX1 = [2 1].W1 = [4, 2, 1]; dX2 = [0 3].W1 = [6, 0, -3].
  EXPECT_EQ(dX, (std::vector<double>{1, -1, -1, 4, 2, 1, 6, 0, -3, -7, -7, -7}));

  std::vector<double> dW0(N * K, -7.0), dW1(N * K, -7.0);
  std::vector<double*> dW = {dW0.data(), dW1.data()};
  grouped_wgrad(g, dY.data(), X.data(), N, K, dW.data(), /*accumulate=*/false);
  // dW0 = dY0^T X0 = [1; -1] [1 2 3]; dW1 = [2;1][0 1 0] + [0;3][2 0 1].
  EXPECT_EQ(dW0, (std::vector<double>{1, 2, 3, -1, -2, -3}));
  EXPECT_EQ(dW1, (std::vector<double>{0, 2, 0, 6, 1, 3}));

  grouped_wgrad(g, dY.data(), X.data(), N, K, dW.data(), /*accumulate=*/true);
  EXPECT_EQ(dW0, (std::vector<double>{2, 4, 6, -2, -4, -6}));
  EXPECT_EQ(dW1, (std::vector<double>{0, 4, 0, 12, 2, 6}));
}

// L(X, W) = <G, fprop(X, W)>. dgrad(G, W) must be dL/dX and wgrad(G, X) must be dL/dW_e; checked by
// central differences on every entry (L is bilinear, so the difference quotient is exact up to fp64
// rounding of a sum of ~100 terms: 1e-9 is far above that and far below any indexing mistake).
TEST(GroupedGemmRef, DgradAndWgradAreGradientsOfFprop) {
  std::mt19937_64 rng(7);
  Groups g{{0, 3, 3, 8}, {3, 0, 5, 1}};  // uneven, one empty group, last row (9) outside every group
  const int E = g.count();
  const int64_t rows = 10, N = 4, K = 5;
  std::vector<double> X = random_vec(rows * K, rng), G = random_vec(rows * N, rng);
  std::vector<std::vector<double>> W;
  for (int e = 0; e < E; ++e) W.push_back(random_vec(N * K, rng));

  auto loss = [&]() {
    std::vector<double> Y(rows * N, 0.0);
    grouped_fprop(g, X.data(), const_ptrs(W).data(), N, K, Y.data());
    double l = 0;
    for (size_t i = 0; i < Y.size(); ++i) l += G[i] * Y[i];
    return l;
  };

  std::vector<double> dX(rows * K, 0.0);
  grouped_dgrad(g, G.data(), const_ptrs(W).data(), N, K, dX.data());
  std::vector<std::vector<double>> dW(E, std::vector<double>(N * K, 123.0));
  grouped_wgrad(g, G.data(), X.data(), N, K, mut_ptrs(dW).data(), false);

  const double h = 1e-3, tol = 1e-9;
  for (int64_t i = 0; i < rows * K; ++i) {
    const double x0 = X[i];
    X[i] = x0 + h;
    const double lp = loss();
    X[i] = x0 - h;
    const double lm = loss();
    X[i] = x0;
    EXPECT_NEAR(dX[i], (lp - lm) / (2 * h), tol) << "dX[" << i << "]";
  }
  for (int e = 0; e < E; ++e)
    for (int64_t i = 0; i < N * K; ++i) {
      const double w0 = W[e][i];
      W[e][i] = w0 + h;
      const double lp = loss();
      W[e][i] = w0 - h;
      const double lm = loss();
      W[e][i] = w0;
      EXPECT_NEAR(dW[e][i], (lp - lm) / (2 * h), tol) << "dW[" << e << "][" << i << "]";
    }
  // The empty group's weight gradient is exactly zero (written, not left at 123).
  for (double v : dW[1]) EXPECT_EQ(v, 0.0);
}

TEST(GroupedGemmRef, EmptyGroupsTouchNothingAndAccumulateLeavesMainGradBitwise) {
  std::mt19937_64 rng(3);
  Groups g{{0, 0, 4}, {0, 4, 0}};  // empty, 4 rows, empty
  const int64_t N = 3, K = 2, rows = 6;
  std::vector<double> X = random_vec(rows * K, rng), dY = random_vec(rows * N, rng);
  std::vector<std::vector<double>> W(3, random_vec(N * K, rng));

  std::vector<double> Y(rows * N, 42.0);
  grouped_fprop(g, X.data(), const_ptrs(W).data(), N, K, Y.data());
  for (int64_t i = 4 * N; i < rows * N; ++i) EXPECT_EQ(Y[i], 42.0);  // rows past the groups untouched

  // main_grad holding -0.0 and other values: empty experts keep every bit.
  std::vector<std::vector<double>> mg(3, random_vec(N * K, rng));
  mg[0][0] = -0.0;
  mg[2][1] = -0.0;
  const auto before = mg;
  grouped_wgrad(g, dY.data(), X.data(), N, K, mut_ptrs(mg).data(), /*accumulate=*/true);
  EXPECT_EQ(std::memcmp(mg[0].data(), before[0].data(), N * K * sizeof(double)), 0);
  EXPECT_EQ(std::memcmp(mg[2].data(), before[2].data(), N * K * sizeof(double)), 0);
  // The non-empty expert: main_grad + dW.
  std::vector<std::vector<double>> fresh(3, std::vector<double>(N * K, 5.0));
  grouped_wgrad(g, dY.data(), X.data(), N, K, mut_ptrs(fresh).data(), /*accumulate=*/false);
  for (int64_t i = 0; i < N * K; ++i) EXPECT_DOUBLE_EQ(mg[1][i], before[1][i] + fresh[1][i]);
  for (double v : fresh[0]) EXPECT_EQ(v, 0.0);
  for (double v : fresh[2]) EXPECT_EQ(v, 0.0);
}

TEST(GroupedGemmRef, SingleGroupIsADenseGemm) {
  std::mt19937_64 rng(11);
  const int64_t M = 7, N = 3, K = 4;
  Groups g{{0}, {M}};
  std::vector<double> X = random_vec(M * K, rng), W = random_vec(N * K, rng);
  const double* w = W.data();
  std::vector<double> Y(M * N);
  grouped_fprop(g, X.data(), &w, N, K, Y.data());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += X[m * K + k] * W[n * K + k];
      EXPECT_DOUBLE_EQ(Y[m * N + n], acc);
    }
}

TEST(GroupedGemmRef, RejectsInconsistentGroups) {
  Groups bad{{0, 1}, {1}};
  double x = 0, y = 0;
  const double* w = &x;
  EXPECT_THROW(grouped_fprop(bad, &x, &w, 1, 1, &y), Error);
  Groups negative{{0}, {-1}};
  EXPECT_THROW(grouped_fprop(negative, &x, &w, 1, 1, &y), Error);
}

}  // namespace
}  // namespace moe::ref
