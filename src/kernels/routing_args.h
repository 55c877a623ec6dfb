// Host-side checks of a device routing and of the merging probs of a combine, shared by the
// single-GPU moe::Dispatcher and the expert-parallel moe::EpDispatcher: a moe::Error naming the
// argument before anything is launched (docs/semantics.md, Routing input and Errors).
#pragma once

#include <cstdint>

#include "moe/dispatch.h"
#include "moe/routing.h"

namespace moe::kernels {

// Checks the routing against the caller's form and slots per token (indices int32 [T, slots] or
// map bool/uint8 [T, slots], probs fp32 [T, slots], T <= max_tokens) and the error word; returns T.
int64_t check_routing_args(const RoutingView& routing, const uint32_t* error_word, RoutingForm form, int slots,
                           int64_t max_tokens);

// The merging weights of a combine or its backward per `merge`: *by_row = planned_by_row
// (kPlanned), *by_slot = the given probs fp32 [T, slots] (kGiven: checked; `call` names the method
// in the message, e.g. "Dispatcher::unpermute"); both null for kNone.
void merge_weights(MergeProbs merge, const TensorView* probs, const float* planned_by_row, int64_t T, int slots,
                   const char* call, const float** by_row, const float** by_slot);

}  // namespace moe::kernels
