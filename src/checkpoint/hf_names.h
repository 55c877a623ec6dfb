// Key names of the per-expert Hugging Face families (include/moe/checkpoint_hf.h), shared by the
// unquantized and the FP8 conversions.
#pragma once

#include <string>

#include "moe/checkpoint_hf.h"

namespace moe {

// Projection names of the per-expert families: gate, up (our linear half), down.
struct ProjNames {
  const char* gate;
  const char* up;
  const char* down;
};
inline ProjNames proj_names(HfFamily f) {
  if (f == HfFamily::kMixtral) return {"w1", "w3", "w2"};
  return {"gate_proj", "up_proj", "down_proj"};
}

// "<prefix><e>.<proj>.weight".
inline std::string per_expert_key(const std::string& prefix, int e, const char* proj) {
  return prefix + std::to_string(e) + "." + proj + ".weight";
}

}  // namespace moe
