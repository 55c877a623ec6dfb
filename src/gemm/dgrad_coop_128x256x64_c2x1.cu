// dgrad, cooperative 128x256x64, cluster 2x1x1, bf16 output:
// the default for reductions (N) longer than 768: cooperative 128x256 tile, weights read N-major.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_dgrad_coop_128x256x64_c2x1, "coop_128x256x64_c2x1", Op::kDgrad, Out::kBF16,
                   Sm90GroupedGemm<Op::kDgrad, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_256, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Cooperative>)
