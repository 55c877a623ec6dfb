// Checkpoint conversion between per-expert, single-grouped and Hugging Face files (the engine of
// `moe-engine convert`). Only the experts' tensors change; every other tensor and the file's
// __metadata__ are carried over byte for byte.
#pragma once

#include <map>
#include <optional>
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
  // "hf" alone: the family is the model_type of the config.json beside the checkpoint, which
  // convert_checkpoint reads (families_from_config); convert_state_dict refuses it unresolved.
  bool family_from_config = false;

  // "per-expert", "grouped", "hf:<family or model_type>" or "hf"; throws moe::Error naming `what`
  // otherwise.
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
  // bf16 or fp32: quantized weights are written as the values they decode to, in that dtype (see
  // convert_state_dict); unset: they stay quantized.
  std::optional<DType> dequantize;
};

// Converts the expert layers of `sd` in place; returns their prefixes. No layer found is an error
// (the input is probably not in the `from` format), as is an output key that collides with a
// tensor that is not converted.
//
// Quantized expert weights (moe/checkpoint_quant.h) are those `metadata` declares ("moe.quant.<key>"
// entries, the file's __metadata__): between per-expert and grouped, their data and companion
// tensors move bit for bit (checked against the declared format before and after) and the
// metadata stays valid as it is (it names the grouped key in both layouts). Re-interleaving fc1's
// rows would need requantization: an error for a quantized layer, as is a weight with companion
// tensors that the metadata does not declare.
//
// FP8 with 128x128 block scales also goes to and from Hugging Face naming (moe/checkpoint_hf_fp8.h):
// a Hugging Face layer of FP8 weights with "weight_scale_inv" becomes our quantized layer, its two
// "moe.quant." entries added to `metadata`; ours in that format becomes the family's FP8 tensors, its
// entries removed. Other quantized formats are refused for Hugging Face naming. `metadata` changes
// only when the conversion succeeds.
//
// With `options.dequantize` (bf16 or fp32), the converted layers' quantized weights -- ours in any
// format, Hugging Face FP8 -- are written unquantized: each value is its code times its block's decode
// factor in fp32, rounded once to the dtype (transformers' Fp8Dequantize computes the same), and their
// "moe.quant." entries are removed. So is every other FP8 tensor of the dict with Hugging Face's
// 128x128 block scales ("K" F8_E4M3 with "K_scale_inv"; DeepSeek-V3's attention and dense weights),
// its companion removed; expert layers left out by `options.prefixes` stay as they are. Any other
// tensor is carried over unchanged (a bf16 tensor is not widened to fp32).
std::vector<std::string> convert_state_dict(StateDict& sd, const ConvertOptions& options, Metadata& metadata);
// The same for a dict without __metadata__ (no quantized layer of ours).
std::vector<std::string> convert_state_dict(StateDict& sd, const ConvertOptions& options);

// Every expert layer of `sd` in `options.from`'s naming (`options.prefixes` is not applied), each with
// the input keys a conversion reads and replaces, by prefix. Finds them from the keys and shapes alone
// (no tensor's data is read); no layer found is an error, as in convert_state_dict.
std::map<std::string, std::vector<std::string>> expert_layer_keys(const StateDict& sd, const ConvertOptions& options,
                                                                  const Metadata& metadata = {});

// `options` with each "hf" side's family read from the model_type of the config.json that Hugging Face
// keeps beside a checkpoint: in the folder `in` names, or in the folder of the file it names
// (transformers' config: {"model_type": "qwen3_moe", ...}). A missing config.json, one without a
// model_type, or a model_type no family reads is a moe::Error naming the file.
ConvertOptions families_from_config(const ConvertOptions& options, const std::string& in);

// File to file: reads `in` (memory-mapped), converts (quantized layers as its __metadata__
// declares), writes `out` (atomically), keeping the input's __metadata__. `progress` sees the
// bytes written. A sharded input (see is_sharded_checkpoint) goes to convert_sharded_checkpoint.
std::vector<std::string> convert_checkpoint(const std::string& in, const std::string& out,
                                            const ConvertOptions& options,
                                            const safetensors::ProgressFn& progress = {});

// Whether `in` names a sharded checkpoint: an index file ("*.safetensors.index.json", see
// moe/safetensors_index.h) or a folder holding one.
bool is_sharded_checkpoint(const std::string& in);

// A sharded checkpoint (its index, or the folder holding exactly one index) into the folder `out`
// (created if absent; never the input's folder), with an index of the same name. The shards keep
// their file names and __metadata__; every tensor that is not an expert layer's stays in its shard,
// byte for byte, and each expert layer (converted, or as it is when `options.prefixes` leaves it
// out) is written whole into the shard that held the first of its input keys (in key order),
// however its tensors were spread over the input's shards. A shard left with no tensor is not
// written; an output tensor whose name another shard's tensor holds is an error. Shards are
// converted and written one at a time (memory: the converted layers of one shard); an index an
// earlier conversion left in `out` is removed first, the new one written last: a conversion that
// fails leaves no index in `out`. The shards' "moe.quant." __metadata__ entries together declare
// the quantized layers (an entry may sit in any shard) and each is written with its parameter's
// tensors. The index's "metadata" is carried over ("total_size" recomputed). The index is checked
// against the shards first: every tensor it maps is in its shard, and every shard's tensor is
// mapped to that shard. With `options.dequantize`, an FP8 weight outside the expert layers is decoded
// in its own shard, its scales brought there from whichever shard holds them (every such pair checked
// before any shard is written). `progress` sees (done, total) in bytes of the input's tensors: each
// shard's write advances it by the bytes that shard held.
std::vector<std::string> convert_sharded_checkpoint(const std::string& in, const std::string& out,
                                                    const ConvertOptions& options,
                                                    const safetensors::ProgressFn& progress = {});

}  // namespace moe
