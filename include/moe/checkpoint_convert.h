// Checkpoint conversion between per-expert, single-grouped and Hugging Face files (the engine of
// `moe-engine convert`). Only the experts' tensors change; every other tensor and the file's
// __metadata__ are carried over byte for byte.
#pragma once

#include <string>
#include <vector>

#include "moe/checkpoint_hf.h"
#include "moe/safetensors.h"
#include "moe/state_dict.h"

namespace moe {

struct CheckpointFormat {
  enum class Kind : uint8_t { kPerExpert, kGrouped, kHuggingFace };
  Kind kind = Kind::kGrouped;
  HfFamily family = HfFamily::kMixtral;  // kHuggingFace only

  // "per-expert", "grouped" or "hf:<family>"; throws moe::Error naming `what` otherwise.
  static CheckpointFormat parse(const std::string& text, const char* what = "format");
  std::string name() const;
  bool ours() const { return kind != Kind::kHuggingFace; }
};

struct ConvertOptions {
  CheckpointFormat from;
  CheckpointFormat to;
  int experts = 0;            // 0: read from the keys (see find_expert_layers); a Hugging Face input's must match
  int from_glu_interleave = 0;  // fc1 row layout of the input, when it is ours
  int to_glu_interleave = 0;    // fc1 row layout of the output, when it is ours
  // Only these layers (prefixes as find_expert_layers / find_hf_expert_layers name them, each of which
  // must name one); all when empty.
  std::vector<std::string> prefixes;
};

// Converts the expert layers of `sd` in place; returns their prefixes. No layer found is an error
// (the input is probably not in the `from` format), as is an output key that collides with a
// tensor that is not converted.
//
// Quantized expert weights (moe/checkpoint_quant.h) are those `metadata` declares ("moe.quant.<key>"
// entries, the file's __metadata__): between per-expert and grouped, their data and companion
// tensors move bit for bit (checked against the declared format before and after) and the
// metadata stays valid as it is (it names the grouped key in both layouts). Re-interleaving fc1's
// rows or Hugging Face naming would need requantization: an error for a quantized layer, as is a
// weight with companion tensors that the metadata does not declare.
std::vector<std::string> convert_state_dict(StateDict& sd, const ConvertOptions& options,
                                            const Metadata& metadata = {});

// File to file: reads `in` (memory-mapped), converts (quantized layers as its __metadata__
// declares), writes `out` (atomically), keeping the input's __metadata__. `progress` sees the
// bytes written.
std::vector<std::string> convert_checkpoint(const std::string& in, const std::string& out,
                                            const ConvertOptions& options,
                                            const safetensors::ProgressFn& progress = {});

}  // namespace moe
