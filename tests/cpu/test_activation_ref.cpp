// CPU reference of the activations (docs/semantics.md, Activations): known values, fp64
// finite-difference checks of the backward, the GLU interleave as a pure storage layout, and
// argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "moe/activation.h"
#include "moe/error.h"
#include "reference/activation_ref.h"
#include "support/expect_error.h"

namespace moe::ref {
namespace {

using ::moe::testing::expect_error_naming;

ActivationParams make(Activation kind, int interleave = 0) {
  ActivationParams p;
  p.kind = kind;
  p.glu_interleave = interleave;
  return p;
}

// One row, F = 1: h = {g, l} (or {h}), returns act(h) * p.
double fwd1(const ActivationParams& prm, std::vector<double> h, double p) {
  double out = 0;
  activation_forward(prm, h.data(), &p, 1, 1, &out);
  return out;
}

// Expected values computed independently (Python, math module) from the formulas of
// docs/semantics.md.
TEST(ActivationRef, KnownValues) {
  // silu(1) = 1 / (1 + e^-1); swiglu(g=1, l=2) * 0.5
  EXPECT_NEAR(fwd1(make(Activation::kSwiGLU), {1.0, 2.0}, 0.5), 0.7310585786300049, 1e-15);
  // silu(-0.5) * 1.5 * 0.25
  EXPECT_NEAR(fwd1(make(Activation::kSwiGLU), {-0.5, 1.5}, 0.25), -0.07078887539965226, 1e-15);
  // gelu_tanh(1) with the spec's constant 0.7978845608
  EXPECT_NEAR(fwd1(make(Activation::kGeGLU), {1.0, 1.0}, 1.0), 0.841191990607477, 1e-14);
  EXPECT_NEAR(fwd1(make(Activation::kGeGLU), {-1.0, -2.0}, 1.0), 0.3176160187850462, 1e-14);
  // GPT-OSS clamped swiglu (alpha = float(1.702), L 7, off 1): g = 8 -> a = 7, l = -9 -> -7; 7 sig(7 alpha) (-7 + 1)
  EXPECT_NEAR(fwd1(make(Activation::kClampedSwiGLU), {8.0, -9.0}, 1.0), -41.99971876986309, 1e-12);
  // alpha 1, off 0 inside the clamp is swiglu: 2 sig(2) * 3
  ActivationParams c = make(Activation::kClampedSwiGLU);
  c.alpha = 1.0f;
  c.offset = 0.0f;
  EXPECT_NEAR(fwd1(c, {2.0, 3.0}, 1.0), 5.284782467867294, 1e-14);
  // squared relu: relu(h)^2 * p
  EXPECT_EQ(fwd1(make(Activation::kSquaredReLU), {3.0}, 0.5), 4.5);
  EXPECT_EQ(fwd1(make(Activation::kSquaredReLU), {-3.0}, 0.5), 0.0);
}

// The clamp masks: no gradient to the gate where g > L, none to the linear half where |l| > L.
TEST(ActivationRef, ClampedDerivativesMasked) {
  ActivationParams c = make(Activation::kClampedSwiGLU);
  const double p = 0.75, dout = 2.0;
  auto bwd = [&](double g, double l) {
    std::vector<double> h = {g, l}, dh(2);
    double dp = 0;
    activation_backward(c, h.data(), &p, &dout, 1, 1, dh.data(), &dp);
    return dh;
  };
  std::vector<double> dh = bwd(9.0, 0.5);  // gate clamped
  EXPECT_EQ(dh[0], 0.0);
  EXPECT_GT(std::fabs(dh[1]), 1.0);
  dh = bwd(1.0, 8.0);  // linear clamped above
  EXPECT_NE(dh[0], 0.0);
  EXPECT_EQ(dh[1], 0.0);
  dh = bwd(1.0, -8.0);  // linear clamped below
  EXPECT_NE(dh[0], 0.0);
  EXPECT_EQ(dh[1], 0.0);
  dh = bwd(-2.0, 3.0);  // inside: both flow; the linear one is exactly p * dout * a sig(alpha a)
  EXPECT_NEAR(dh[1], p * dout * (-2.0) / (1.0 + std::exp(double(1.702f) * 2.0)), 1e-15);
}

struct Case {
  const char* name;
  ActivationParams params;
};

std::vector<Case> all_cases() {
  ActivationParams clamped = make(Activation::kClampedSwiGLU);
  clamped.limit = 1.5f;  // small limit so random inputs land on both sides of the clamp
  ActivationParams clamped_il = clamped;
  clamped_il.glu_interleave = 8;
  ActivationParams silu_clamp = clamped;
  silu_clamp.alpha = 1.0f;
  silu_clamp.offset = 0.0f;
  return {{"swiglu", make(Activation::kSwiGLU)},
          {"swiglu_il8", make(Activation::kSwiGLU, 8)},
          {"geglu", make(Activation::kGeGLU)},
          {"geglu_il16", make(Activation::kGeGLU, 16)},
          {"clamped", clamped},
          {"clamped_il8", clamped_il},
          {"clamped_silu", silu_clamp},
          {"squared_relu", make(Activation::kSquaredReLU)}};
}

// Inputs in [-3, 3], kept away from the kinks (the clamp at +-L, relu at 0) by more than the FD step.
std::vector<double> random_h(const ActivationParams& prm, int64_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> u(-3.0, 3.0);
  std::vector<double> h(n);
  const double L = prm.limit;
  for (auto& v : h) {
    do {
      v = u(rng);
    } while ((prm.kind == Activation::kClampedSwiGLU && (std::fabs(v - L) < 1e-3 || std::fabs(v + L) < 1e-3)) ||
             (prm.kind == Activation::kSquaredReLU && std::fabs(v) < 1e-3));
  }
  return h;
}

// Loss = sum(out * w): its gradient is the backward with d_out = w.
TEST(ActivationRef, FiniteDifferenceGradients) {
  const int64_t rows = 3, F = 32;
  for (const Case& c : all_cases()) {
    SCOPED_TRACE(c.name);
    std::mt19937_64 rng(7);
    const int64_t in_cols = fc1_out_features(c.params.kind, F);
    std::vector<double> h = random_h(c.params, rows * in_cols, rng);
    std::uniform_real_distribution<double> u(-1.0, 1.0), up(0.1, 1.0);
    std::vector<double> p(rows), w(rows * F);
    for (auto& v : p) v = up(rng);
    for (auto& v : w) v = u(rng);
    auto loss = [&](const std::vector<double>& hh, const std::vector<double>& pp) {
      std::vector<double> out(rows * F);
      activation_forward(c.params, hh.data(), pp.data(), rows, F, out.data());
      double s = 0;
      for (int64_t i = 0; i < rows * F; ++i) s += out[i] * w[i];
      return s;
    };
    std::vector<double> dh(rows * in_cols), dp(rows);
    activation_backward(c.params, h.data(), p.data(), w.data(), rows, F, dh.data(), dp.data());
    // Central differences: truncation O(eps^2 * f''') ~ 1e-12, rounding O(1e-16 / eps) ~ 1e-10.
    const double eps = 1e-6, tol = 1e-7;
    for (int64_t i = 0; i < rows * in_cols; ++i) {
      std::vector<double> hp = h, hm = h;
      hp[i] += eps;
      hm[i] -= eps;
      double fd = (loss(hp, p) - loss(hm, p)) / (2 * eps);
      EXPECT_NEAR(dh[i], fd, tol * (1.0 + std::fabs(fd))) << "dh[" << i << "]";
    }
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> pp = p, pm = p;
      pp[r] += eps;
      pm[r] -= eps;
      double fd = (loss(h, pp) - loss(h, pm)) / (2 * eps);
      EXPECT_NEAR(dp[r], fd, tol * (1.0 + std::fabs(fd))) << "dp[" << r << "]";
    }
    // The gradient is not trivially zero (the check above could not pass vacuously).
    double norm = 0;
    for (double v : dh) norm += std::fabs(v);
    EXPECT_GT(norm, 1.0);
  }
}

// p = null means p = 1; dp may be skipped.
TEST(ActivationRef, NullProbsMeansOne) {
  const int64_t rows = 4, F = 8;
  std::mt19937_64 rng(3);
  ActivationParams prm = make(Activation::kGeGLU);
  std::vector<double> h = random_h(prm, rows * 2 * F, rng), ones(rows, 1.0), w(rows * F, 0.5);
  std::vector<double> a(rows * F), b(rows * F), dha(rows * 2 * F), dhb(rows * 2 * F);
  activation_forward(prm, h.data(), nullptr, rows, F, a.data());
  activation_forward(prm, h.data(), ones.data(), rows, F, b.data());
  EXPECT_EQ(a, b);
  activation_backward(prm, h.data(), nullptr, w.data(), rows, F, dha.data(), nullptr);
  activation_backward(prm, h.data(), ones.data(), w.data(), rows, F, dhb.data(), nullptr);
  EXPECT_EQ(dha, dhb);
}

// The same logical weights stored interleaved give bitwise-identical results.
TEST(ActivationRef, InterleaveIsOnlyALayout) {
  const int64_t rows = 5, F = 64;
  for (Activation kind : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kClampedSwiGLU}) {
    for (int s : {1, 8, 16, 32, 64}) {  // 1: gate and linear alternate column by column (GPT-OSS)
      SCOPED_TRACE(std::string(activation_name(kind)) + " s=" + std::to_string(s));
      ActivationParams plain = make(kind), il = make(kind, s);
      plain.limit = il.limit = 2.0f;
      std::mt19937_64 rng(11 + s);
      std::vector<double> h = random_h(plain, rows * 2 * F, rng), h_il(rows * 2 * F);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < F; ++j) {
          h_il[r * 2 * F + gate_column(j, F, s)] = h[r * 2 * F + j];
          h_il[r * 2 * F + linear_column(j, F, s)] = h[r * 2 * F + F + j];
        }
      std::uniform_real_distribution<double> u(-1.0, 1.0);
      std::vector<double> p(rows), w(rows * F);
      for (auto& v : p) v = u(rng);
      for (auto& v : w) v = u(rng);
      std::vector<double> out(rows * F), out_il(rows * F);
      activation_forward(plain, h.data(), p.data(), rows, F, out.data());
      activation_forward(il, h_il.data(), p.data(), rows, F, out_il.data());
      EXPECT_EQ(out, out_il);
      std::vector<double> dh(rows * 2 * F), dh_il(rows * 2 * F), dp(rows), dp_il(rows);
      activation_backward(plain, h.data(), p.data(), w.data(), rows, F, dh.data(), dp.data());
      activation_backward(il, h_il.data(), p.data(), w.data(), rows, F, dh_il.data(), dp_il.data());
      EXPECT_EQ(dp, dp_il);
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < F; ++j) {
          EXPECT_EQ(dh[r * 2 * F + j], dh_il[r * 2 * F + gate_column(j, F, s)]);
          EXPECT_EQ(dh[r * 2 * F + F + j], dh_il[r * 2 * F + linear_column(j, F, s)]);
        }
    }
  }
}

