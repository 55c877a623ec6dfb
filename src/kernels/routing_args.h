// Host-side checks of a device routing, shared by the entry points that plan from one (the
// single-GPU moe::Dispatcher and the expert-parallel moe::EpDispatcher): a moe::Error naming the
// argument before anything is launched (docs/semantics.md, Routing input and Errors).
#pragma once

#include <cstdint>

#include "moe/routing.h"

namespace moe::kernels {

// Checks the routing against the caller's form and slots per token (indices int32 [T, slots] or
// map bool/uint8 [T, slots], probs fp32 [T, slots], T <= max_tokens) and the error word; returns T.
int64_t check_routing_args(const RoutingView& routing, const uint32_t* error_word, RoutingForm form, int slots,
                           int64_t max_tokens);

}  // namespace moe::kernels
