// The one CUTLASS 4.2 kernel template behind every configuration: an sm90 pointer-array grouped
// GEMM (TMA + WGMMA, warp-specialized, persistent group tile scheduler) with problem shapes that
// live only on the device, on bf16 operands or on FP8 E4M3 operands with per-block fp32 scales
// applied in the main loop. Included by exactly one .cu per configuration.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/detail/blockwise_scale_layout.hpp>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/operations.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/dispatch_policy.hpp>
#include <cutlass/gemm/group_array_problem_shape.hpp>
#include <cutlass/gemm/kernel/gemm_universal.hpp>

#include "gemm/fp8_overlapped_promotion.cuh"
#include "gemm/fp8_scale_producer.cuh"
#include "gemm/fp8_wide_tile_promotion.cuh"
#include "gemm/grouped_kernel.h"
#include "gemm/run_group_scheduler.cuh"
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
  using KernelFp8Block = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative;
};
struct Pingpong {
  using Kernel = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong;
  using KernelFp8Block = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpongFP8BlockScaledAccum;
  using Epilogue = cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong;
};

// bf16 operands in the layouts of op kOp.
template <Op kOp>
struct Bf16Operands {
  static constexpr bool kScaled = false;
  static constexpr int kScaleRowsB = 0;
  static constexpr bool kFpropForm = false;
  using Element = cutlass::bfloat16_t;
  using LayoutA = typename OpLayouts<kOp>::A*;
  using LayoutB = typename OpLayouts<kOp>::B*;
  template <class Schedule>
  using KernelSchedule = typename Schedule::Kernel;
};

// FP8 E4M3 operands with block scaling (docs/gemm.md, FP8). FP8 WGMMA reads both operands
// K-major, so every FP8 product is "TN": A [m, red] and B [n, red] with the reduction contiguous
// (dgrad reads the weights' columnwise copy, wgrad the tokens' columnwise copies). The fp32
// scale_inv of A comes per row and 128-block of the reduction (granularity 1 x 128), that of B per
// kGranN rows and 128-block (128 x 128 weight blocks, or 1 x 128 token blocks in wgrad). The
// pointer-array mainloop derives each group's scale layout from its problem shape: scales packed
// [m][red/128] (K-major) or [red/128][m] (MN-major, leading dimension m) behind each group's pointer.
template <int kGranN, cute::GMMA::Major kMajorSFA, cute::GMMA::Major kMajorSFB>
struct Fp8BlockOperands {
  static constexpr bool kScaled = true;
  static constexpr int kScaleRowsB = kGranN;
  static constexpr bool kFpropForm = kGranN > 1;  // B scaled per block of weight rows (not wgrad's per row)
  using Element = cutlass::float_e4m3_t;
  using ScaleConfig = cutlass::detail::Sm90BlockwiseScaleConfig<1, kGranN, 128, kMajorSFA, kMajorSFB>;
  using LayoutA = cute::tuple<cutlass::layout::RowMajor*, decltype(ScaleConfig::deduce_layoutSFA())*>;
  using LayoutB = cute::tuple<cutlass::layout::ColumnMajor*, decltype(ScaleConfig::deduce_layoutSFB())*>;
  template <class Schedule>
  using KernelSchedule = typename Schedule::KernelFp8Block;
};

// Operands: Bf16Operands<op> or Fp8BlockOperands<...>; ElementD: bf16 or float; ElementC: void (no
// source) or float (beta * C); Tile/Cluster: cute shapes; Schedule: Cooperative or Pingpong;
// EpiTile: the output subtile the epilogue stages through shared memory per TMA store (CUTLASS's
// choice by default: 64x32 for ping-pong, 128x32 for cooperative bf16 output); EpiloguePolicy:
// which epilogue runs, given CUTLASS's TMA epilogue built for the configuration (its `type<Tma>`):
// that one (CutlassEpilogue), or one of ours that takes its types from it, declared in its own
// header and included by the configurations that use it (e.g. WarpGroupStores,
// warp_group_store_epilogue.cuh).
struct CutlassEpilogue {
  template <class Tma>
  using type = Tma;
};
template <class Operands, class ElementD, class ElementC, class Tile, class Cluster, class Schedule,
          class EpiTile = cutlass::epilogue::collective::EpilogueTileAuto, class EpiloguePolicy = CutlassEpilogue>
