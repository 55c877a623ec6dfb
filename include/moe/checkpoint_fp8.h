// The FP8 experts' quantized weights in checkpoints: fc1.weight and fc2.weight as FP8 block
// 128x128 tensors with both copies and their fp32 scale_inv (the names and __metadata__ entries of
// moe/checkpoint_quant.h, docs/checkpoints.md), read from and written into the copies the FP8
// GEMMs use (GroupedExperts::fp8_weights). A checkpoint of bf16 weights loads as before; the FP8
// copies are then quantized from them by a refresh.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "moe/grouped_experts.h"
#include "moe/state_dict.h"

namespace moe {

// Adds `prefix` + "fc1.weight" / "fc2.weight" and their companions (single grouped keys, E
// first), as the copies are after the work queued on `stream` (synchronises it), and their
// __metadata__ entries. Needs config.fp8 and copies made since the last set_weights
// (GroupedExperts::fp8_weights_current).
void save_fp8_expert_weights(const GroupedExperts& experts, const std::string& prefix, StateDict& sd,
                             Metadata& metadata, cudaStream_t stream);

// Writes the FP8 weights stored under `prefix` (grouped or per-expert keys, declared in
// `metadata` as fp8_block 128x128 with both copies and row-major scales) into the experts' copies,
// which then count as refreshed: the forwards that follow compute with them until the next
// refresh_fp8_weights or set_weights. Needs config.fp8 with fp8_weight_refresh = kOnRequest or
// kFromMaster (every forward would quantize over them) and weights bound. A refresh quantizes the
// bound weights again, so with kFromMaster restore the master weights too (they are not part of
// these tensors) before the next optimizer step's refresh. pow2_scale in the metadata is
// accepted (informational). Synchronous (the copies run on `stream`, which it synchronises);
// every check (metadata, keys, dtypes, shapes of every part of every expert, weights bound) runs
// before any byte moves, and a problem is a moe::Error naming the key.
void load_fp8_expert_weights(GroupedExperts& experts, const StateDict& sd, const Metadata& metadata,
                             const std::string& prefix, cudaStream_t stream);

}  // namespace moe
