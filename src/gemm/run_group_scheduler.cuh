// The persistent tile schedule of our grouped GEMMs. CUTLASS's sm90 group scheduler walks the
// tiles of all groups in one linear order and hands CTA c the tiles c, c + grid, c + 2 grid, ...
// When a group has fewer tiles than the grid (fine-grained experts: 144 tiles per expert on
// sonic-7b-fine's fc2 against 132 SMs), nearly every tile of a CTA lies in another group, and each
// group change swaps the TMA descriptors of A, B and D (a global-memory tensormap update, fences, a
// wait for the previous tile's stores), which a four-k-block main loop (K = 256) cannot hide.
// Measured on the H100 at 196608 x 1536 x 256 rows x N x K: 330 TFLOP/s in 128 groups, 407 in 8 or
// 1 (Nsight Compute: 523 vs 398 us at base clock).
//
// This scheduler hands each cluster *runs* of consecutive cluster tiles instead (tile_runs.h):
// round r gives cluster c the `run` tiles from (r * clusters + c) * run, so a CTA changes group only where
// its run crosses a group boundary, while all clusters still work on one window of
// `clusters * run` tiles at a time (the operands of a few experts, which stay in L2 as in the
// round-robin order; long runs lose that: the whole range of a cluster at once ran at a third of
// the speed). The tiles left after the last full round are split into contiguous shares that
// differ by one tile at most, so the balance is that of the round-robin order, and run = 1 is
// exactly CUTLASS's order. The total number of tiles is summed from the device-side problem shapes
// when the kernel starts (each warp: groups / 32 loads per lane), so nothing is read on the host.
//
// Plugged into CUTLASS's ptr-array kernels through the problem-shape type: kernels instantiated
// with RunGroupProblemShape select this scheduler (the TileSchedulerSelector specialization
// below); everything else about the kernels is CUTLASS's. Written against CUTLASS 4.2: it relies on
// the group scheduler's walk (get_work_idx_m_and_n), its public scheduler_params / response_ptr_,
// and the static grid layout of get_grid_shape (a cluster's CTAs at consecutive linear indices);
// recheck those when upgrading (a selector that stops matching fails to compile: CUTLASS's
// Arguments have no `run`).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/sm90_tile_scheduler_group.hpp>
#include <cutlass/gemm/kernel/tile_scheduler.hpp>

#include "gemm/tile_runs.h"

namespace moe::gemm {

// CUTLASS's group problem shape (device-side (M, N, K) per group), as a distinct type that selects
// RunGroupScheduler.
struct RunGroupProblemShape : cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>> {};

template <class GroupProblemShape, int kStages>
class RunGroupScheduler : public cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape, kStages> {
  using Base = cutlass::gemm::kernel::detail::PersistentTileSchedulerSm90Group<GroupProblemShape, kStages>;

 public:
  using typename Base::WorkTileInfo;
  using typename Base::SchedulerResponse;
  using ProblemShape = typename Base::ProblemShape;
  using RasterOrder = typename Base::RasterOrder;

  struct Arguments : Base::Arguments {
    int run = 1;  // consecutive cluster tiles per cluster and round (>= 1)
  };
  struct Params : Base::Params {
    int run = 1;
  };

  template <class TileShape, class ClusterShape>
  static Params to_underlying_arguments(GroupProblemShape problem_shapes, TileShape tile_shape,
                                        ClusterShape cluster_shape, cutlass::KernelHardwareInfo const& hw_info,
                                        Arguments const& arguments, void* workspace = nullptr,
                                        const uint32_t epilogue_subtile = 1, uint32_t ktile_start_alignment_count = 1u) {
    Params p;
    static_cast<typename Base::Params&>(p) = Base::to_underlying_arguments(
        problem_shapes, tile_shape, cluster_shape, hw_info, arguments, workspace, epilogue_subtile,
        ktile_start_alignment_count);
    p.run = arguments.run < 1 ? 1 : arguments.run;
    return p;
  }

  RunGroupScheduler() = default;

  CUTLASS_DEVICE RunGroupScheduler(Params const& params, SchedulerResponse* response_ptr) {
    // The base's constructor sets up its own walk state, which this scheduler never reads.
    this->scheduler_params = params;
    this->response_ptr_ = response_ptr;
#if defined(__CUDA_ARCH__)
    // 32-bit counters throughout: the producer warps run under a 40-register budget, and 64-bit
    // state and divisions made every kernel on this scheduler spill. A launch has far fewer than
    // 2^32 tiles (rows / 128 x N / 128).
    const auto& sp = this->scheduler_params;
    cluster_size_ = uint32_t(sp.cluster_shape_.m() * sp.cluster_shape_.n());
    uint32_t linear;
    if (sp.raster_order_ == RasterOrder::AlongN) {
      linear = blockIdx.x + blockIdx.y * gridDim.x;
    } else {
      linear = blockIdx.x * gridDim.y + blockIdx.y;
    }
    // The CTAs of a cluster have consecutive linear indices (CUTLASS's static grid layout).
    cta_in_cluster_ = linear % cluster_size_;
    cluster_ = linear / cluster_size_;
    const uint32_t clusters = gridDim.x * gridDim.y * gridDim.z / cluster_size_;

    // Cluster tiles of all groups, counted as the walk of get_work_idx_m_and_n counts them.
    const int lane = cutlass::canonical_lane_idx();
    const int groups = sp.problem_shapes_.groups();
    uint32_t tiles = 0;
    for (int g = lane; g < groups; g += cutlass::NumThreadsPerWarp) tiles += tiles_of(sp.problem_shapes_.get_problem_shape(g), sp);
    for (int offset = 16; offset > 0; offset /= 2) tiles += __shfl_xor_sync(0xffffffffu, tiles, offset);
    runs_ = TileRuns::make(tiles / cluster_size_, clusters, uint32_t(params.run));

    // The group walk starts at group 0, as CUTLASS's constructor sets it up.
    if (lane < groups) cached_[1] = sp.problem_shapes_.get_problem_shape(lane);
    const ProblemShape first = sp.problem_shapes_.get_problem_shape(0);
    group_.group_idx = 0;
    group_.start_linear_idx = 0;
    group_.total_tiles = tiles_of(first, sp);
    group_.problem_blocks_along_raster_order =
        sp.raster_order_ == RasterOrder::AlongN ? blocks_n(first, sp) : blocks_m(first, sp);
#endif
  }

