// The scale producer warp of the FP8 block-scaled fprop form (fprop, and dgrad on the weights'
// columnwise copy; docs/gemm.md, FP8): it fills each pipeline stage's token scales (one per row of
// the 128-row tile and 128-deep reduction block) and weight scales (one per block of weight rows in
// the tile) while the operand producer's TMA fills the stage's operands. It replaces CUTLASS's
// `load_auxiliary`, which copies every word by `cp.async` (128 scattered requests per stage for
// K-major token scales), and adds the token scales' MN-major layout.
//
// Token scales come in one of two layouts (GroupedArgs::a_scale_mn_ld):
//  - K-major [rows, ceil(K / 128)] (0): one k block's 128 scales lie in 128 different lines. Where
//    the reduction is a multiple of four blocks and the rows are 16-byte aligned, each lane loads
//    four k blocks of its rows (i, i + 32, ...) with one 16-byte load per row and stores one block
//    per stage (a quarter of the requests; the next four load right after the last is stored, so
//    the loads overlap the wait for the next free stage; 192-wide tiles only, see below).
//  - MN-major [ceil(K / 128), ld] (ld > 0, each group's pointer at its first row): a stage's 128
//    scales are one contiguous 512-byte run, copied by one bulk copy (`cp.async.bulk`, the TMA
//    engine) that completes on the stage's full barrier, as the operands do: no load through the
//    SM's L1 / shared-memory port, which the operands' TMA writes and the WGMMAs' reads keep busy
//    (Nsight Compute: 75% against DeepGEMM's 66% with the K-major copies). Needs the tile's first
//    scale 16-byte aligned (group starts and ld multiples of 4).
// Weight scales (K-major per expert) take the 16-byte loads under the same conditions. Anything
// else is copied word by word (`cp.async`, one lane per word). Each word is written by one lane
// (CUTLASS's producer gives lanes 0-2 each all three weight-scale blocks of a 192-wide tile: the
// same values, but a write-write race). Out-of-range rows and blocks are not copied (their
// products are not stored). Every lane arrives, as the pipeline's producer barrier counts the warp.
#pragma once

#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/memory_sm80.h>
#include <cutlass/gemm/collective/collective_builder.hpp>

namespace moe::gemm {

// Bytes of one bulk copy of `rows` consecutive fp32 scales: whole 16-byte words (the words past the
// last row are inside the buffer: the next rows' or the layout's padding to a multiple of 4), and
// nothing for a tile past the rows -- the second CTA of a 2-CTA cluster, which still loads the
// shared operand tile for its partner.
CUTLASS_DEVICE uint32_t scale_run_bytes(int rows) { return rows > 0 ? uint32_t((rows + 3) / 4 * 4) * 4u : 0u; }

template <class Base>
struct Fp8FpropScaleProducer : Base {
  using typename Base::MainloopPipeline;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  using ElementScale = typename Base::ElementBlockScale;
  static_assert(sizeof(ElementScale) == 4, "fp32 scales (scale_run_bytes)");
  static_assert(Base::ScaleGranularityM == 1, "token scales per row");
  // The K-major token scales' 16-byte register loads. The 128-wide tile (one weight-scale block)
  // copies them word by word instead: with all three loops its producer warp group exceeds its 40
  // registers and the compiler spills across the kernel (either loop alone fits; the 192-wide
  // tile fits all three).
  static constexpr bool kKMajorRegisterLoads = Base::ScaleNsPerTile > 1;

  // The base's arguments and parameters plus the token scales' MN-major leading dimension.
  struct Arguments : Base::Arguments {
    int64_t sfa_mn_ld = 0;  // 0: K-major token scales; > 0: MN-major with this leading dimension
  };
  struct Params : Base::Params {
    int64_t sfa_mn_ld = 0;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape problem_shapes, Arguments const& args, void* workspace) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(problem_shapes, args, workspace);
    p.sfa_mn_ld = args.sfa_mn_ld;
    return p;
  }

