// The stage ring shared by the fused kernels' producer and consumer warp groups: a position in the
// ring with its barrier parity, and the consumers' release of a stage to the producers of every CTA
// of the cluster (whose TMA multicasts write into all of them).
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

namespace moe::fused {

template <int kStages>
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;  // producers waiting on fresh "empty" barriers start at parity 1
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  // Moves past n positions (a ping-pong consumer skipping the other warp group's stages).
  __device__ __forceinline__ void skip(int n) {
    const int s = stage + n;
    phase ^= static_cast<uint32_t>(s / kStages) & 1u;
    stage = s % kStages;
  }
};

// The arrivals one CTA's consumers make on a stage's `empty` barrier through release_stage: one per
// warp of `consumer_threads`, or one per thread with `every_thread` (the barrier's count is this
// times the CTAs of the cluster).
__host__ __device__ constexpr int stage_releases(int consumer_threads, bool every_thread) {
  return every_thread ? consumer_threads : consumer_threads / 32;
}

// Called by every consumer warp. The barrier counts one arrival per warp of each CTA, or, with
// `every_thread`, one per consumer thread: a kernel whose consumers read a stage with ordinary
// shared-memory loads (not only through WGMMA) releases it that way, so that each reading thread's
// own arrival orders its reads before the producer's next copies into the stage. The __syncwarp
// before one lane's arrival orders them too under the PTX memory model, but compute-sanitizer's
// racecheck only counts a thread's own arrival (it reports the other lanes' reads as WAR hazards).
template <int kCluster>
__device__ __forceinline__ void release_stage(uint64_t* empty, int lane, bool every_thread) {
  __syncwarp();
  if (every_thread || lane == 0) {
    if constexpr (kCluster == 1) {
      cutlass::arch::ClusterBarrier::arrive(empty);
    } else {
#pragma unroll
      for (int r = 0; r < kCluster; ++r) cutlass::arch::ClusterBarrier::arrive(empty, r, 1);
    }
  }
}

}  // namespace moe::fused
