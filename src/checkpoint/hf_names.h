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
  if (f == HfFamily::kMixtral) return {"w1", "w3", "w2"};
  if (f == HfFamily::kNemotronH) return {nullptr, "up_proj", "down_proj"};
  return {"gate_proj", "up_proj", "down_proj"};
}

// "<prefix><e>.<proj>.weight".
inline std::string per_expert_key(const std::string& prefix, int e, const char* proj) {
  return prefix + std::to_string(e) + "." + proj + ".weight";
}

}  // namespace moe