  template <class TensorA, class TensorB, class TensorSFA, class TensorSFB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, TensorSFA, TensorSFB> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int lane, uint32_t, TensorStorage& shared_tensors) {
    using namespace cute;
    Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), typename Base::SmemLayoutSFA{});
    Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), typename Base::SmemLayoutSFB{});
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    // The group's scales as CUTLASS's collective sees them: K-major views derived from the problem
    // shape (m, k, l), broadcast within a scale block. In MN-major mode only their pointer (the
    // group's first row) and shape are used.
    Tensor mSFA = get<2>(load_inputs);
    Tensor mSFB = get<3>(load_inputs);  // (n, k, l)
    Tensor gSFA = local_tile(mSFA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor cSFA = local_tile(make_identity_tensor(shape(mSFA)), TileShape{}, make_coord(_, _, _),
                             Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor gSFB = local_tile(mSFB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    Tensor cSFB = local_tile(make_identity_tensor(shape(mSFB)), TileShape{}, make_coord(_, _, _),
                             Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    constexpr int kLanes = cutlass::NumThreadsPerWarp;
    constexpr int kTileRows = Base::ScaleMsPerTile;
    constexpr int kRowsPerLane = kTileRows / kLanes;
    constexpr int kBlocksPerLoad = 4;  // k blocks per 16-byte load
    static_assert(kTileRows % kLanes == 0, "whole rows per lane");
    static_assert(Base::ScaleNsPerTile <= kLanes, "one lane per weight-scale block");
    if (k_tile_count <= 0) return;
    const int k0 = *k_tile_iter;
    const int b_col = lane * Base::ScaleGranularityN;
    const bool b_lane = lane < Base::ScaleNsPerTile && elem_less(cSFB(b_col, 0, k0), shape(mSFB));
    uint32_t row_ok = 0;  // bit j: row lane + 32 j lies in the group
    CUTLASS_PRAGMA_UNROLL
    for (int j = 0; j < kRowsPerLane; ++j)
      row_ok |= uint32_t(elem_less(cSFA(lane + j * kLanes, 0, k0), shape(mSFA))) << j;

    // MN-major token scales: row r, block k of the tile at a_mn[k * ld + r].
    const int64_t ld = params.sfa_mn_ld;
    const int row0 = int(m_coord) * kTileRows;
    const ElementScale* a_mn = ld > 0 ? raw_pointer_cast(mSFA.data()) + row0 : nullptr;
    const int tile_rows = min(kTileRows, int(size<0>(mSFA)) - row0);
    // 16-byte loads (K-major) need whole groups of four k blocks (nothing is read past a row's
    // end), consecutive k blocks contiguous, and every scale row starting 16-byte aligned: the
    // tile's first one, and a distance to the next one (`next_row` rows of the view further) that
    // is a multiple of four words.
    auto vector_ok = [&](auto const& g, int next_row) {
      const auto* p = &g(0, 0, k0);
      return k_tile_count % kBlocksPerLoad == 0 && &g(0, 0, k0 + 1) - p == 1 &&
             (&g(next_row, 0, k0) - p) % kBlocksPerLoad == 0 && reinterpret_cast<uintptr_t>(p) % 16 == 0;
    };
    const bool a_bulk = a_mn != nullptr && ld % 4 == 0 && reinterpret_cast<uintptr_t>(a_mn) % 16 == 0;
    const bool b_vector = vector_ok(gSFB, Base::ScaleGranularityN);
    const bool a_vector =
        kKMajorRegisterLoads && a_mn == nullptr && b_vector && vector_ok(gSFA, Base::ScaleGranularityM);
    using WordCopy = cutlass::arch::cp_async<sizeof(ElementScale), cutlass::arch::CacheOperation::Always>;
    // Register stores are released by a plain arrive; cp.async copies arrive as they complete. A
    // stage takes one kind or the other, never both (nothing would order the stores then). Each
    // mode has its own loop: the producer warp group runs with 40 registers.
    auto plain_arrive = [](uint64_t* bar) { cutlass::arch::ClusterBarrier::arrive(bar); };

    if (a_bulk) {
      const uint32_t bytes = scale_run_bytes(tile_rows);
      float4 b = {};
      if (b_vector && b_lane) b = *reinterpret_cast<const float4*>(&gSFB(b_col, 0, k0));
      CUTLASS_PRAGMA_NO_UNROLL
      for (int i = 0; i < k_tile_count; i += kBlocksPerLoad) {
        CUTLASS_PRAGMA_UNROLL
        for (int q = 0; q < kBlocksPerLoad; ++q) {
          if (i + q < k_tile_count) {
            const int k = k0 + i + q;
            pipeline.producer_acquire(smem_pipe_write);
            const int stage = smem_pipe_write.index();
            if (lane == 0 && bytes > 0) {
              // The bytes are announced before the copy is issued and before this lane's arrive
              // below, so the stage cannot complete without them.
              auto* full_barrier = pipeline.producer_get_barrier(smem_pipe_write);
              cutlass::arch::ClusterTransactionBarrier::expect_transaction(full_barrier, bytes);
              SM90_BULK_COPY_G2S::copy(a_mn + k * ld, full_barrier, &sSFA(0, 0, stage), int32_t(bytes));
            }
            if (b_vector) {
              if (b_lane) sSFB(b_col, 0, stage) = (&b.x)[q];
              pipeline.producer_commit(smem_pipe_write, plain_arrive);
            } else {
              if (b_lane) WordCopy(&sSFB(b_col, 0, stage), &gSFB(b_col, 0, k));
              pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
            }
            ++smem_pipe_write;
          }
        }
        if (b_vector && b_lane && i + kBlocksPerLoad < k_tile_count)
          b = *reinterpret_cast<const float4*>(&gSFB(b_col, 0, k0 + i + kBlocksPerLoad));
      }
      return;
    }

    if (a_vector) {
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
          pipeline.producer_commit(smem_pipe_write, plain_arrive);
          ++smem_pipe_write;
        }
        if (i + kBlocksPerLoad < k_tile_count) load(k0 + i + kBlocksPerLoad);
      }
      return;
    }

    CUTLASS_PRAGMA_NO_UNROLL
    for (int i = 0; i < k_tile_count; ++i) {
      const int k = k0 + i;
      pipeline.producer_acquire(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < kRowsPerLane; ++j) {
        const int row = lane + j * kLanes;
        WordCopy(&sSFA(row, 0, stage), a_mn ? a_mn + k * ld + row : &gSFA(row, 0, k), row_ok >> j & 1u);
      }
      if (b_lane) WordCopy(&sSFB(b_col, 0, stage), &gSFB(b_col, 0, k));
      pipeline.producer_commit(smem_pipe_write, cutlass::arch::cpasync_barrier_arrive_noinc);
      ++smem_pipe_write;
    }
  }
};

