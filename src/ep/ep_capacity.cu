// The capacity layout of a source rank's send buffer (docs/expert_parallel.md, Capacity): the
// dropless pack plan ranks every entry inside its destination d in pack order (token, then slot);
// the first C of them take the send rows of (d, rank) in the chunk layout (src/ep/chunk_layout.h:
// d * C + rank unchunked), every later one is dropped -- counted, flagged, never written. Both
// kernels are a pure function of the plan (no atomics whose order could matter).
#include "device/cuda_check.h"
#include "ep/chunk_layout.h"
#include "ep/ep_kernels.h"
#include "ep/send_row.cuh"
#include "moe/device_errors.h"

namespace moe::kernels {
namespace {

constexpr int kThreads = 256;

// Unused send rows: no slot, prob 0, expert -1 (an empty slot for the destination's local plan).
__global__ void __launch_bounds__(kThreads)
    clear_send_rows_kernel(int64_t rows, int32_t* send_row_slot, float* send_probs, int32_t* send_expert) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (r >= rows) return;
  send_row_slot[r] = -1;
  send_probs[r] = 0.0f;
  send_expert[r] = -1;
}

__global__ void __launch_bounds__(kThreads) capacity_rows_kernel(EpCapacityArgs a) {
  const EpRouting& rt = a.routing;
  const int64_t n = static_cast<int64_t>(rt.T) * rt.slots;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const int32_t d = a.slot_dest[i];
  int32_t row = -1;
  if (d >= 0) {
    const int32_t rank_in_d = a.pack_slot_row[i] - a.pack_offset[d];
    if (rank_in_d < a.C) {
      const ep::ChunkLayout chunks{a.P, a.C, a.chunks};
      row = static_cast<int32_t>(chunks.row(d, rank_in_d));
      fill_send_row(rt, i, row, d, a.E_local, a.send_row_slot, a.send_probs, a.send_expert);
    }
  }
  a.send_slot_row[i] = row;
}

__global__ void __launch_bounds__(kThreads) dropped_kernel(EpCapacityArgs a) {
  uint32_t any = 0;
  for (int d = threadIdx.x; d < a.P; d += kThreads) {
    const int64_t drop = a.pack_count[d] > a.C ? a.pack_count[d] - a.C : 0;
    a.dropped[d] = drop;
    any |= drop > 0 ? 1u : 0u;
  }
  if (__syncthreads_or(any) && threadIdx.x == 0) atomicOr(a.error_word, kErrRowOverflow);
}

}  // namespace

void launch_ep_capacity(const EpCapacityArgs& a, cudaStream_t stream) {
  const int64_t rows = static_cast<int64_t>(a.P) * a.C;
  if (rows > 0) {
    clear_send_rows_kernel<<<static_cast<unsigned>((rows + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        rows, a.send_row_slot, a.send_probs, a.send_expert);
    MOE_CUDA_CHECK_LAUNCH();
  }
  const int64_t n = static_cast<int64_t>(a.routing.T) * a.routing.slots;
  if (n > 0) {
    capacity_rows_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(a);
    MOE_CUDA_CHECK_LAUNCH();
  }
  dropped_kernel<<<1, kThreads, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::kernels
