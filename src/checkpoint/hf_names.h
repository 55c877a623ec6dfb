// Key names of the per-expert Hugging Face families (include/moe/checkpoint_hf.h), shared by the
// unquantized and the FP8 conversions.
#pragma once

#include <string>
#include <vector>

#include "moe/checkpoint_hf.h"

namespace moe {

// Projection names of the per-expert families: gate, up (our linear half; fc1 itself when the experts
// are not gated), down.
struct ProjNames {
  const char* gate;  // null: not gated (fc1 = up)
  const char* up;
  const char* down;
  // The projections each expert stores, fc1's first.
  std::vector<const char*> all() const {
    return gate ? std::vector<const char*>{gate, up, down} : std::vector<const char*>{up, down};
  }
};
inline ProjNames proj_names(HfFamily f) {
  if (f == HfFamily::kMixtral || f == HfFamily::kDeepseekV4 || f == HfFamily::kMinimaxM3) return {"w1", "w3", "w2"};
  if (f == HfFamily::kNemotronH) return {nullptr, "up_proj", "down_proj"};
  return {"gate_proj", "up_proj", "down_proj"};
}

// The families that store each layer's experts fused, and their tensors' names after the layer's
// prefix: gate_up [E, 2F, H] = [gate ; up] rows, down [E, H, F]. The per-expert families' fused
// in-memory form (read too) uses the first pair.
struct FusedNames {
  const char* gate_up;
  const char* down;
};
inline bool stored_fused(HfFamily f) {
  return f == HfFamily::kMistral4 || f == HfFamily::kGemma4 || f == HfFamily::kGraniteMoe ||
         f == HfFamily::kQwen3VlMoe || f == HfFamily::kHyV4 || f == HfFamily::kMinimaxM3Text ||
         f == HfFamily::kInkling;
}
inline FusedNames fused_names(HfFamily f) {
  if (f == HfFamily::kGraniteMoe) return {"input_linear.weight", "output_linear.weight"};
  if (f == HfFamily::kInkling) return {"w13_weight", "w2_weight"};
  return {"gate_up_proj", "down_proj"};
}
// Inkling's w13 holds each expert's gate and up rows alternating (gate 0, up 0, gate 1, ...), not as
// [gate ; up] halves.
inline bool fused_rows_alternate(HfFamily f) { return f == HfFamily::kInkling; }

// GPT-OSS's layout, also the privacy filter's: x @ W, gate_up_proj [E, H, 2F] with gate_up_proj_bias
// [E, 2F], down_proj [E, F, H] with down_proj_bias [E, H]. GPT-OSS interleaves gate and up columns
// (gate 2j, up 2j + 1); the privacy filter keeps them as [gate | up] halves.
inline bool stored_as_gpt_oss(HfFamily f) { return f == HfFamily::kGptOss || f == HfFamily::kOpenaiPrivacyFilter; }
inline bool gpt_oss_columns_interleaved(HfFamily f) { return f == HfFamily::kGptOss; }

// The name of the module a family keys its experts' tensors under: "experts." (granitemoe:
// "block_sparse_moe."). A layer's prefix is that name or ends in "." + that name.
inline std::string expert_module(HfFamily f) { return f == HfFamily::kGraniteMoe ? "block_sparse_moe." : "experts."; }
inline bool names_expert_module(const std::string& prefix, HfFamily f) {
  const std::string m = expert_module(f);
  return prefix == m ||
         (prefix.size() > m.size() && prefix.compare(prefix.size() - m.size() - 1, std::string::npos, "." + m) == 0);
}

// "<prefix><e>.<proj>.weight".
inline std::string per_expert_key(const std::string& prefix, int e, const char* proj) {
  return prefix + std::to_string(e) + "." + proj + ".weight";
}

}  // namespace moe
