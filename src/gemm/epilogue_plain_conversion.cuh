// An epilogue policy (sm90_grouped_kernel.cuh) for bf16 outputs without a source (C): CUTLASS's TMA
// epilogue with its fusion replaced by a plain conversion of the accumulator, D = bf16(acc), where
// CUTLASS's linear combination computes bf16(alpha * acc) with a multiply per element even when
// alpha is 1. The values are the same (the engine's alpha is always 1; the kernel refuses any other
// at launch). What it saves is epilogue time: with a short reduction the ping-pong kernels' epilogue
// is longer than the other warp group's main loop it should hide behind, and over a quarter of its
// instructions were those multiplies (sonic-7b-fine's fc2, K = 256: 1.10x, docs/gemm.md).
#pragma once

#include <type_traits>

#include <cutlass/epilogue/collective/collective_epilogue.hpp>
#include <cutlass/epilogue/dispatch_policy.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/epilogue/thread/activation.h>

namespace moe::gemm {

struct PlainConversion {
  template <class Tma>
  struct rebind;
  template <class Policy, class CtaTile, class EpiTile, class ElementC, class StrideC, class ElementD, class StrideD,
            class Fusion, class... Rest>
  struct rebind<cutlass::epilogue::collective::CollectiveEpilogue<Policy, CtaTile, EpiTile, ElementC, StrideC, ElementD,
                                                                  StrideD, Fusion, Rest...>> {
    static_assert(std::is_void_v<ElementC>, "the plain conversion reads no source");
    using Convert = cutlass::epilogue::fusion::Sm90EVT<
        cutlass::epilogue::fusion::Sm90Compute<cutlass::epilogue::thread::Identity, ElementD, float,
                                               cutlass::FloatRoundStyle::round_to_nearest>,
        cutlass::epilogue::fusion::Sm90AccFetch>;
    using type = cutlass::epilogue::collective::CollectiveEpilogue<Policy, CtaTile, EpiTile, ElementC, StrideC,
                                                                   ElementD, StrideD, Convert, Rest...>;
  };
  template <class Tma>
  using type = typename rebind<Tma>::type;
};

}  // namespace moe::gemm
