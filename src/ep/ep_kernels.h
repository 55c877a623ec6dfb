// Launchers of the expert-parallel pack kernels (plain C++ signatures; kernels in src/ep/*.cu).
// moe::EpDispatcher checks every argument before calling these: the launchers trust their
// parameters and only enqueue work on the stream.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "moe/routing.h"

namespace moe::kernels {

// The routing of one source rank, on the device.
struct EpRouting {
  RoutingForm form = RoutingForm::kTopK;
  int32_t T = 0;
  int slots = 0;                     // k (top-k) or E (map)
  int E = 0;                         // global experts P * E_local
  const int32_t* indices = nullptr;  // top-k [T, k]
  const uint8_t* map = nullptr;      // map [T, E]
  const float* probs = nullptr;      // [T, slots]
};

// Validation and destination rank of every slot (ep_destinations.cu): slot_dest[i] = expert /
// E_local for a valid entry, -1 for an empty or skipped one. Skipped entries raise their bit in
// error_word: the single-GPU plan's checks, through its SlotReader.
void launch_ep_slot_destinations(const EpRouting& r, int E_local, int32_t* slot_dest, uint32_t* error_word,
                                 cudaStream_t stream);

// The capacity layout of the send buffer (ep_capacity.cu). In: slot_dest, and the dropless pack
// plan of the flat slots (pack_slot_row = its row, pack_offset = first row of each destination,
// pack_count = entries per destination: a plan over P "experts" whose order inside a destination is
// the flat slot index t * slots + s). Out: send_slot_row [T * slots] = the send row of (d, rank
// within d) in the chunk layout of `chunks` chunks (src/ep/chunk_layout.h; d * C + rank when
// chunks = 1), or -1 when empty, skipped or past the capacity; send_row_slot [P * C] = the slot of each send row
// (-1 unused); send_probs [P * C] and send_expert [P * C] = the prob and the destination-local
// expert of each send row (0 and -1 unused); dropped [P] = max(count - C, 0), and kErrRowOverflow in
// error_word when any. send_row_slot, send_probs and send_expert are fully written (unused rows
// included).
struct EpCapacityArgs {
  EpRouting routing;
  int P = 0;
  int E_local = 0;
  int32_t C = 0;
  int chunks = 1;
  const int32_t* slot_dest = nullptr;
  const int32_t* pack_slot_row = nullptr;
  const int32_t* pack_offset = nullptr;
  const int64_t* pack_count = nullptr;
  int32_t* send_slot_row = nullptr;
  int32_t* send_row_slot = nullptr;
  float* send_probs = nullptr;
  int32_t* send_expert = nullptr;
  int64_t* dropped = nullptr;
  uint32_t* error_word = nullptr;
};
void launch_ep_capacity(const EpCapacityArgs& a, cudaStream_t stream);

// The dropless layout of the send buffer (ep_dropless_pack.cu): the pack plan's rows themselves (its
// destinations' blocks back to back, each in pack order), nothing dropped. In: slot_dest and the
// pack plan's pack_slot_row, as for launch_ep_capacity. Out: send_slot_row [T * slots] = the pack
// row of each valid slot, -1 else; for each used send row (the first sum(counts) rows, all used)
// send_row_slot, send_probs and send_expert as launch_ep_capacity writes them (later rows are not
// written: the dispatcher only reads the rows counted on the host). Then count_blocks [P * P] =
// pack_count [P] repeated P times, the send side of the counts exchange (each rank sends its whole
// count vector to every rank, so every rank learns the whole matrix).
struct EpDroplessArgs {
  EpRouting routing;
  int P = 0;
  int E_local = 0;
  const int32_t* slot_dest = nullptr;
  const int32_t* pack_slot_row = nullptr;
  const int64_t* pack_count = nullptr;
  int32_t* send_slot_row = nullptr;
  int32_t* send_row_slot = nullptr;
  float* send_probs = nullptr;
  int32_t* send_expert = nullptr;
  int64_t* count_blocks = nullptr;
};
void launch_ep_dropless(const EpDroplessArgs& a, cudaStream_t stream);

}  // namespace moe::kernels
