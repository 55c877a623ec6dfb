// dgrad, cooperative 128x256x64, cluster 2x1x1, bf16 output. Used for
// reductions (N) longer than 768 when the output width K is not a multiple of 512 (the 1x2 cluster
// measured 0.60x at K = 256 and 0.72x at K = 768: idle CTAs); weights read N-major.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_dgrad_coop_128x256x64_c2x1, "coop_128x256x64_c2x1", Op::kDgrad,
                   Sm90GroupedGemm<Op::kDgrad, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_256, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Cooperative>)
