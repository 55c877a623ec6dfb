// The quantized experts' weights in checkpoints: fc1.weight and fc2.weight with both copies and
// their scales in the format of the experts' copies (GroupedExperts::fp8_weights_format: FP8 block
// 128x128 with fp32 scale_inv; emulated MXFP8 1x32 / 32x1 with E8M0 scales; emulated NVFP4 16x16
// with E4M3 scales and the global amax), under the names and __metadata__ entries of
// moe/checkpoint_quant.h (docs/checkpoints.md), read from and written into the copies the GEMMs use
// (GroupedExperts::fp8_weights). A checkpoint of bf16 weights loads as before; the copies are then
// quantized from them by a refresh.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "moe/grouped_experts.h"
#include "moe/state_dict.h"

namespace moe {

// Adds `prefix` + "fc1.weight" / "fc2.weight" and their companions (single grouped keys, E
// first), as the copies are after the work queued on `stream` (synchronises it), and their
// __metadata__ entries. Needs config.fp8 or config.emulated and copies made since the last
// set_weights (GroupedExperts::fp8_weights_current).
void save_fp8_expert_weights(const GroupedExperts& experts, const std::string& prefix, StateDict& sd,
                             Metadata& metadata, cudaStream_t stream);

// Writes the quantized weights stored under `prefix` (grouped or per-expert keys, declared in
// `metadata` in the copies' format with both copies and row-major scales) into the experts' copies,
// which then count as refreshed: the forwards that follow compute with them until the next
// refresh_fp8_weights or set_weights. Needs config.fp8 or config.emulated with fp8_weight_refresh =
// kOnRequest or kFromMaster (every forward would quantize over them) and weights bound. A refresh quantizes the
// bound weights again, so with kFromMaster restore the master weights too (they are not part of
// these tensors) before the next optimizer step's refresh. pow2_scale in the metadata is
// accepted (informational). Synchronous (the copies run on `stream`, which it synchronises);
// every check (metadata, keys, dtypes, shapes of every part of every expert, weights bound) runs
// before any byte moves, and a problem is a moe::Error naming the key.
void load_fp8_expert_weights(GroupedExperts& experts, const StateDict& sd, const Metadata& metadata,
                             const std::string& prefix, cudaStream_t stream);

}  // namespace moe
