// An epilogue for the cooperative pointer-array kernel in which each consumer warp group writes its
// own half of the output tile (docs/gemm.md, "The weight gradient's epilogue: warp-group stores").
// The engine takes it where a weight gradient is added into an fp32 main_grad.
//
// CUTLASS's TMA epilogue stages a tile through two shared subtile buffers that both consumer warp
// groups fill together: each of its rounds has barriers over all 256 consumer threads, one thread
// issues a TMA store and waits for earlier stores to leave the buffer before it is refilled,
// accumulation loads C through a producer warp into shared memory first, and every group change
// rewrites the epilogue's tensor maps. Here a warp group needs nothing from the other one: it
// converts its accumulators into its half of a padded shared buffer (one pass per 128 bytes of each
// row), waits on its own 128-thread barrier, and every thread stores whole 16-byte chunks of rows to
// global memory (a warp covers four rows of 128 bytes per instruction). Accumulation (beta = 1,
// C = D, the fp32 main_grad) is one `red.global.add.v4.f32` per chunk: D + acc, added once per
// element in L2, with no load of C. No tensor map, no TMA store to wait for, no producer warp.
//
// The values are CUTLASS's: fp32 output stores the accumulator (alpha = 1), accumulation adds it
// to D once in fp32 with round to nearest (one addend per element, so in no particular order; the
// tests compare the bits with CUTLASS's epilogue). The PTX f32 reduction may flush subnormal
// operands and results to zero, where CUTLASS's FMA keeps them: magnitudes below 2^-126, far under
// any gradient's resolution.
//
// Requirements, which GroupedGemm's checks guarantee and can_implement cannot see (they live on
// the device): C = D; each group's D 16-byte aligned, with a leading dimension and a width N that
// are multiples of 4 (16 bytes). The two consumer warp groups own rows 0-63 and 64-127 of the tile
// (CUTLASS's cooperative layout of two 64-row WGMMA atoms along M).
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cuda_host_adapter.hpp>
#include <cutlass/cutlass.h>

#include "device/main_grad_add.cuh"

namespace moe::gemm {

template <class Base>
class WarpGroupStoreEpilogue {
 public:
  // What the kernel and the device adapter read from an epilogue, as CUTLASS's.
  using DispatchPolicy = typename Base::DispatchPolicy;
  using CtaTileMNK = typename Base::CtaTileMNK;
  using EpilogueTile = typename Base::EpilogueTile;
  using ElementC = typename Base::ElementC;
  using StrideC = typename Base::StrideC;
  using InternalStrideC = typename Base::InternalStrideC;
  using ElementD = typename Base::ElementD;
  using StrideD = typename Base::StrideD;
  using InternalStrideD = typename Base::InternalStrideD;
  using GmemTiledCopyC = typename Base::GmemTiledCopyC;
  using GmemTiledCopyD = typename Base::GmemTiledCopyD;
  using ThreadEpilogueOp = typename Base::ThreadEpilogueOp;
  using Arguments = typename Base::Arguments;
  // The kernel builds these pipelines whatever the epilogue; this one never uses them.
  using LoadPipeline = typename Base::LoadPipeline;
  using LoadPipelineState = typename Base::LoadPipelineState;
  using StorePipeline = typename Base::StorePipeline;
  using StorePipelineState = typename Base::StorePipelineState;
  using PipelineStorage = typename Base::PipelineStorage;
  static constexpr int NumEpilogueWarpGroups = Base::NumEpilogueWarpGroups;
  static constexpr bool RequiresTransactionBytes = false;

  static constexpr int kTileM = cute::size<0>(CtaTileMNK{});
  static constexpr int kTileN = cute::size<1>(CtaTileMNK{});
  static constexpr int kThreadsPerGroup = cutlass::NumThreadsPerWarpGroup;
  static constexpr int kGroupRows = kTileM / NumEpilogueWarpGroups;
  // One pass stores 128 bytes of each row of the tile: 32 fp32 columns.
  static constexpr int kChunkElems = 16 / int(sizeof(ElementD));
  static constexpr int kPassCols = 128 / int(sizeof(ElementD));
  static constexpr int kPasses = kTileN / kPassCols;
  // Rows padded by 8 elements (160 bytes apart): a half warp's accumulator writes -- four rows of
  // four 8-byte pairs -- then fall on distinct banks, and 16-byte chunks stay aligned.
  static constexpr int kRowStride = kPassCols + 8;
  // fp32 output only: the engine takes this epilogue for main_grad accumulation, and its bf16
  // form was slower than CUTLASS's in the layer (docs/gemm.md), so it is not built.
  static_assert(std::is_same_v<ElementD, float>, "fp32 output (written or added into main_grad)");
  static_assert(kTileN % kPassCols == 0 && kPassCols % 8 == 0, "whole passes of 8-column accumulator groups");
  static_assert(NumEpilogueWarpGroups == 2 && kGroupRows == 64,
                "the cooperative schedule: two consumer warp groups, one 64-row WGMMA slice each");
  static_assert((kGroupRows * kPassCols / kChunkElems) % kThreadsPerGroup == 0, "whole chunks per thread");

