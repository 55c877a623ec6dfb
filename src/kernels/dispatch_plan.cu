// Dispatch plan on the device (docs/semantics.md, Dispatch and Errors): validate every routing
// slot, count tokens per expert, pad, take offsets, and give every slot its destination row --
// deterministically, without atomics whose order could change the result.
//
// The flat slot sequence i = t * slots + s is cut into chunks of consecutive slots, one warp each.
//   1. count:    per chunk and expert, how many valid slots (the lanes of a step with the same
//                expert from __match_any_sync, one add per expert into a per-warp histogram in
//                shared memory; a sum, so the order of updates does not matter).
//   2. scan:     per expert, exclusive sum over the chunks -> the expert's rows before the chunk,
//                and count[e].
//   3. finalize: padded counts, offsets (exclusive sum over experts), group offsets, int64 copies,
//                the overflow and pre-padded checks.
//   4. assign:   walk each chunk again in the same order; a slot's row is offset[e] + (rows of e in
//                earlier chunks) + (rows of e earlier in this chunk), i.e. offset[e] + #{t' < t
//                routed to e}. Writes slot_row, row_slot and probs_perm.
// The count and assign kernels read the routing through SlotReader (slot_reader.cuh, as the
// expert-parallel pack does), a 32-slot step per warp with the loads of 8 steps issued together
// (map form: the map bytes, then the probs of the entries on the map), so they agree on which
// entries are skipped; only the count kernel raises their error bits.
#include <cub/block/block_scan.cuh>

#include "device/cuda_check.h"
#include "kernels/dispatch_kernels.h"
#include "kernels/slot_reader.cuh"
#include "device/vec16.cuh"
#include "moe/device_errors.h"