struct Sm90Gemm {
  using ElementAB = typename Operands::Element;
  using ElementAcc = float;
  using ElementDOut = ElementD;  // for the registry key (caps_of)
  using ElementCIn = ElementC;
  static constexpr int kWeightScaleRows = Operands::kScaleRowsB;  // KernelEntry::weight_scale_rows
  using LayoutD = cutlass::layout::RowMajor;
  static constexpr int kAlignAB = 16 / sizeof(ElementAB);  // 16-byte TMA alignment
  static constexpr int kAlignD = 16 / sizeof(ElementD);
  static constexpr int kAlignC = std::is_void_v<ElementC> ? kAlignD : 16 / int(sizeof(std::conditional_t<std::is_void_v<ElementC>, char, ElementC>));
  // bf16 kernels take RunGroupScheduler (run_group_scheduler.cuh), selected by the problem-shape
  // type; the FP8 block-scaled kernels keep CUTLASS's round-robin group scheduler (their consumers
  // run at the register limit, and the extra scheduler state made them spill).
  static constexpr bool kTileRuns = !Operands::kScaled;
  using ProblemShape = std::conditional_t<kTileRuns, RunGroupProblemShape,
                                          cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>>;

  using TmaEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      EpiTile, ElementAcc, ElementAcc,
      ElementC, LayoutD*, kAlignC, ElementD, LayoutD*, kAlignD, typename Schedule::Epilogue,
      cutlass::epilogue::fusion::LinearCombination<ElementD, ElementAcc, ElementC, ElementAcc>>::CollectiveOp;
  using Epilogue = typename EpiloguePolicy::template type<TmaEpilogue>;

  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, ElementAB, typename Operands::LayoutA, kAlignAB, ElementAB,
      typename Operands::LayoutB, kAlignAB, ElementAcc, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Operands::template KernelSchedule<Schedule>>::CollectiveOp;

