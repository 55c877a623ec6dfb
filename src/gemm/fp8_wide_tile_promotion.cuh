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
// products and each element costs one FMA. The scales' producer is ours too (`load_auxiliary`,
// below: four k blocks per 16-byte load where it can); the rest is the base's: operand producer,
// pipeline, scale layouts and tail (`mma_tail` releases the last block's stage).
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/memory_sm80.h>
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
  using ElementScale = typename Base::ElementBlockScale;
  static_assert(Base::ScalePromotionInterval == 4, "one promotion per k tile (the finest promotion interval)");
  static_assert(Base::ScaleMsPerTile > 1 && Base::ScaleNsPerTile > 1,
                "A scaled per row, B per block of rows narrower than the tile");

  static_assert(Base::ScaleGranularityM == 1, "token scales per row");

  // The scale producer warp. The token scales are K-major ([rows, k blocks] per group), so one k
  // block's 128 scales lie in 128 different lines: copied one word per row and stage (CUTLASS's
  // way), each stage costs 128 scattered L1 requests, and they compete with the TMA writes and the
  // WGMMA reads for the SM's shared-memory port (Nsight Compute: L1 throughput 75% against
  // DeepGEMM's 66%, which loads MN-major scales by TMA). So where a row's scales allow 16-byte
  // loads, each lane loads four k blocks of its rows (i, i + 32, ...) and of weight-scale block i
  // at once into registers and stores one k block per stage: a quarter of the requests. The next
  // four are loaded right after the last of them is stored, so the loads overlap the wait for the
  // next free stage. Otherwise (a reduction of other than a multiple of 4 blocks, misaligned
  // scales) every word is copied by `cp.async` from one lane. Each word is written by one lane
  // (CUTLASS's producer gives lanes 0-2 each all three weight-scale blocks: the same values, but a
  // write-write race). Out-of-range rows and blocks are not copied (their products are not
  // stored). Every lane arrives, as the pipeline's producer barrier counts the warp.
  template <class TensorA, class TensorB, class TensorSFA, class TensorSFB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const&, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, TensorSFA, TensorSFB> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int lane, uint32_t, TensorStorage& shared_tensors) {
    using namespace cute;
    Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), typename Base::SmemLayoutSFA{});
    Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), typename Base::SmemLayoutSFB{});
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor mSFA = get<2>(load_inputs);  // (m, k, l), broadcast within a scale block
    Tensor mSFB = get<3>(load_inputs);  // (n, k, l)
    // This work tile's (BLK_M, BLK_K, k) and (BLK_N, BLK_K, k) views, values and coordinates.
    Tensor gSFA = local_tile(mSFA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor cSFA = local_tile(make_identity_tensor(shape(mSFA)), TileShape{}, make_coord(_, _, _),
                             Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor gSFB = local_tile(mSFB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    Tensor cSFB = local_tile(make_identity_tensor(shape(mSFB)), TileShape{}, make_coord(_, _, _),
                             Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    constexpr int kLanes = cutlass::NumThreadsPerWarp;
    constexpr int kRowsPerLane = Base::ScaleMsPerTile / kLanes;
    constexpr int kBlocksPerLoad = 4;  // k blocks per 16-byte load
    static_assert(Base::ScaleMsPerTile % kLanes == 0, "whole rows per lane");
    static_assert(Base::ScaleNsPerTile <= kLanes, "one lane per weight-scale block");
    if (k_tile_count <= 0) return;
    const int k0 = *k_tile_iter;
    const int b_col = lane * Base::ScaleGranularityN;
    const bool b_lane = lane < Base::ScaleNsPerTile && elem_less(cSFB(b_col, 0, k0), shape(mSFB));
    uint32_t row_ok = 0;  // bit j: row lane + 32 j lies in the group
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerLane; ++j)
      row_ok |= uint32_t(elem_less(cSFA(lane + j * kLanes, 0, k0), shape(mSFA))) << j;

    // 16-byte loads need whole groups of four k blocks (nothing is read past a row's end),
    // consecutive k blocks contiguous (K-major), and every scale row starting 16-byte aligned: the
    // tile's first one, and a distance to the next one (`next_row` rows of the view further) that
    // is a multiple of four words.
    auto vector_ok = [&](auto const& g, int next_row) {
      const auto* p = &g(0, 0, k0);
      return &g(0, 0, k0 + 1) - p == 1 && (&g(next_row, 0, k0) - p) % kBlocksPerLoad == 0 &&
             reinterpret_cast<uintptr_t>(p) % 16 == 0;
    };
    const bool vectorized = k_tile_count % kBlocksPerLoad == 0 && vector_ok(gSFA, Base::ScaleGranularityM) &&
                            vector_ok(gSFB, Base::ScaleGranularityN);

    if (vectorized) {
      float4 a[kRowsPerLane] = {};
      float4 b = {};
      auto load = [&](int k) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kRowsPerLane; ++j)
          if (row_ok >> j & 1u) a[j] = *reinterpret_cast<const float4*>(&gSFA(lane + j * kLanes, 0, k));
        if (b_lane) b = *reinterpret_cast<const float4*>(&gSFB(b_col, 0, k));
      };
      load(k0);
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = 0; i < k_tile_count; i += kBlocksPerLoad) {
        CUTLASS_PRAGMA_UNROLL
        for (int q = 0; q < kBlocksPerLoad; ++q) {
          pipeline.producer_acquire(smem_pipe_write);
          const int stage = smem_pipe_write.index();
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kRowsPerLane; ++j)
            if (row_ok >> j & 1u) sSFA(lane + j * kLanes, 0, stage) = (&a[j].x)[q];
          if (b_lane) sSFB(b_col, 0, stage) = (&b.x)[q];
          // A plain arrive releases the stores above to the consumers' wait (acquire).
          pipeline.producer_commit(smem_pipe_write, [](uint64_t* bar) { cutlass::arch::ClusterBarrier::arrive(bar); });
          ++smem_pipe_write;
        }
        if (i + kBlocksPerLoad < k_tile_count) load(k0 + i + kBlocksPerLoad);
      }
      return;
    }

    using Copy = cutlass::arch::cp_async<sizeof(ElementScale), cutlass::arch::CacheOperation::Always>;
    CUTLASS_PRAGMA_NO_UNROLL
    for (; k_tile_count > 0; --k_tile_count) {
      pipeline.producer_acquire(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      const auto k = *k_tile_iter;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRowsPerLane; ++j) {
        const int row = lane + j * kLanes;
        Copy(&sSFA(row, 0, stage), &gSFA(row, 0, k), row_ok >> j & 1u);
      }
      if (b_lane) Copy(&sSFB(b_col, 0, stage), &gSFB(b_col, 0, k));
      pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
      ++k_tile_iter;
      ++smem_pipe_write;
    }
  }

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
