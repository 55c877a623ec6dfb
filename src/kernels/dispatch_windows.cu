// Token chunks of a dispatch plan (Dispatcher::chunk_windows; docs/state.md, token chunks).
//
// The plan puts token t's slot for expert e at row offset[e] + #{t' < t routed to e}: inside an
// expert the rows follow the tokens. So the rows of a chunk of consecutive tokens [c Tc, (c+1) Tc)
// are one window of each expert's rows, found by a binary search of the row map (row_slot rises
// inside an expert's real rows), and the chunk's windows are packed one after the other by an
// exclusive sum over the experts. A second kernel gives every slot its row in its chunk's packed
// rows, which the combine of that chunk reads instead of the plan's rows.
#include <algorithm>

#include <cub/block/block_scan.cuh>

#include "device/cuda_check.h"
#include "kernels/dispatch_kernels.h"

namespace moe::kernels {
namespace {

constexpr int kScanThreads = 256;
constexpr int kExpertsPerThread = 4;  // 1024 experts per block (the dispatcher's bound)

// The first of rows [lo, hi) whose slot is at or past `slot` (hi if none): row_slot rises there.
__device__ int32_t first_row_from(const int32_t* row_slot, int32_t lo, int32_t hi, int64_t slot) {
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo) / 2;
    if (row_slot[mid] < slot) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

// One block per chunk: each expert's window, then the windows packed in expert order.
__global__ void __launch_bounds__(kScanThreads) windows_kernel(WindowArgs a) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage scan;
  const int c = blockIdx.x;
  const int64_t first_slot = static_cast<int64_t>(c) * a.Tc * a.slots;
  const int64_t end_slot = static_cast<int64_t>(c + 1) * a.Tc * a.slots;
  int32_t begin[kExpertsPerThread], n[kExpertsPerThread];
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x * kExpertsPerThread + i;
    begin[i] = 0, n[i] = 0;
    if (e >= a.E) continue;
    // The expert's real rows (no pad rows), clamped to the rows that exist.
    const int64_t off = a.offset32[e];
    const int32_t lo = static_cast<int32_t>(off < a.R ? off : a.R);
    const int64_t real_end = off + a.count32[e];
    const int32_t hi = static_cast<int32_t>(real_end < a.R ? real_end : a.R);
    begin[i] = first_row_from(a.row_slot, lo, hi, first_slot);
    n[i] = first_row_from(a.row_slot, begin[i], hi, end_slot) - begin[i];
  }
  int32_t packed[kExpertsPerThread], total = 0;
  Scan(scan).ExclusiveSum(n, packed, total);
  int32_t* row_begin = a.row_begin + static_cast<int64_t>(c) * a.E;
  int32_t* offsets = a.offsets + static_cast<int64_t>(c) * (a.E + 1);
#pragma unroll
  for (int i = 0; i < kExpertsPerThread; ++i) {
    const int e = threadIdx.x * kExpertsPerThread + i;
    if (e >= a.E) continue;
    row_begin[e] = begin[i];
    offsets[e] = packed[i];
  }
  if (threadIdx.x == 0) offsets[a.E] = total;
}

// Every slot's row in its chunk's packed windows (-1 where it has no row).
__global__ void local_rows_kernel(WindowArgs a) {
  const int64_t n = static_cast<int64_t>(a.T) * a.slots;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    const int32_t row = a.slot_row[i];
    if (row < 0) {
      a.local_row[i] = -1;
      continue;
    }
    // The expert of the row: the last e with offset32[e] <= row (empty experts share the next one's
    // offset and hold no row).
    int lo = 0, hi = a.E - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (a.offset32[mid] <= row) lo = mid;
      else hi = mid - 1;
    }
    const int64_t c = (i / a.slots) / a.Tc;
    a.local_row[i] = row - a.row_begin[c * a.E + lo] + a.offsets[c * (a.E + 1) + lo];
  }
}

}  // namespace

void launch_chunk_windows(const WindowArgs& a, cudaStream_t stream) {
  if (a.chunks == 0 || a.E == 0) return;
  windows_kernel<<<a.chunks, kScanThreads, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH();
  const int64_t n = static_cast<int64_t>(a.T) * a.slots;
  if (n == 0) return;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 4096));
  local_rows_kernel<<<blocks, 256, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::kernels