namespace moe::kernels {
namespace {

constexpr int kWarps = 4;     // chunks (warps) per block of the count and assign kernels
constexpr int kSteps = 8;     // 32-slot steps whose loads are issued together
constexpr int kScanThreads = 256;

// Groups of kSteps * 32 slots per chunk: larger chunks for many experts keep the [chunks, E]
// count table small next to the routing itself.
int chunk_groups(RoutingForm form, int E) {
  const int g = form == RoutingForm::kMap ? E / 32 : E / 128;
  return g < 1 ? 1 : g;
}

// 1. Per-chunk, per-expert counts.
__global__ void __launch_bounds__(kWarps * 32)
    count_kernel(SlotReader rd, int groups, int32_t num_chunks, int32_t* chunk_count, uint32_t* error_word) {
  extern __shared__ int32_t hist_all[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t chunk = blockIdx.x * kWarps + warp;
  if (chunk >= num_chunks) return;  // the whole warp leaves: only warp-level sync below
  int32_t* hist = hist_all + warp * rd.E;
  for (int e = lane; e < rd.E; e += 32) hist[e] = 0;
  __syncwarp();
  uint32_t bits = 0;
  const int32_t first = chunk * groups * kSteps * 32;
  for (int g = 0; g < groups; ++g) {
    const int32_t group_first = first + g * kSteps * 32;
    SlotReader::StepLoad ld[kSteps];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) ld[j] = rd.load_step(group_first + j * 32, lane);
#pragma unroll
    for (int j = 0; j < kSteps; ++j) rd.load_step_probs(group_first + j * 32, lane, ld[j]);
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      unsigned peers;
      const int e = rd.decide_step(group_first + j * 32, lane, ld[j], bits, peers);
      // One lane per expert adds the step's count.
      if (e >= 0 && lane == __ffs(peers) - 1) hist[e] += __popc(peers);
      __syncwarp();
    }
  }
  int32_t* out = chunk_count + static_cast<int64_t>(chunk) * rd.E;
  for (int e = lane; e < rd.E; e += 32) out[e] = hist[e];
  bits = __reduce_or_sync(kFullMask, bits);
  if (lane == 0 && bits) atomicOr(error_word, bits);
}

// 2. Per expert (one block each): exclusive sum of its chunk counts, in place; count[e].
__global__ void __launch_bounds__(kScanThreads)
    scan_chunks_kernel(int32_t* chunk_count, int32_t num_chunks, int E, int32_t* count32) {
  using Scan = cub::BlockScan<int32_t, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int e = blockIdx.x;
  int32_t running = 0;
  for (int32_t c0 = 0; c0 < num_chunks; c0 += kScanThreads) {
    const int32_t c = c0 + threadIdx.x;
    int32_t* p = chunk_count + static_cast<int64_t>(c) * E + e;
    const int32_t v = c < num_chunks ? *p : 0;
    int32_t excl, total;
    Scan(tmp).ExclusiveSum(v, excl, total);
    if (c < num_chunks) *p = running + excl;
    running += total;
    __syncthreads();  // tmp is reused by the next tile
  }
  if (threadIdx.x == 0) count32[e] = running;
}

// 3. One block: padded counts, offsets, group offsets, int64 copies; overflow / pre-padded flags.
__global__ void __launch_bounds__(kScanThreads) finalize_kernel(PlanArgs a) {
  using Scan = cub::BlockScan<int64_t, kScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  uint32_t bits = 0;
  int64_t running = 0;
  for (int e0 = 0; e0 < a.E; e0 += kScanThreads) {
    const int e = e0 + threadIdx.x;
    const int64_t c = e < a.E ? a.count32[e] : 0;
    int64_t p = c;
    if (a.align > 0) {
      if (!a.pre_padded)
        p = (c + a.align - 1) / a.align * a.align;  // an empty expert stays 0
      else if (c % a.align != 0)
        bits |= kErrMisalignedPrepadded;  // never padded a second time
    }
    int64_t excl, total;
    Scan(tmp).ExclusiveSum(p, excl, total);
    if (e < a.E) {
      const int64_t off = running + excl;
      a.padded32[e] = static_cast<int32_t>(p);
      a.offset32[e] = static_cast<int32_t>(off);
      a.count64[e] = c;
      a.padded64[e] = p;
      a.offset64[e] = off;
      a.group_offsets[e + 1] = static_cast<int32_t>(min(off + p, static_cast<int64_t>(a.R)));
    }
    running += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    a.group_offsets[0] = 0;
    if (running > a.R) bits |= kErrRowOverflow;  // rows past R are not written (assign_kernel)
  }
  if (bits) atomicOr(a.error_word, bits);
}

// 4. Destination rows, walking each chunk exactly as count_kernel did.
__global__ void __launch_bounds__(kWarps * 32)
    assign_kernel(SlotReader rd, int groups, int32_t num_chunks, const int32_t* chunk_base, const int32_t* offset32,
                  int32_t R, int32_t* slot_row, int32_t* row_slot, float* probs_perm) {
  extern __shared__ int32_t next_all[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t chunk = blockIdx.x * kWarps + warp;
  if (chunk >= num_chunks) return;
  int32_t* next = next_all + warp * rd.E;  // next row of each expert in this chunk
  const int32_t* base = chunk_base + static_cast<int64_t>(chunk) * rd.E;
  for (int e = lane; e < rd.E; e += 32) next[e] = offset32[e] + base[e];
  __syncwarp();
  uint32_t ignored = 0;  // count_kernel raised the bits already
  const int32_t first = chunk * groups * kSteps * 32;
  const unsigned lt = lanemask_lt();
  for (int g = 0; g < groups; ++g) {
    const int32_t group_first = first + g * kSteps * 32;
    SlotReader::StepLoad ld[kSteps];
#pragma unroll
    for (int j = 0; j < kSteps; ++j) ld[j] = rd.load_step(group_first + j * 32, lane);
#pragma unroll
    for (int j = 0; j < kSteps; ++j) rd.load_step_probs(group_first + j * 32, lane, ld[j]);
#pragma unroll
    for (int j = 0; j < kSteps; ++j) {
      const int32_t step_first = group_first + j * 32, i = step_first + lane;
      unsigned peers;
      const int e = rd.decide_step(step_first, lane, ld[j], ignored, peers);
      // Rows of a step go to the lanes in lane order, i.e. in token order.
      const int32_t dst = e >= 0 ? next[e] + __popc(peers & lt) : -1;
      __syncwarp();
      if (e >= 0 && lane == __ffs(peers) - 1) next[e] += __popc(peers);
      __syncwarp();
      if (i < rd.n) {
        const bool written = e >= 0 && dst < R;  // dst >= R: overflow, flagged by finalize_kernel
        slot_row[i] = written ? dst : -1;
        if (written) {
          row_slot[dst] = i;
          probs_perm[dst] = ld[j].prob;
        }
      }
    }
  }
}

}  // namespace

int plan_chunk_slots(RoutingForm form, int E) { return chunk_groups(form, E) * kSteps * 32; }

int64_t plan_num_chunks(RoutingForm form, int64_t T, int slots, int E) {
  const int64_t cs = plan_chunk_slots(form, E);
  return (T * slots + cs - 1) / cs;
}

void launch_plan(const PlanArgs& a, cudaStream_t stream) {
  const SlotReader rd{a.form, a.T * a.slots, a.slots, a.E, a.indices, a.map, a.probs};
  const int groups = chunk_groups(a.form, a.E);
  const int32_t num_chunks = static_cast<int32_t>(plan_num_chunks(a.form, a.T, a.slots, a.E));
  const size_t smem = sizeof(int32_t) * kWarps * a.E;
  const unsigned blocks = static_cast<unsigned>((num_chunks + kWarps - 1) / kWarps);

  // Rows nobody claims (pad rows, rows past sum(padded)) read as "no slot" with prob 0.
  if (a.R > 0) {
    MOE_CUDA_CHECK(cudaMemsetAsync(a.row_slot, 0xff, sizeof(int32_t) * a.R, stream));
    MOE_CUDA_CHECK(cudaMemsetAsync(a.probs_perm, 0, sizeof(float) * a.R, stream));
  }
  if (num_chunks > 0) {
    count_kernel<<<blocks, kWarps * 32, smem, stream>>>(rd, groups, num_chunks, a.chunk_count, a.error_word);
    MOE_CUDA_CHECK_LAUNCH();
  }
  scan_chunks_kernel<<<a.E, kScanThreads, 0, stream>>>(a.chunk_count, num_chunks, a.E, a.count32);
  MOE_CUDA_CHECK_LAUNCH();
  finalize_kernel<<<1, kScanThreads, 0, stream>>>(a);
  MOE_CUDA_CHECK_LAUNCH();
  if (num_chunks > 0) {
    assign_kernel<<<blocks, kWarps * 32, smem, stream>>>(rd, groups, num_chunks, a.chunk_count, a.offset32, a.R,
                                                         a.slot_row, a.row_slot, a.probs_perm);
    MOE_CUDA_CHECK_LAUNCH();
  }
}

}  // namespace moe::kernels