  // The cooperative FP8 block-scaled kernels up to 128 wide promote each reduction block under the
  // next one's WGMMAs (fp8_overlapped_promotion.cuh); wider ones, whose two accumulator buffers
  // would not fit the registers, promote after it with one FMA per element
  // (fp8_wide_tile_promotion.cuh).
  // Both fill the stages' scales with our producers (fp8_scale_producer.cuh); the fprop form's also
  // reads MN-major token scales (GroupedArgs::a_scale_mn_ld).
  static constexpr bool kScaledCooperative = Operands::kScaled && std::is_same_v<Schedule, Cooperative>;
  static constexpr bool kScaleProducer = kScaledCooperative && Operands::kFpropForm;
  using ScaledMainloop = std::conditional_t<
      kScaleProducer, Fp8FpropScaleProducer<Mainloop>,
      std::conditional_t<kScaledCooperative, Fp8WgradScaleProducer<Mainloop>, Mainloop>>;
  using KernelMainloop = std::conditional_t<
      kScaledCooperative,
      std::conditional_t<(cute::size<1>(Tile{}) <= 128), OverlappedPromotionMainloop<ScaledMainloop>,
                         WideTilePromotionMainloop<ScaledMainloop>>,
      Mainloop>;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, KernelMainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // Whether the epilogue's fusion takes alpha and beta (CUTLASS's linear combination) or stores the
  // accumulator as it is (PlainConversion, epilogue_plain_conversion.cuh).
  template <class T, class = void>
  struct HasAlpha : std::false_type {};
  template <class T>
  struct HasAlpha<T, std::void_t<decltype(std::declval<T&>().alpha)>> : std::true_type {};
  static constexpr bool kScalesAccumulator = HasAlpha<decltype(std::declval<typename Epilogue::Arguments&>().thread)>::value;

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
    args.problem_shape.num_groups = a.groups;
    args.problem_shape.problem_shapes =
        reinterpret_cast<typename ProblemShape::UnderlyingProblemShape*>(const_cast<int32_t*>(a.problem_shapes));
    args.problem_shape.host_problem_shapes = nullptr;
    auto& ml = args.mainloop;
    ml.ptr_A = reinterpret_cast<const ElementAB**>(const_cast<const void**>(a.ptr_a));
    ml.dA = reinterpret_cast<StrideA*>(const_cast<int64_t*>(a.ld_a));
    ml.ptr_B = reinterpret_cast<const ElementAB**>(const_cast<const void**>(a.ptr_b));
    ml.dB = reinterpret_cast<StrideB*>(const_cast<int64_t*>(a.ld_b));
    if constexpr (Operands::kScaled) {
      ml.ptr_SFA = const_cast<const float**>(a.ptr_sfa);
      ml.ptr_SFB = const_cast<const float**>(a.ptr_sfb);
      // The grouped mainloop derives each group's scale layout from its problem shape; the layout
      // arrays are never read.
      ml.layout_SFA = nullptr;
      ml.layout_SFB = nullptr;
    }
    if constexpr (kScaleProducer) ml.sfa_mn_ld = a.a_scale_mn_ld;
    else MOE_CHECK(a.a_scale_mn_ld == 0, "grouped GEMM: this configuration reads K-major token scales only");
    auto& ep = args.epilogue;
    if constexpr (kScalesAccumulator) {
      ep.thread.alpha = a.alpha;
      ep.thread.beta = a.beta;
      ep.thread.alpha_ptr = nullptr;
      ep.thread.beta_ptr = nullptr;
      ep.thread.alpha_ptr_array = nullptr;
      ep.thread.beta_ptr_array = nullptr;
      ep.thread.dAlpha = {cute::_0{}, cute::_0{}, 0};
      ep.thread.dBeta = {cute::_0{}, cute::_0{}, 0};
    } else {
      MOE_CHECK(a.alpha == 1.0f && a.beta == 0.0f, "grouped GEMM: this configuration stores the accumulator as it is (alpha 1, beta 0)");
    }
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
    if constexpr (kTileRuns) args.scheduler.run = a.tile_run;
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

// The bf16 configurations: operand layouts fixed by the op.
template <Op kOp, class ElementD, class ElementC, class Tile, class Cluster, class Schedule,
          class EpiTile = cutlass::epilogue::collective::EpilogueTileAuto>
using Sm90GroupedGemm = Sm90Gemm<Bf16Operands<kOp>, ElementD, ElementC, Tile, Cluster, Schedule, EpiTile>;

// The FP8 block-scaled configurations ("TN", see Fp8BlockOperands):
//   fprop form (fprop, and dgrad on the weights' columnwise copy): activation scales per row and
//     128-block of the reduction stored row-major [rows, red/128] (K-major, a group's scales start
//     at its first row), weight scales per 128 x 128 block, row-major per expert (K-major);
//   wgrad form: both operands are the tokens' columnwise copies, 1 x 128 blocks along the tokens,
//     scales stored [tokens/128, rows] (MN-major, a group's scales start at its first 128-token block).
//   The fprop form's weight scales may come restated per 64 rows (kWeightScaleRows = 64), so that a
//     192-wide tile holds whole scale blocks (GroupedGemm writes that copy per call).
template <class ElementD, class ElementC, class Tile, class Cluster, class Schedule, int kWeightScaleRows = 128,
          class EpiTile = cutlass::epilogue::collective::EpilogueTileAuto>
using Sm90Fp8FpropGemm = Sm90Gemm<Fp8BlockOperands<kWeightScaleRows, cute::GMMA::Major::K, cute::GMMA::Major::K>,
                                  ElementD, ElementC, Tile, Cluster, Schedule, EpiTile>;
template <class ElementD, class ElementC, class Tile, class Cluster, class Schedule,
          class EpiloguePolicy = CutlassEpilogue>
using Sm90Fp8WgradGemm = Sm90Gemm<Fp8BlockOperands<1, cute::GMMA::Major::MN, cute::GMMA::Major::MN>, ElementD,
                                  ElementC, Tile, Cluster, Schedule, cutlass::epilogue::collective::EpilogueTileAuto,
                                  EpiloguePolicy>;

}  // namespace moe::gemm

namespace moe::gemm {
template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, cutlass::bfloat16_t>) return DType::kBF16;
  else if constexpr (std::is_same_v<T, cutlass::half_t>) return DType::kFP16;
  else if constexpr (std::is_same_v<T, cutlass::float_e4m3_t>) return DType::kFP8E4M3;
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
    static const KernelEntry e{caps_of<op_v, ThisGemm>(), name_str, &run_this, &workspace_this,     \
                             ThisGemm::kTileRuns, ThisGemm::kWeightScaleRows};                   \
    return e;                                                                                     \
  }                                                                                               \
  }
