// The dropless layout of a source rank's send buffer (docs/expert_parallel.md, Dropless mode): the
// dropless pack plan already ranks every entry inside its destination in pack order (token, then
// slot) and places the destinations' blocks back to back, so its row is the send row; this kernel
// writes the per-row bookkeeping the later stages read, and the send side of the counts exchange.
// A pure function of the plan (no atomics whose order could matter).
#include "device/cuda_check.h"
#include "ep/ep_kernels.h"
#include "ep/send_row.cuh"

namespace moe::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads) dropless_rows_kernel(EpDroplessArgs a) {
  const EpRouting& rt = a.routing;
  const int64_t n = static_cast<int64_t>(rt.T) * rt.slots;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= n) return;
  const int32_t d = a.slot_dest[i];
  int32_t row = -1;
  if (d >= 0) {
    row = a.pack_slot_row[i];
    fill_send_row(rt, i, row, d, a.E_local, a.send_row_slot, a.send_probs, a.send_expert);
  }
  a.send_slot_row[i] = row;
}

// count_blocks[b * P + d] = pack_count[d] for every block b (one per destination rank).
__global__ void __launch_bounds__(kThreads) count_blocks_kernel(const int64_t* pack_count, int P, int64_t* out) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i < static_cast<int64_t>(P) * P) out[i] = pack_count[i % P];
}

}  // namespace

void launch_ep_dropless(const EpDroplessArgs& a, cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(a.routing.T) * a.routing.slots;
  if (n > 0) {
    dropless_rows_kernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(a);
    MOE_CUDA_CHECK_LAUNCH();
  }
  const int64_t blocks = static_cast<int64_t>(a.P) * a.P;
  count_blocks_kernel<<<static_cast<unsigned>((blocks + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      a.pack_count, a.P, a.count_blocks);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::kernels
