// dgrad, cooperative 128x256x64, cluster 1x2x1, bf16 output. Used for
// reductions longer than 768 with K a multiple of 512: the 1x2 cluster multicasts each dY tile to
// two N tiles; measured 1.03-1.09x the 2x1 cluster (mixtral, sonic-30b/120b, olmoe).
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_dgrad_coop_128x256x64_c1x2, "coop_128x256x64_c1x2", Op::kDgrad,
                   Sm90GroupedGemm<Op::kDgrad, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_256, cute::_64>,
                                   cute::Shape<cute::_1, cute::_2, cute::_1>, Cooperative>)
