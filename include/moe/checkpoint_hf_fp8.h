// FP8 expert weights in Hugging Face checkpoints <-> our quantized layout.
//
// DeepSeek-V3 / R1, Kimi-K2 and the FP8 releases of Qwen3 and MiniMax store each expert projection as
// FP8 E4M3 with one fp32 scale per 128x128 block (quantization_config "fp8", weight_block_size
// [128, 128]):
//
//   <P>experts.{e}.gate_proj.weight            F8_E4M3 [F, H]    (mixtral naming: w1 / w3 / w2)
//   <P>experts.{e}.gate_proj.weight_scale_inv  F32 [ceil(F / 128), ceil(H / 128)]
//   ... up_proj the same, down_proj [H, F] with [ceil(H / 128), ceil(F / 128)]
//
// value = e4m3 code x scale_inv of its block: exactly our FP8 block 128x128 format with row-major
// scales (docs/quantization.md). Converting moves bytes only -- nothing is requantized:
//   - fc1's rowwise data is the gate and up rows in GLU interleave s, its scales the matching block
//     rows; that needs F and s multiples of 128 (a 128x128 block never mixes gate and up rows);
//   - the columnwise copy (what the weight gradient and the dgrad of the experts read) is the exact
//     transpose of the rowwise data and scales, as our quantizer writes it for 128x128 blocks.
// The result is the experts' FP8 weight copies' format (hf_fp8_format), declared in __metadata__, that
// load_fp8_expert_weights loads into an FP8 layer (moe/checkpoint_fp8.h).
#pragma once

#include <string>

#include "moe/checkpoint_hf.h"
#include "moe/checkpoint_quant.h"

namespace moe {

// FP8 block 128x128, fp32 scale_inv, row-major scales, rowwise and columnwise copies.
QuantConfig hf_fp8_format();

// Whether a quantized weight can be written in Hugging Face naming: FP8 block 128x128 with row-major
// scales, the rowwise copy at least.
bool hf_fp8_storable(const QuantConfig& config);

// One FP8 layer (HfExpertLayer::fp8) in our naming: fc1.weight / fc2.weight and their companions
// (moe/checkpoint_quant.h) under l.prefix in `layout`, fc1 in GLU interleave `glu_interleave`; sets
// the two weights' "moe.quant." entries in `metadata`. Throws moe::Error naming the layer when F or
// the interleave is not a multiple of 128.
StateDict load_hf_fp8_experts(const StateDict& sd, HfFamily f, const HfExpertLayer& l, WeightLayout layout,
                              int glu_interleave, Metadata& metadata);

// The reverse: the FP8 layer under `prefix` of `sd` (its fc1.weight and fc2.weight in hf_fp8_format or
// with the rowwise copy only, either layout, no biases; fc1 in GLU interleave `glu_interleave`) as the
// family's per-expert FP8 tensors under `prefix`. A stored columnwise copy must be the transpose of the
// rowwise one (it is dropped: Hugging Face stores the rowwise copy only). Families with per-expert
// naming only (not gpt_oss).
StateDict hf_fp8_expert_tensors(const StateDict& sd, const std::string& prefix, const QuantConfig& fc1_format,
                                const QuantConfig& fc2_format, HfFamily f, int glu_interleave);

}  // namespace moe
