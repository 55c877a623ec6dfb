// The one CUTLASS 4.2 kernel template behind every configuration: an sm90 pointer-array grouped
// GEMM (TMA + WGMMA, warp-specialized, persistent group tile scheduler) with problem shapes that
// live only on the device. Included by exactly one .cu per configuration.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gemm/grouped_kernel.h"
#include "moe/error.h"

namespace moe::gemm {

// Operand layouts (CUTLASS tags) of each op; see grouped_kernel.h.
template <Op kOp>
struct OpLayouts;
template <>
struct OpLayouts<Op::kFprop> {
  using A = cutlass::layout::RowMajor;     // X [m, K]
  using B = cutlass::layout::ColumnMajor;  // W [N, K]: B(n, k) at n*K + k
};
template <>
struct OpLayouts<Op::kDgrad> {
  using A = cutlass::layout::RowMajor;  // dY [m, N]
  using B = cutlass::layout::RowMajor;  // W [N, K] read as B(k_out, n_red) at n_red*K + k_out
};
template <>
struct OpLayouts<Op::kWgrad> {
  using A = cutlass::layout::ColumnMajor;  // dY^T: A(n, r) at r*N + n
  using B = cutlass::layout::RowMajor;     // X: B(k, r) at r*K + k
};

struct Cooperative {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// kOp: which product; ElementD: bf16 or float; ElementC: void (no source) or float (beta * C);
// Tile/Cluster: cute shapes; Schedule: Cooperative or Pingpong.
template <Op kOp, class ElementD, class ElementC, class Tile, class Cluster, class Schedule>
struct Sm90GroupedGemm {
  using ElementAB = cutlass::bfloat16_t;
  using ElementAcc = float;
  using ElementDOut = ElementD;  // for the registry key (caps_of)
  using ElementCIn = ElementC;
  using LayoutA = typename OpLayouts<kOp>::A;
  using LayoutB = typename OpLayouts<kOp>::B;
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16 / sizeof(ElementAB);  // 16-byte TMA alignment
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  static constexpr int kAlignC = std::is_void_v<ElementC> ? kAlignD : 16 / int(sizeof(std::conditional_t<std::is_void_v<ElementC>, char, ElementC>));
  using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, ElementAcc, ElementAcc,
      ElementC, LayoutD*, kAlignC, ElementD, LayoutD*, kAlignD, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAcc, ElementC, ElementAcc>>::CollectiveOp;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, LayoutA*, kAlignAB, ElementAB, LayoutB*,
      kAlignAB, ElementAcc, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Schedule::Kernel>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideC = typename Kernel::InternalStrideC;
  using StrideD = typename Kernel::InternalStrideD;
  // The prep kernel writes each stride as one int64 leading dimension (grouped_kernel.h).
  static_assert(sizeof(StrideA) == sizeof(int64_t) && sizeof(StrideB) == sizeof(int64_t) &&
                    sizeof(StrideC) == sizeof(int64_t) && sizeof(StrideD) == sizeof(int64_t),
                "pointer-array strides must hold exactly one int64 leading dimension");
  static_assert(sizeof(typename ProblemShape::UnderlyingProblemShape) == 3 * sizeof(int32_t),
                "problem shapes are written as int32 (M, N, K) triples");