// The weight-gradient form's scale producer: both operands are the tokens' columnwise copies, with
// a scale per row and 128-token block, stored MN-major ([token blocks, rows], CUTLASS's own
// layout). A stage's scales are then two contiguous runs of up to 128 words, one per operand,
// copied by two bulk copies on the stage's full barrier (CUTLASS's producer copies them word by
// word: 256 `cp.async` per stage). Where a run is not 16-byte aligned, CUTLASS's copy stays.
template <class Base>
struct Fp8WgradScaleProducer : Base {
  using typename Base::MainloopPipeline;
  using typename Base::Params;
  using typename Base::PipelineState;
  using typename Base::TensorStorage;
  using typename Base::TileShape;
  static_assert(sizeof(typename Base::ElementBlockScale) == 4, "fp32 scales (scale_run_bytes)");
  static_assert(Base::ScaleGranularityM == 1 && Base::ScaleGranularityN == 1, "both operands scaled per row");

  template <class TensorA, class TensorB, class TensorSFA, class TensorSFB, class KTileIterator, class BlockCoord>
  CUTLASS_DEVICE void load_auxiliary(Params const& params, MainloopPipeline pipeline, PipelineState smem_pipe_write,
                                     cute::tuple<TensorA, TensorB, TensorSFA, TensorSFB> const& load_inputs,
                                     BlockCoord const& blk_coord, KTileIterator k_tile_iter, int k_tile_count,
                                     int lane, uint32_t block_rank_in_cluster, TensorStorage& shared_tensors) {
    using namespace cute;
    if (k_tile_count <= 0) return;
    auto [m_coord, n_coord, k_coord, l_coord] = blk_coord;
    Tensor mSFA = get<2>(load_inputs);  // (m, k, l)
    Tensor mSFB = get<3>(load_inputs);  // (n, k, l)
    Tensor gSFA = local_tile(mSFA, TileShape{}, make_coord(_, _, _), Step<_1, X, _1>{})(_, _, m_coord, _, l_coord);
    Tensor gSFB = local_tile(mSFB, TileShape{}, make_coord(_, _, _), Step<X, _1, _1>{})(_, _, n_coord, _, l_coord);
    const int k0 = *k_tile_iter;
    const int rows_a = min(int(size<0>(TileShape{})), int(size<0>(mSFA)) - int(m_coord) * int(size<0>(TileShape{})));
    const int rows_b = min(int(size<1>(TileShape{})), int(size<0>(mSFB)) - int(n_coord) * int(size<1>(TileShape{})));
    // A run is bulk-copyable when its rows are consecutive words, it starts 16-byte aligned and so
    // does the next block's run (a leading dimension that is a multiple of 4).
    auto bulk_ok = [&](auto const& g) {
      const auto* p = &g(0, 0, k0);
      return &g(1, 0, k0) - p == 1 && reinterpret_cast<uintptr_t>(p) % 16 == 0 &&
             (k_tile_count == 1 || (&g(0, 0, k0 + 1) - p) % 4 == 0);
    };
    if (!(bulk_ok(gSFA) && bulk_ok(gSFB))) {
      Base::load_auxiliary(params, pipeline, smem_pipe_write, load_inputs, blk_coord, k_tile_iter, k_tile_count, lane,
                           block_rank_in_cluster, shared_tensors);
      return;
    }
    Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()), typename Base::SmemLayoutSFA{});
    Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()), typename Base::SmemLayoutSFB{});
    const uint32_t bytes_a = scale_run_bytes(rows_a), bytes_b = scale_run_bytes(rows_b);
    CUTLASS_PRAGMA_NO_UNROLL
    for (int i = 0; i < k_tile_count; ++i) {
      const int k = k0 + i;
      pipeline.producer_acquire(smem_pipe_write);
      const int stage = smem_pipe_write.index();
      auto* full_barrier = pipeline.producer_get_barrier(smem_pipe_write);
      if (lane == 0 && bytes_a + bytes_b > 0) {
        // Announced before the copies and before this lane's arrive: the stage waits for them.
        cutlass::arch::ClusterTransactionBarrier::expect_transaction(full_barrier, bytes_a + bytes_b);
        if (bytes_a > 0) SM90_BULK_COPY_G2S::copy(&gSFA(0, 0, k), full_barrier, &sSFA(0, 0, stage), int32_t(bytes_a));
        if (bytes_b > 0) SM90_BULK_COPY_G2S::copy(&gSFB(0, 0, k), full_barrier, &sSFB(0, 0, stage), int32_t(bytes_b));
      }
      pipeline.producer_commit(smem_pipe_write, [](uint64_t* bar) { cutlass::arch::ClusterBarrier::arrive(bar); });
      ++smem_pipe_write;
    }
  }
};

}  // namespace moe::gemm