TEST(ActivationRef, BadArgumentsNameTheArgument) {
  std::vector<double> h(64), out(32), dh(64);
  double p = 1;
  ActivationParams sw = make(Activation::kSwiGLU);
  expect_error_naming([&] { activation_forward(sw, h.data(), &p, -1, 8, out.data()); }, "'rows'");
  expect_error_naming([&] { activation_forward(sw, h.data(), &p, 1, 0, out.data()); }, "'F'");
  expect_error_naming([&] { activation_forward(sw, nullptr, &p, 1, 8, out.data()); }, "'h'");
  expect_error_naming([&] { activation_forward(sw, h.data(), &p, 1, 8, nullptr); }, "'out'");
  expect_error_naming([&] { activation_backward(sw, h.data(), &p, nullptr, 1, 8, dh.data(), nullptr); }, "'d_out'");
  expect_error_naming([&] { activation_backward(sw, h.data(), &p, out.data(), 1, 8, nullptr, nullptr); }, "'dh'");
  expect_error_naming([&] { activation_forward(make(Activation::kSwiGLU, 12), h.data(), &p, 1, 32, out.data()); },
                      "'glu_interleave'");
  expect_error_naming([&] { activation_forward(make(Activation::kSwiGLU, 2), h.data(), &p, 1, 32, out.data()); },
                      "'glu_interleave'");
  expect_error_naming([&] { activation_forward(make(Activation::kSwiGLU, 16), h.data(), &p, 1, 8, out.data()); },
                      "'glu_interleave'");
  expect_error_naming(
      [&] { activation_forward(make(Activation::kSquaredReLU, 8), h.data(), &p, 1, 8, out.data()); },
      "'glu_interleave'");
  ActivationParams c = make(Activation::kClampedSwiGLU);
  c.limit = 0.0f;
  expect_error_naming([&] { activation_forward(c, h.data(), &p, 1, 8, out.data()); }, "'limit'");
  c = make(Activation::kClampedSwiGLU);
  c.alpha = std::nanf("");
  expect_error_naming([&] { activation_forward(c, h.data(), &p, 1, 8, out.data()); }, "'alpha'");
  c = make(Activation::kClampedSwiGLU);
  c.offset = INFINITY;
  expect_error_naming([&] { activation_backward(c, h.data(), &p, out.data(), 1, 8, dh.data(), nullptr); },
                      "'offset'");
  // Zero rows is valid and touches nothing (null pointers allowed).
  activation_forward(sw, nullptr, nullptr, 0, 8, nullptr);
}

}  // namespace
}  // namespace moe::ref
