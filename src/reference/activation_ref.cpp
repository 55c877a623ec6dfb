// CPU reference of the activations (docs/semantics.md, Activations) in fp64. Every function works
// on logical columns j in [0, F); the GLU interleave only decides which physical fc1 column holds
// gate j / linear j.
#include "reference/activation_ref.h"

#include <algorithm>
#include <cmath>

#include "moe/error.h"

namespace moe::ref {
namespace {

// The spec's constant for gelu_tanh (sqrt(2/pi) to 10 digits).
constexpr double kGeluC = 0.7978845608;
constexpr double kGeluA = 0.044715;

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// Value and partial derivatives of the unscaled activation at one logical column.
struct Local {
  double act;  // act_unscaled
  double d_g;  // d act / d gate   (d act / d h for the non-gated activation)
  double d_l;  // d act / d linear (0 for the non-gated activation)
};

Local gated(const ActivationParams& prm, double g, double l) {
  switch (prm.kind) {
    case Activation::kSwiGLU: {
      double s = sigmoid(g);
      double silu = g * s;
      double dsilu = s * (1.0 + g * (1.0 - s));
      return {silu * l, dsilu * l, silu};
    }
    case Activation::kGeGLU: {
      double u = kGeluC * (g + kGeluA * g * g * g);
      double t = std::tanh(u);
      double gelu = 0.5 * g * (1.0 + t);
      double dgelu = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * kGeluC * (1.0 + 3.0 * kGeluA * g * g);
      return {gelu * l, dgelu * l, gelu};
    }
    case Activation::kClampedSwiGLU: {
      const double alpha = prm.alpha, L = prm.limit, off = prm.offset;
      // a = min(g, L): the gate's derivative is zero where g > L (clamped), including through a.
      double a = std::min(g, L);
      double s = sigmoid(alpha * a);
      double gate = a * s;
      double dgate = g > L ? 0.0 : s * (1.0 + alpha * a * (1.0 - s));
      // clamp(l, -L, L): the linear derivative is zero where |l| > L.
      double lc = std::min(std::max(l, -L), L);
      double lin = lc + off;
      double dlin = std::fabs(l) > L ? 0.0 : 1.0;
      return {gate * lin, dgate * lin, gate * dlin};
    }
    case Activation::kSquaredReLU: break;
  }
  detail::throw_error("argument 'params.kind': expected a gated activation");
}

Local plain(double h) {
  // squared-relu: relu(h)^2, derivative 2 relu(h).
  double r = h > 0.0 ? h : 0.0;
  return {r * r, 2.0 * r, 0.0};
}

void check_args(const ActivationParams& prm, int64_t rows, int64_t F) {
  MOE_CHECK(rows >= 0, "argument 'rows': expected >= 0, got ", rows);
  MOE_CHECK(F > 0, "argument 'F': expected > 0, got ", F);
  validate_activation(prm, F);  // also the clamped-swiglu parameters
}

void check_ptr(const void* p, const char* name, int64_t rows) {
  MOE_CHECK(rows == 0 || p != nullptr, "argument '", name, "': expected a non-null pointer for ", rows, " rows");
}

}  // namespace

void activation_forward(const ActivationParams& params, const double* h, const double* p, int64_t rows, int64_t F,
                        double* out) {
  check_args(params, rows, F);
  check_ptr(h, "h", rows);
  check_ptr(out, "out", rows);
  const bool glu = is_gated(params.kind);
  const int64_t in_cols = fc1_out_features(params.kind, F);
  const int s = params.glu_interleave;
  for (int64_t r = 0; r < rows; ++r) {
    const double* hr = h + r * in_cols;
    const double scale = p ? p[r] : 1.0;
    for (int64_t j = 0; j < F; ++j) {
      Local v = glu ? gated(params, hr[gate_column(j, F, s)], hr[linear_column(j, F, s)]) : plain(hr[j]);
      out[r * F + j] = v.act * scale;
    }
  }
}

void activation_backward(const ActivationParams& params, const double* h, const double* p, const double* d_out,
                         int64_t rows, int64_t F, double* dh, double* dp) {
  check_args(params, rows, F);
  check_ptr(h, "h", rows);
  check_ptr(d_out, "d_out", rows);
  check_ptr(dh, "dh", rows);
  const bool glu = is_gated(params.kind);
  const int64_t in_cols = fc1_out_features(params.kind, F);
  const int s = params.glu_interleave;
  for (int64_t r = 0; r < rows; ++r) {
    const double* hr = h + r * in_cols;
    double* dhr = dh + r * in_cols;
    const double scale = p ? p[r] : 1.0;
    double dp_sum = 0.0;
    for (int64_t j = 0; j < F; ++j) {
      const double go = d_out[r * F + j];
      if (glu) {
        const int64_t cg = gate_column(j, F, s), cl = linear_column(j, F, s);
        Local v = gated(params, hr[cg], hr[cl]);
        dhr[cg] = go * scale * v.d_g;
        dhr[cl] = go * scale * v.d_l;
        dp_sum += go * v.act;
      } else {
        Local v = plain(hr[j]);
        dhr[j] = go * scale * v.d_g;
        dp_sum += go * v.act;
      }
    }
    if (dp) dp[r] = dp_sum;
  }
}

}  // namespace moe::ref
