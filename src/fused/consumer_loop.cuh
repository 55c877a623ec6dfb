// The consumers' side of the fused kernels' stage ring, shared by the fused fc1, the fused fc2 dgrad
// and the gathered weight gradient: the k loop of one tile (wait for a stage, WGMMA on it, hand the
// previous stage back once its WGMMAs are done) and the barriers' initialisation.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "fused/pipeline.cuh"

namespace moe::fused {

// full[i]: `full_arrivals` producer arrivals (cp.async threads, plus the TMA issuer's expect-tx);
// empty[i]: one arrival per consumer warp of every CTA of the cluster. Called by one thread, before
// the cluster-wide sync that precedes any arrival.
template <int kStages>
__device__ __forceinline__ void init_stage_barriers(uint64_t* full, uint64_t* empty, int full_arrivals,
                                                    int empty_arrivals) {
  for (int i = 0; i < kStages; ++i) {
    cutlass::arch::ClusterBarrier::init(&full[i], full_arrivals);
    cutlass::arch::ClusterBarrier::init(&empty[i], empty_arrivals);
  }
  cutlass::arch::fence_barrier_init();
}

// Accumulates k_blocks stages into acc (which the caller cleared): tCrA / tCrB are the WGMMA
// fragments of all stages (last mode: stage). `before(stage, kb)` runs once the stage has landed and
// before the WGMMAs read it (generic-proxy shared-memory writes it makes are fenced after it);
// `during(stage, kb)` runs while the stage's WGMMAs are in flight (reads of the stage only; a kernel
// whose `during` reads shared memory passes `every_thread_releases` and counts every consumer
// thread's arrival on `empty`, see release_stage).
template <int kCluster, int kStages, class Mma, class FragA, class FragB, class Acc, class Before, class During>
__device__ __forceinline__ void consume_k_blocks(Mma& mma, const FragA& tCrA, const FragB& tCrB, Acc& acc,
                                                 uint64_t* full, uint64_t* empty, RingPosition<kStages>& ring,
                                                 int k_blocks, int lane, Before&& before, During&& during,
                                                 bool every_thread_releases) {
  using namespace cute;
  int prev = -1;
  for (int kb = 0; kb < k_blocks; ++kb) {
    cutlass::arch::ClusterBarrier::wait(&full[ring.stage], ring.phase);
    before(ring.stage, kb);
    cutlass::arch::fence_view_async_shared();  // cp.async (generic proxy) writes -> WGMMA reads
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < size<2>(tCrA); ++kk) cute::gemm(mma, tCrA(_, _, kk, ring.stage), tCrB(_, _, kk, ring.stage), acc);
    warpgroup_commit_batch();
    during(ring.stage, kb);
    warpgroup_wait<1>();  // the previous stage's WGMMAs are done: hand it back
    warpgroup_fence_operand(acc);
    if (prev >= 0) release_stage<kCluster>(&empty[prev], lane, every_thread_releases);
    prev = ring.stage;
    ring.advance();
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  if (prev >= 0) release_stage<kCluster>(&empty[prev], lane, every_thread_releases);
}

}  // namespace moe::fused
