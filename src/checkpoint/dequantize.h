// Quantized weights read back as floating-point values, for `moe-engine convert --dequantize`
// (include/moe/checkpoint_convert.h): our quantized expert layers (moe/checkpoint_quant.h, any
// format) and the FP8 tensors with 128x128 block scales that Hugging Face FP8 checkpoints hold
// beside the experts (DeepSeek-V3's attention and dense weights). The values are the reference
// dequantizer's: code x the block's decode factor, one fp32 multiply, then rounded once to the
// output dtype (as transformers' Fp8Dequantize computes them).
#pragma once

#include <set>
#include <string>
#include <vector>

#include "moe/checkpoint_quant.h"
#include "moe/state_dict.h"

namespace moe::detail {

// The expert layer under `prefix` whose quantized parameters `params` are (as inspect_quantized_param
// found and checked them, at least one, one E), as unquantized fp32 tensors with our key names, single
// grouped: each quantized weight decoded (from its rowwise copy, or its columnwise copy transposed back
// when it stores no rowwise one); the layer's unquantized parameters (biases, a weight left
// unquantized) widened to fp32. A parameter stored in both layouts is a moe::Error naming it.
StateDict dequantized_expert_tensors(const StateDict& sd, const std::string& prefix,
                                     const std::vector<QuantizedParamInfo>& params);

// The keys K of sd that dequantize_fp8_block_tensors takes (below; K's scales are K + kFp8ScaleSuffix),
// without checking their scales.
std::vector<std::string> fp8_block_weights(const StateDict& sd, const std::set<std::string>& skip,
                                           const Metadata& metadata);
// A moe::Error naming the scales unless `s` holds fp32 or bf16 scales of FP8 weight t's 128x128 blocks.
void check_fp8_block_scales(const std::string& key, const HostTensor& t, const HostTensor& s);

// Every tensor K of sd that is F8_E4M3 with at least two dimensions and has a companion
// "K_scale_inv" (fp32 or bf16 [..., ceil(rows / 128), ceil(cols / 128)]: Hugging Face's FP8 block form), other
// than the keys in `skip` and the tensors `metadata` declares ("moe.quant." entries: ours, in the
// declared format, grouped or per expert): replaced by its values in `dtype` (bf16 or fp32), the
// companion removed; the tensors are decoded on every core (parallel_for.h). A companion of another
// dtype or shape is a moe::Error naming it, and the dict is then left as it was.
void dequantize_fp8_block_tensors(StateDict& sd, DType dtype, const std::set<std::string>& skip,
                                  const Metadata& metadata);

}  // namespace moe::detail