  static typename Gemm::Arguments arguments(const GroupedArgs& a) {
    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    // No host problem shapes: sizes exist only on the device (graph-safe, no host read).
    args.problem_shape = {a.groups,
                          reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(
                              const_cast<int32_t*>(a.problem_shapes)),
                          nullptr};
    args.mainloop = {reinterpret_cast<const ElementAB**>(const_cast<const void**>(a.ptr_a)),
                     reinterpret_cast<StrideA*>(const_cast<int64_t*>(a.ld_a)),
                     reinterpret_cast<const ElementAB**>(const_cast<const void**>(a.ptr_b)),
                     reinterpret_cast<StrideB*>(const_cast<int64_t*>(a.ld_b))};
    auto& ep = args.epilogue;
    ep.thread.alpha = a.alpha;
    ep.thread.beta = a.beta;
    ep.thread.alpha_ptr = nullptr;
    ep.thread.beta_ptr = nullptr;
    ep.thread.alpha_ptr_array = nullptr;
    ep.thread.beta_ptr_array = nullptr;
    ep.thread.dAlpha = {cute::_0{}, cute::_0{}, 0};
    ep.thread.dBeta = {cute::_0{}, cute::_0{}, 0};
    if constexpr (!std::is_void_v<ElementC>) {
      ep.ptr_C = reinterpret_cast<const ElementC**>(const_cast<const void**>(a.ptr_c));
      ep.dC = reinterpret_cast<StrideC*>(const_cast<int64_t*>(a.ld_c));
    } else {
      ep.ptr_C = nullptr;
      ep.dC = nullptr;
    }
    ep.ptr_D = reinterpret_cast<ElementD**>(const_cast<void**>(a.ptr_d));
    ep.dD = reinterpret_cast<StrideD*>(const_cast<int64_t*>(a.ld_d));
    args.hw_info.device_id = 0;  // only used to query the SM count, which we always give
    args.hw_info.sm_count = a.sm_count;
    args.scheduler.raster_order = a.raster_along_n
                                      ? cutlass::gemm::kernel::detail::RasterOrderOptions::AlongN
                                      : cutlass::gemm::kernel::detail::RasterOrderOptions::AlongM;
    return args;
  }

  static size_t workspace_bytes(int groups, int sm_count) {
    GroupedArgs a;
    a.groups = groups;
    a.sm_count = sm_count;
    return Gemm::get_workspace_size(arguments(a));
  }

  static void run(const GroupedArgs& a, cudaStream_t stream) {
    Gemm gemm;
    const auto args = arguments(a);
    cutlass::Status status = gemm.can_implement(args);
    MOE_CHECK(status == cutlass::Status::kSuccess, "grouped GEMM: CUTLASS cannot implement the arguments (",
              cutlassGetStatusString(status), ")");
    // initialize() only builds the kernel parameters on the host (TMA descriptors from the fixed
    // argument-array addresses); no device data is read, nothing is allocated.
    status = gemm.initialize(args, a.workspace, stream);
    MOE_CHECK(status == cutlass::Status::kSuccess, "grouped GEMM: CUTLASS initialize failed (",
              cutlassGetStatusString(status), ")");
    status = gemm.run(stream);
    MOE_CHECK(status == cutlass::Status::kSuccess, "grouped GEMM: CUTLASS launch failed (",
              cutlassGetStatusString(status), ")");
  }
};

}  // namespace moe::gemm

namespace moe::gemm {
template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) return DType::kBF16;
  else if constexpr (std::is_same_v<T, cutlass::half_t>) return DType::kFP16;
  else return DType::kFP32;
}

// The registry key of a configuration, from its own element types.
template <Op kOp, class Gemm>
constexpr KernelCaps caps_of() {
  return {kOp, dtype_of<typename Gemm::ElementAB>(), dtype_of<typename Gemm::ElementDOut>(),
          !std::is_void_v<typename Gemm::ElementCIn>};
}
}  // namespace moe::gemm

// Defines the KernelEntry of one configuration: MOE_GROUPED_KERNEL(entry_fn, "name", op, Gemm).
#define MOE_GROUPED_KERNEL(entry_fn, name_str, op_v, ...)                                          \
  namespace moe::gemm {                                                                           \
  namespace {                                                                                     \
  using ThisGemm = __VA_ARGS__;                                                                   \
  void run_this(const GroupedArgs& a, cudaStream_t s) { ThisGemm::run(a, s); }                    \
  size_t workspace_this(int groups, int sm_count) { return ThisGemm::workspace_bytes(groups, sm_count); } \
  }                                                                                               \
  const KernelEntry& entry_fn() {                                                                 \
    static const KernelEntry e{caps_of<op_v, ThisGemm>(), name_str, &run_this, &workspace_this};   \
    return e;                                                                                     \
  }                                                                                               \
  }
