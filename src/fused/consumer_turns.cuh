// The consumer warp groups' turns over their CTA's tiles in the two schedules of the row-tile
// kernels whose warp groups each hold 64 rows (the fused fc2 dgrad, the rows GEMM):
//   * ping-pong: tile i of the CTA belongs to warp group i % 2, so that one's epilogue runs while the
//     other's main loop keeps the tensor cores busy. They read one stage ring in tile order: a warp
//     group skips the stages of the other's tiles, and an order barrier lets it start a main loop
//     only after the other has finished its previous one. That keeps every wait on a stage barrier
//     at most one phase ahead of it (a parity wait two phases ahead would pass on the wrong phase).
//   * cooperative: both warp groups take every tile, 64 rows each.
// Use: for (turn = first_turn(), t = first tile + turn * stride; t < total; turn += kTurnStep,
// t += kTurnStep * stride) { begin(order, turn); main loop on `ring`; end(order, lane); epilogue }.
#pragma once

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "fused/pipeline.cuh"

namespace moe::fused {

template <bool kCoop, int kStages>
struct ConsumerTurns {
  static constexpr int kGroups = 2;
  static constexpr int kTurnStep = kCoop ? 1 : kGroups;
  RingPosition<kStages> ring;
  uint32_t order_phase = 0;
  int group, k_blocks;

  __device__ __forceinline__ ConsumerTurns(int group_, int k_blocks_) : group(group_), k_blocks(k_blocks_) {
    ring.phase = 0;
    if constexpr (!kCoop) ring.skip(group * k_blocks);  // warp group 1's first tile is the CTA's second
  }
  __device__ __forceinline__ int first_turn() const { return kCoop ? 0 : group; }
  // Before the main loop of `turn`: (ping-pong) the other warp group's previous main loop has
  // passed all its stage waits. order: one barrier per warp group, counting the other's warps.
  __device__ __forceinline__ void begin(uint64_t* order, int turn) {
    if (!kCoop && turn > 0) {
      cutlass::arch::ClusterBarrier::wait(&order[group], order_phase);
      order_phase ^= 1;
    }
  }
  // After it: (ping-pong) the ring passes to the other warp group for the next tile; this one skips
  // that tile's stages. Called by every thread of the warp group.
  __device__ __forceinline__ void end(uint64_t* order, int lane) {
    if constexpr (!kCoop) {
      __syncwarp();
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&order[group ^ 1]);
      ring.skip(k_blocks);
    }
  }
};

}  // namespace moe::fused
