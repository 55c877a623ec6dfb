// The FP8 block-scaled main loop for fprop-form tiles wider than 128 (docs/gemm.md, FP8): one
// temporary accumulator (a second one, as in fp8_overlapped_promotion.cuh, does not fit the
// registers beyond 128 columns), promoted after each 128-deep reduction block with one fused
// multiply-add per element.
//
// The weights' scales come per 64 rows here (each 128 x 128 block's scale restated for both of its
// halves), so that a 192-wide tile holds whole scale blocks. CUTLASS's collective cannot promote
// such a tile (its promotion requires the scale fragment to have the accumulator's nested shape,
// and three scale blocks per tile nest differently), and it would multiply by the two scales one
// after the other (two operations per element). Here the product of the row's and the block's
// scale is formed first: a thread's fragment spans 2 rows and 3 blocks, so the compiler keeps 6
// products and each element costs one FMA. The base is the collective with our scale producer
// (fp8_scale_producer.cuh); the rest is CUTLASS's: operand producer, pipeline, scale layouts and
// tail (`mma_tail` releases the last block's stage).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>

#include "gemm/fp8_promotion_operands.cuh"

namespace moe::gemm {

template <class Base>
struct WideTilePromotionMainloop : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using typename Base::TiledMma;
  static_assert(Base::ScalePromotionInterval == 4, "one promotion per k tile (the finest promotion interval)");
  static_assert(Base::ScaleMsPerTile > 1 && Base::ScaleNsPerTile > 1,
                "A scaled per row, B per block of rows narrower than the tile");

  template <class FrgTensorC>
  CUTLASS_DEVICE void mma(MainloopPipeline pipeline, PipelineState smem_pipe_read, FrgTensorC& accum, int k_tile_count,
                          int thread_idx, TensorStorage& shared_tensors, Params const&) {
    using namespace cute;
    TiledMma tiled_mma;
    auto operands = promotion_operands<Base>(shared_tensors, thread_idx);  // named, not bound: lambdas use them
    auto& tCrA = get<0>(operands);
    auto& tCrB = get<1>(operands);
    auto& tCsSFA = get<2>(operands);
    auto& tCsSFB = get<3>(operands);
    auto& tCrSFA = get<4>(operands);
    auto& tCrSFB = get<5>(operands);
    // The scale fragments nest the tile's columns by scale block ((8, 3) where the accumulator has
    // 24), in the same order: the promotion indexes all three by the element's linear index.
    CUTE_STATIC_ASSERT_V(size(tCrSFA) == size(accum));
    CUTE_STATIC_ASSERT_V(size(tCrSFB) == size(accum));
    Tensor temp = make_fragment_like(accum);
    const ScalesReadBarrier scales_read(thread_idx);

    clear(accum);
    warpgroup_fence_operand(accum);
    // Each block's full barrier is tested (try_wait) before the previous block's promotion, so
    // that a stage which landed meanwhile costs no second barrier round trip (as CUTLASS's collective
    // does; measured 2-3% on the FP8 fprop form).
    auto barrier_token = pipeline.consumer_try_wait(smem_pipe_read);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int k = 0; k < k_tile_count; ++k) {
      pipeline.consumer_wait(smem_pipe_read, barrier_token);
      const int stage = smem_pipe_read.index();
      warpgroup_fence_operand(temp);
      warpgroup_arrive();
      tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
      CUTLASS_PRAGMA_UNROLL
      for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
        cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), temp);
        tiled_mma.accumulate_ = GMMA::ScaleOut::One;
      }
      warpgroup_commit_batch();
      // The scales load while the WGMMAs run (the stage is held until the release below).
      copy(tCsSFA(_, _, _, make_coord(_0{}, stage)), tCrSFA);
      copy(tCsSFB(_, _, _, make_coord(_0{}, stage)), tCrSFB);
      warpgroup_wait<0>();
      warpgroup_fence_operand(temp);
      // The stage's operands and scales are consumed: hand it back before promoting. Only two
      // threads of the warp group arrive on its empty barrier (one per CTA of the cluster), so the
      // warp group's barrier first orders the scale reads of all four warps before them (and
      // before the tail's release of the last stage): the producer's next stores into the stage
      // must not overtake a lagging warp's reads.
      scales_read.sync();
      if (k + 1 < k_tile_count) pipeline.consumer_release(smem_pipe_read);
      ++smem_pipe_read;
      barrier_token = pipeline.consumer_try_wait(smem_pipe_read, k + 1 == k_tile_count);
      warpgroup_fence_operand(accum);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < size(accum); ++i) accum(i) += temp(i) * (tCrSFA(i) * tCrSFB(i));
      warpgroup_fence_operand(accum);
    }
    // The last block's stage stays held: the kernel's mma_tail releases it.
  }
};

}  // namespace moe::gemm
