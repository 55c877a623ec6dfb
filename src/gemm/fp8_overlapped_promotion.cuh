// The FP8 block-scaled main loop with the promotion of one 128-long reduction block overlapped with
// the next block's WGMMAs (docs/gemm.md, FP8).
//
// CUTLASS's block-scaled collective issues a block's WGMMAs into a temporary accumulator, waits for
// them, then promotes it into the fp32 accumulator with the block's scales -- fp32 work on the same
// warps, while the tensor cores idle. In the weight-gradient form both operands carry a scale per
// row, so the promotion is two operations per accumulator element and ~34 shared-memory scale loads
// per thread and block: about as long as the block's WGMMAs. Here the temporary accumulator is
// double-buffered: block k's WGMMAs are issued into one buffer before block k - 1's buffer is
// promoted, so the promotion runs while the tensor cores work. The arithmetic is CUTLASS's, in the
// same order (accum += temp * scale_a * scale_b per block, blocks in order), so the results are the
// same bits. The collective is otherwise the base's: its producer, pipeline, scale layouts and
// tail (`mma_tail` releases the last block's stage, as after the base's `mma`).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>

#include "gemm/fp8_promotion_operands.cuh"

namespace moe::gemm {

template <class Base>
struct OverlappedPromotionMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  using ElementScale = typename Base::ElementBlockScale;
  static_assert(Base::ScalePromotionInterval == 4, "one promotion per k tile (the finest promotion interval)");
  static_assert(Base::ScaleMsPerTile > 1, "A scaled per row (the 1 x 128 token blocks)");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    TiledMma tiled_mma;
    auto operands = promotion_operands<Base>(shared_tensors, thread_idx);  // named, not bound: lambdas use them
    const ScalesReadBarrier scales_read(thread_idx);
    auto& tCrA = get<0>(operands);
    auto& tCrB = get<1>(operands);
    auto& tCsSFA = get<2>(operands);
    auto& tCsSFB = get<3>(operands);
    auto& tCrSFA = get<4>(operands);
    auto& tCrSFB = get<5>(operands);
    // promote() indexes the scales by the accumulator's element index.
    CUTE_STATIC_ASSERT_V(shape(tCrSFA) == shape(accum));
    CUTE_STATIC_ASSERT_V(shape(tCrSFB) == shape(accum));
    Tensor temp0 = make_fragment_like(accum);
    Tensor temp1 = make_fragment_like(accum);

    // Block k's WGMMAs into `temp` (zeroed by the first one), left in flight.
    auto issue = [&](auto& temp, int stage) {
      warpgroup_fence_operand(temp);
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), temp);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      // No operand fence here: an instruction touching the registers of a WGMMA in flight makes
      // ptxas serialize the WGMMAs (warning C7514). promote() fences a buffer after its wait.
    };
    // The block's scales into registers (the stage is still held). Loaded after the wait: before
    // it, with both buffers and the accumulator live, the weight-gradient form spills.
    auto load_scales = [&](int stage) {
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), tCrSFB);
    };
    // accum += temp x the loaded scales, CUTLASS's expressions.
    auto promote = [&](auto& temp) {
      warpgroup_fence_operand(temp);
      warpgroup_fence_operand(accum);
      if constexpr (Base::ScaleNsPerTile > 1) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * tCrSFA(i) * tCrSFB(i);
      } else {
        const ElementScale scale_b = tCrSFB(_0{});
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(filter_zeros(tCrSFA)); ++i) filter_zeros(tCrSFA)(i) = filter_zeros(tCrSFA)(i) * scale_b;
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * tCrSFA(i);
      }
      warpgroup_fence_operand(accum);
    };

    // accum, and temp1 (first written by a WGMMA inside the loop), defined before the first WGMMA is
    // issued: sunk below it, their initial copies read registers ptxas shares with the WGMMA in
    // flight, and it waits for that WGMMA there (warning C7517).
    clear(accum);
    clear(temp1);
    warpgroup_fence_operand(accum);
    warpgroup_fence_operand(temp1);
    if (k_tile_count <= 0) return;
    PipelineState release = smem_pipe_read;
    // Hands block `stage` (in `done`) to the accumulator once the WGMMAs issued after it are the
    // only ones in flight, then frees its stage.
    auto retire = [&](auto& done, int stage) {
      warpgroup_wait<1>();
      load_scales(stage);
      promote(done);
      // Only two threads of the warp group arrive on the stage's empty barrier: the warp group's
      // barrier orders the scale reads of all four warps before them, so that the producer's next
      // copies into the stage cannot overtake a lagging warp's reads.
      scales_read.sync();
      pipeline.consumer_release(release);
      ++release;
    };
    auto next_stage = [&] {
      pipeline.consumer_wait(smem_pipe_read);
      const int stage = smem_pipe_read.index();
      ++smem_pipe_read;
      return stage;
    };
    // Even blocks go to temp0, odd blocks to temp1. Every trip starts and ends with one block in
    // flight in temp0 and handles two more, so the buffers are fixed registers and no path through
    // the loop meets a WGMMA in flight on the buffer it is about to write (ptxas serialises the
    // WGMMAs otherwise: warning C7514).
    int stage0 = next_stage();
    issue(temp0, stage0);
    int k = 1;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k + 1 < k_tile_count; k += 2) {
      const int stage1 = next_stage();
      issue(temp1, stage1);
      retire(temp0, stage0);
      stage0 = next_stage();
      issue(temp0, stage0);
      retire(temp1, stage1);
    }
    if (k < k_tile_count) {  // one block left after the one in flight
      const int stage1 = next_stage();
      issue(temp1, stage1);
      retire(temp0, stage0);
      warpgroup_wait<0>();
      load_scales(stage1);
      promote(temp1);
    } else {
      warpgroup_wait<0>();
      load_scales(stage0);
      promote(temp0);
    }
    scales_read.sync();  // as in retire(): before the tail's release of the last stage
    // The last block's stage stays held: the kernel's mma_tail releases it.
  }
};

}  // namespace moe::gemm
