// FP8 block-scaled fprop form, cooperative 128x192x128, cluster 2x1x1 (the weight tile multicast to
// two token tiles), bf16 output: DeepGEMM's layout for its grouped FP8 GEMMs on the named shapes.
// Its weight scales come restated per 64 rows (GroupedGemm's per-call copy) and it promotes with one
// FMA per element after each reduction block (fp8_wide_tile_promotion.cuh). The epilogue stores
// 128x64 subtiles (CUTLASS's default, 128x32, took six store rounds with two barriers each per
// tile; 128x64 leaves four main-loop stages, measured faster: docs/gemm.md).
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fp8_fprop_coop_128x192x128_c2x1, "fp8_coop_128x192x128_c2x1", Op::kFprop,
                   Sm90Fp8FpropGemm<cutlass::bfloat16_t, void, cute::Shape<cute::_128, cute::_192, cute::_128>,
                                    cute::Shape<cute::_2, cute::_1, cute::_1>, Cooperative, 64,
                                    cute::Shape<cute::_128, cute::_64>>)