  template <class ClusterShape>
  CUTLASS_DEVICE WorkTileInfo initial_work_tile_info(ClusterShape) {
    return work_at_step(0);
  }

  template <typename TileSchedulerPipeline, typename TileSchedulerPipelineState>
  CUTLASS_DEVICE auto advance_to_next_work(TileSchedulerPipeline& scheduler_pipeline,
                                           TileSchedulerPipelineState scheduler_pipe_producer_state,
                                           uint32_t advance_count = 1) {
    step_ += advance_count;
    WorkTileInfo work_tile = work_at_step(step_);
    scheduler_pipeline.producer_acquire(scheduler_pipe_producer_state);
    if (cute::elect_one_sync()) {
      this->response_ptr_[scheduler_pipe_producer_state.index()] = work_tile;
      cutlass::arch::fence_view_async_shared();
      scheduler_pipeline.producer_commit(scheduler_pipe_producer_state);
    }
    return cute::make_tuple(work_tile, true);
  }

 private:
  // The walk's state (get_work_idx_m_and_n takes any struct with these members).
  struct GroupInfo {
    int group_idx = 0;
    uint32_t start_linear_idx = 0;
    uint32_t total_tiles = 0;
    uint32_t problem_blocks_along_raster_order = 0;
  };

  using BaseParams = typename Base::Params;
  CUTLASS_DEVICE static uint32_t round_up(uint32_t a, uint32_t b) { return (a + b - 1) / b * b; }
  CUTLASS_DEVICE static uint32_t blocks_m(ProblemShape const& s, BaseParams const& p) {
    const uint32_t m = uint32_t(p.divmod_cta_shape_m_.divide(cute::get<0>(s) + p.divmod_cta_shape_m_.divisor - 1));
    return round_up(m, (1u << p.log_swizzle_size_) * uint32_t(p.cluster_shape_.m()));
  }
  CUTLASS_DEVICE static uint32_t blocks_n(ProblemShape const& s, BaseParams const& p) {
    const uint32_t n = uint32_t(p.divmod_cta_shape_n_.divide(cute::get<1>(s) + p.divmod_cta_shape_n_.divisor - 1));
    return round_up(n, (1u << p.log_swizzle_size_) * uint32_t(p.cluster_shape_.n()));
  }
  CUTLASS_DEVICE static uint32_t tiles_of(ProblemShape const& s, BaseParams const& p) {
    return blocks_m(s, p) * blocks_n(s, p);
  }

  // The cluster tile this cluster takes at its step-th visit, as CUTLASS's linear tile index of
  // this CTA, or an invalid tile once its share is done.
  CUTLASS_DEVICE WorkTileInfo work_at_step(uint32_t step) {
    uint32_t unit;
    if (!runs_.unit(cluster_, step, &unit)) return WorkTileInfo::invalid_work_tile();
    auto& sp = this->scheduler_params;
    return Base::template get_work_idx_m_and_n<WorkTileInfo>(
        uint64_t(unit) * cluster_size_ + cta_in_cluster_, group_, sp.problem_shapes_, cached_, sp.cta_shape_,
        sp.cluster_shape_, sp.divmod_cluster_shape_major_, sp.divmod_cluster_shape_minor_, sp.divmod_cta_shape_m_,
        sp.divmod_cta_shape_n_, sp.log_swizzle_size_, sp.raster_order_);
  }

  TileRuns runs_;
  uint32_t cluster_size_ = 1;
  uint32_t cta_in_cluster_ = 0;
  uint32_t cluster_ = 0;
  uint32_t step_ = 0;
  GroupInfo group_;
  ProblemShape cached_[2];
};

}  // namespace moe::gemm

namespace cutlass::gemm::kernel::detail {
// Kernels instantiated with RunGroupProblemShape take RunGroupScheduler (more specialized than
// CUTLASS's GroupScheduler selector for sm90, which it otherwise matches).
template <class TileShape, class ClusterShape, uint32_t kStages>
struct TileSchedulerSelector<GroupScheduler, arch::Sm90, TileShape, ClusterShape, kStages, moe::gemm::RunGroupProblemShape> {
  using Scheduler = moe::gemm::RunGroupScheduler<moe::gemm::RunGroupProblemShape, kStages>;
};
}  // namespace cutlass::gemm::kernel::detail
