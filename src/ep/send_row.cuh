// Device helper shared by the capacity and the dropless layouts of the send buffer: what travels
// with a routing slot's row.
#pragma once

#include <cstdint>

#include "ep/ep_kernels.h"

namespace moe::kernels {

// Send row `row` carries slot i (token i / slots) of routing `rt` to rank d: the slot index, its
// prob (bitwise the routing's) and its expert as a local id of rank d.
__device__ __forceinline__ void fill_send_row(const EpRouting& rt, int64_t i, int32_t row, int32_t d, int E_local,
                                              int32_t* send_row_slot, float* send_probs, int32_t* send_expert) {
  const int expert = rt.form == RoutingForm::kTopK ? rt.indices[i] : static_cast<int>(i % rt.slots);
  send_row_slot[row] = static_cast<int32_t>(i);
  send_probs[row] = rt.probs[i];
  send_expert[row] = expert - d * E_local;
}

}  // namespace moe::kernels
