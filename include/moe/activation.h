// Gated and plain activations of the expert MLP (docs/semantics.md, Activations), and the GLU
// interleave layout.
#pragma once

#include <cstdint>
#include <string>

namespace moe {

enum class Activation : uint8_t {
  kSwiGLU,         // silu(g) * l
  kGeGLU,          // gelu_tanh(g) * l
  kClampedSwiGLU,  // a * sigmoid(alpha a) * (clamp(l, -L, L) + off), a = min(g, L)   (GPT-OSS)
  kSquaredReLU,    // relu(h)^2  (not gated)
};

struct ActivationParams {
  Activation kind = Activation::kSwiGLU;
  float alpha = 1.702f;  // clamped-swiglu only
  float limit = 7.0f;    // clamped-swiglu only
  float offset = 1.0f;   // clamped-swiglu only
  // 0: fc1 columns are [gate 0:F | linear 0:F]. s > 0: blocks [g 0:s | l 0:s | g s:2s | l s:2s ...]
  // (a storage layout only: results equal the non-interleaved model with the same logical weights).
  int glu_interleave = 0;
};

bool is_gated(Activation a);
const char* activation_name(Activation a);
Activation activation_from_name(const std::string& name);  // throws moe::Error on unknown names
// Columns fc1 produces: 2F for gated activations, F otherwise.
int64_t fc1_out_features(Activation a, int64_t ffn);
// Throws moe::Error if the interleave size does not suit F (1, or a multiple of 8 that divides F)
// or the activation is not gated.
void validate_activation(const ActivationParams& p, int64_t ffn);

// Physical fc1 column of logical gate column j / linear column j (0 <= j < F). gate_column takes
// ffn only to mirror linear_column.
inline int64_t gate_column(int64_t j, [[maybe_unused]] int64_t ffn, int s) {
  return s == 0 ? j : (j / s) * 2 * s + (j % s);
}
inline int64_t linear_column(int64_t j, int64_t ffn, int s) {
  return s == 0 ? ffn + j : (j / s) * 2 * s + s + (j % s);
}

}  // namespace moe
