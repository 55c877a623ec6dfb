#include "moe/activation.h"

#include <cmath>

#include "moe/error.h"

namespace moe {

bool is_gated(Activation a) { return a != Activation::kSquaredReLU; }

const char* activation_name(Activation a) {
  switch (a) {
    case Activation::kSwiGLU: return "swiglu";
    case Activation::kGeGLU: return "geglu";
    case Activation::kClampedSwiGLU: return "clamped-swiglu";
    case Activation::kSquaredReLU: return "squared-relu";
  }
  return "unknown";
}

Activation activation_from_name(const std::string& name) {
  for (Activation a : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kClampedSwiGLU, Activation::kSquaredReLU})
    if (name == activation_name(a)) return a;
  detail::throw_error("argument 'activation': expected one of swiglu, geglu, clamped-swiglu, squared-relu, got '",
                      name, "'");
}

int64_t fc1_out_features(Activation a, int64_t ffn) { return is_gated(a) ? 2 * ffn : ffn; }

void validate_activation(const ActivationParams& p, int64_t ffn) {
  MOE_CHECK(p.kind == Activation::kSwiGLU || p.kind == Activation::kGeGLU || p.kind == Activation::kClampedSwiGLU ||
                p.kind == Activation::kSquaredReLU,
            "argument 'activation': unknown kind ", int(p.kind));
  MOE_CHECK(ffn > 0, "argument 'ffn': expected > 0, got ", ffn);
  if (p.kind == Activation::kClampedSwiGLU) {
    MOE_CHECK(std::isfinite(p.alpha), "argument 'alpha': expected a finite value, got ", p.alpha);
    MOE_CHECK(std::isfinite(p.limit) && p.limit > 0, "argument 'limit': expected a finite value > 0, got ", p.limit);
    MOE_CHECK(std::isfinite(p.offset), "argument 'offset': expected a finite value, got ", p.offset);
  }
  int s = p.glu_interleave;
  MOE_CHECK(s >= 0, "argument 'glu_interleave': expected >= 0, got ", s);
  if (s == 0) return;
  MOE_CHECK(is_gated(p.kind), "argument 'glu_interleave': interleave needs a gated activation, got ",
            activation_name(p.kind));
  // 1: gate and linear alternate column by column; otherwise blocks of s columns, s a multiple of 8
  // (whole 16-byte vectors of one half) that divides F.
  MOE_CHECK(s == 1 || (s % 8 == 0 && ffn % s == 0), "argument 'glu_interleave': expected 1 or a multiple of 8 ",
            "that divides F=", ffn, ", got ", s);
}

}  // namespace moe
