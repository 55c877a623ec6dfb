// A dynamic tile queue for a persistent kernel whose clusters walk tiles of unequal cost.
//
// A static stride (cluster c takes tiles c, c + C, c + 2C, ...) balances tiles of equal cost; where
// a tile's cost follows its expert's rows (a weight gradient reduces over them), skewed routing
// gives some clusters several times the work of others, and the SMs of the rest sit idle for the
// end of the kernel. Here each cluster takes its next tile from a global counter when it starts the
// previous one, so the clusters that drew cheap tiles draw more.
//
// One thread of the cluster's CTA 0 draws (atomicAdd on the counter) and writes the index into a
// slot of every CTA of the cluster -- the CTAs of a cluster work on one tile together (multicast
// loads) -- and each reading warp of every CTA takes it from its own slot. The slots form a small
// ring. The drawing thread is a producer thread: it draws and publishes the next index when it has
// issued a tile's loads, a few stages before the consumers need it.
//
// The counter is zero before a launch and zero after it, without a memset: every cluster draws
// until it draws an index past the last tile, exactly once each, so the cluster that draws the
// highest index (tiles + clusters - 1) makes the launch's last draw, and resets it. A launch that
// never ends (a trap) leaves it dirty; so does running two launches on one counter at once, which the
// owner of the counter must rule out, as for any workspace.
#pragma once

#include <cstdint>

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>

namespace moe::fused {

template <int kSlots>
struct TileQueueStorage {
  int index[kSlots];
  alignas(8) uint64_t full[kSlots];   // the slot holds a fresh index (one arrival: the drawing thread)
  alignas(8) uint64_t empty[kSlots];  // CTA 0's: every reading warp of the cluster has read the slot
};

template <int kSlots>
struct TileQueuePosition {
  int slot = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++slot == kSlots) {
      slot = 0;
      phase ^= 1;
    }
  }
};

// Once, before the cluster's first sync: `readers` is the number of reading warps of one CTA.
template <int kSlots, int kCluster>
__device__ __forceinline__ void init_tile_queue(TileQueueStorage<kSlots>& q, int readers) {
  for (int i = 0; i < kSlots; ++i) {
    cutlass::arch::ClusterBarrier::init(&q.full[i], 1);
    cutlass::arch::ClusterBarrier::init(&q.empty[i], kCluster * readers);
  }
  cutlass::arch::fence_barrier_init();
}

// The drawing thread (one thread of CTA 0) draws the next index from `counter` and publishes it in
// every CTA of the cluster: an arrival that expects 4 bytes on each CTA's `full` barrier, then the
// 4 bytes by an asynchronous remote store that completes them, so a reader that sees the phase
// complete sees the index (no fence on the drawing thread, which keeps loading tiles). `last` is
// the launch's last index (tiles + clusters - 1): its drawer resets the counter. A writer's position
// starts at parity 1: a fresh barrier counts as released for it.
template <int kSlots, int kCluster>
__device__ __forceinline__ void draw_tile(TileQueueStorage<kSlots>& q, TileQueuePosition<kSlots>& writer, int* counter,
                                          int last) {
  const int t = atomicAdd(counter, 1);  // in flight while the slot frees up
  cutlass::arch::ClusterBarrier::wait(&q.empty[writer.slot], writer.phase);
  if (t == last) *counter = 0;  // every other draw of the launch has returned: ready for the next
  const uint32_t index = cute::cast_smem_ptr_to_uint(&q.index[writer.slot]);
  const uint32_t full = cute::cast_smem_ptr_to_uint(&q.full[writer.slot]);
#pragma unroll
  for (int r = 0; r < kCluster; ++r) {
    cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&q.full[writer.slot], sizeof(int), r, 1);
    cute::store_shared_remote(static_cast<uint32_t>(t), index, full, r);
  }
  writer.advance();
}

// One lane of a reading warp (lane 0) takes the next index: it waits, reads and releases the slot
// to CTA 0's `empty` barrier (its own arrival orders its read before the slot's next write, as a
// consumer's release of a stage does for the next multicast into it). The warp gets the index by
// warp_tile.
template <int kSlots>
__device__ __forceinline__ int take_tile(TileQueueStorage<kSlots>& q, TileQueuePosition<kSlots>& reader) {
  cutlass::arch::ClusterBarrier::wait(&q.full[reader.slot], reader.phase);
  const int t = *reinterpret_cast<volatile int*>(&q.index[reader.slot]);
  cutlass::arch::ClusterBarrier::arrive(&q.empty[reader.slot], 0, 1);
  reader.advance();
  return t;
}

// Called by every lane of a warp: lane 0's index (the other lanes pass zero), by a warp-wide OR. The
// result lands in a uniform register, so the compiler knows every lane has it, and the tile loop's
// trip counts, ring positions and barrier addresses stay on the uniform datapath. A shuffle gives the
// same value but not known uniform: with one, the wgrad producer's copies were issued one by one
// instead of interleaved, and each stage's arrival became a loop over the warp's distinct addresses.
__device__ __forceinline__ int warp_tile(int from_lane0) {
  return static_cast<int>(__reduce_or_sync(0xffffffffu, static_cast<unsigned>(from_lane0)));
}

}  // namespace moe::fused
