// fprop, cooperative 128x256x64, cluster 1x2x1, bf16 output. Used for
// long reductions (K > 2048, or K > 1024 with N > 2048), N a multiple of 512: the 1x2 cluster
// multicasts each token tile to two N tiles; measured up to 1.09x the 2x1 cluster (sonic-120b,
// mixtral), never slower by more than noise.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fprop_coop_128x256x64_c1x2, "coop_128x256x64_c1x2", Op::kFprop,
                   Sm90GroupedGemm<Op::kFprop, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_256, cute::_64>,
                                   cute::Shape<cute::_1, cute::_2, cute::_1>, Cooperative>)