  struct TensorStorage {
    alignas(128) cute::array_aligned<ElementD, kTileM * kRowStride> tile;
  };
  struct TensorMapStorage {};
  struct SharedStorage {  // sizes the main loop's carve-out (sm90_grouped_kernel.cuh)
    TensorStorage tensors;
    PipelineStorage pipeline;
  };

  struct Params {
    ElementD** ptr_D = nullptr;
    StrideD dD{};
    bool accumulate = false;
  };

  template <class ProblemShape>
  static Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return {args.ptr_D, args.dD, args.thread.beta != 0.0f};
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&, int) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape problem_shape, Arguments const& args) {
    // What it can check on the host; C = D and the 16-byte widths live on the device (GroupedGemm
    // guarantees them, see the top of this file).
    const bool accumulates = args.thread.beta != 0.0f;
    return Base::can_implement(problem_shape, args) && args.thread.alpha == 1.0f && args.thread.alpha_ptr == nullptr &&
           args.thread.beta_ptr == nullptr && args.thread.alpha_ptr_array == nullptr &&
           args.thread.beta_ptr_array == nullptr && (args.thread.beta == 0.0f || args.thread.beta == 1.0f) &&
           (!accumulates || args.ptr_C != nullptr);
  }
  template <class TileShapeMNK>
  CUTLASS_HOST_DEVICE static constexpr int get_load_pipe_increment(TileShapeMNK) {
    return 1;
  }
  template <class TileShapeMNK>
  CUTLASS_HOST_DEVICE static constexpr int get_store_pipe_increment(TileShapeMNK) {
    return 1;
  }

  CUTLASS_HOST_DEVICE WarpGroupStoreEpilogue(Params const& params, TensorStorage& shared) : params_(params) {
    (void)shared;
  }

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }

  // The producer's side and the tensor maps: never used (no C load, no TMA store).
  CUTLASS_DEVICE auto load_init(Params const&, TensorMapStorage&, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor*>(nullptr));
  }
  template <class... Rest>
  CUTLASS_DEVICE LoadPipelineState load(LoadPipeline, LoadPipelineState state, Rest&&...) {
    return state;
  }
  CUTLASS_DEVICE LoadPipelineState load_tail(LoadPipeline, LoadPipelineState state) { return state; }
  CUTLASS_DEVICE auto store_init(Params const&, TensorMapStorage&, int32_t, int32_t, int32_t) {
    return cute::make_tuple(static_cast<cute::TmaDescriptor*>(nullptr));
  }
  template <bool kIsLoad, class... Rest>
  CUTLASS_DEVICE void tensormaps_perform_update(Rest&&...) {}
  template <bool kIsLoad, class... Rest>
  CUTLASS_DEVICE void tensormaps_cp_fence_release(Rest&&...) {}
  template <bool kIsLoad, class... Rest>
  CUTLASS_DEVICE void tensormaps_fence_acquire(Rest&&...) {}

  template <class ProblemShapeMNKL, class TileShapeMNK, class TileCoordMNKL, class AccEngine, class AccLayout,
            class TiledMma, class TensorMapD>
  CUTLASS_DEVICE auto store(LoadPipeline, LoadPipelineState load_state, StorePipeline, StorePipelineState store_state,
                            ProblemShapeMNKL problem_shape_mnkl, TileShapeMNK, TileCoordMNKL tile_coord_mnkl,
                            cute::Tensor<AccEngine, AccLayout> accumulators, TiledMma tiled_mma, int thread_idx,
                            TensorStorage& shared, TensorMapD const&, int = -1) {
    using namespace cute;
    static_assert(is_static<TileShapeMNK>::value && size<0>(TileShapeMNK{}) == kTileM &&
                      size<1>(TileShapeMNK{}) == kTileN,
                  "the epilogue's tile is the kernel's");
    const int M = int(get<0>(problem_shape_mnkl)), N = int(get<1>(problem_shape_mnkl));
    const int group = int(get<3>(tile_coord_mnkl));
    const int tile_row = int(get<0>(tile_coord_mnkl)) * kTileM;
    const int tile_col = int(get<1>(tile_coord_mnkl)) * kTileN;
    const int warp_group = thread_idx / kThreadsPerGroup;
    const int t = thread_idx % kThreadsPerGroup;
    // The warp group's user barrier (ids 0 and 1), which the FP8 main loop's ScalesReadBarrier also
    // uses: safe because every use of it is by all 128 threads of the group, in program order.
    const uint32_t barrier_id = uint32_t(warp_group);
    auto group_sync = [&] { cutlass::arch::NamedBarrier::sync(kThreadsPerGroup, barrier_id); };

    // Each accumulator's (row, column) in the tile. The WGMMA fragment is ((2, 2, N / 8), 1, 1) with
    // strides (1, 2, 4): a column pair, the row and the row 8 below it, then groups of 8 columns --
    // so elements i and i + 1 (i even) are adjacent columns of one row, and pass p holds the groups
    // [p * kPassCols / 8, (p + 1) * kPassCols / 8).
    Tensor coords = tiled_mma.get_slice(thread_idx).partition_C(make_identity_tensor(take<0, 2>(CtaTileMNK{})));
    static_assert(decltype(size<0, 0>(coords))::value == 2 && decltype(size<0, 1>(coords))::value == 2 &&
                      decltype(size<0, 2>(coords))::value == kTileN / 8 && decltype(size(coords))::value == kTileN / 2,
                  "the WGMMA accumulator fragment ((2, 2, N / 8), 1, 1)");
    static_assert(AccLayout{}(make_coord(make_coord(1, 0, 0), 0, 0)) == 1 &&
                      AccLayout{}(make_coord(make_coord(0, 1, 0), 0, 0)) == 2 &&
                      AccLayout{}(make_coord(make_coord(0, 0, 1), 0, 0)) == 4,
                  "accumulator registers in the fragment's order, strides (1, 2, 4)");
    ElementD* buffer = shared.tile.data();
    ElementD* d_base = params_.ptr_D[group];
    const int64_t ld = int64_t(get<0>(params_.dD[group]));
    const int group_row0 = tile_row + warp_group * kGroupRows;

    CUTLASS_PRAGMA_UNROLL
    for (int pass = 0; pass < kPasses; ++pass) {
      // The buffer is free once every thread of the warp group has read the previous pass (or the
      // previous tile's last pass).
      group_sync();
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kTileN / 2; i += 2) {
        if ((i / 4) / (kPassCols / 8) != pass) continue;  // column group i / 4 is in another pass
        const auto c = coords(i);
        const int row = int(get<0>(c)), col = int(get<1>(c)) - pass * kPassCols;
        ElementD* dst = buffer + row * kRowStride + col;
        *reinterpret_cast<float2*>(dst) = make_float2(accumulators(i), accumulators(i + 1));
      }
      group_sync();
      // The warp group's 64 rows x kPassCols columns leave as 16-byte chunks, eight per row: thread
      // t takes chunks t, t + 128, ...; a warp covers four whole rows of the pass.
      constexpr int kChunksPerRow = kPassCols / kChunkElems;
      constexpr int kChunksPerThread = kGroupRows * kChunksPerRow / kThreadsPerGroup;
      CUTLASS_PRAGMA_UNROLL
      for (int q = 0; q < kChunksPerThread; ++q) {
        const int chunk = t + q * kThreadsPerGroup;
        const int row = chunk / kChunksPerRow;
        const int col = (chunk % kChunksPerRow) * kChunkElems;
        const int grow = group_row0 + row;
        const int gcol = tile_col + pass * kPassCols + col;
        if (grow < M && gcol < N) {
          const uint4 v = *reinterpret_cast<const uint4*>(buffer + (warp_group * kGroupRows + row) * kRowStride + col);
          ElementD* out = d_base + int64_t(grow) * ld + gcol;
          if (params_.accumulate)
            kernels::add_to_main_grad(out, make_float4(__uint_as_float(v.x), __uint_as_float(v.y),
                                                       __uint_as_float(v.z), __uint_as_float(v.w)));
          else
            *reinterpret_cast<uint4*>(out) = v;
        }
      }
    }
    return cute::make_tuple(load_state, store_state);
  }

  // The stores are plain global stores and reductions: nothing is in flight to wait for.
  CUTLASS_DEVICE auto store_tail(LoadPipeline, LoadPipelineState load_state, StorePipeline,
                                 StorePipelineState store_state) {
    return cute::make_tuple(load_state, store_state);
  }

 private:
  Params params_;
};

// The epilogue policy of Sm90Gemm (sm90_grouped_kernel.cuh) for the cooperative schedule.
struct WarpGroupStores {
  template <class Tma>
  using type = WarpGroupStoreEpilogue<Tma>;
};

}  // namespace moe::gemm
