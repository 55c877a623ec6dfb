// wgrad, cooperative 128x256x64, cluster 1x2x1, bf16 output:
// candidate: bf16 weight gradient with the 1x2 cluster.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_wgrad_coop_128x256x64_c1x2, "coop_128x256x64_c1x2", Op::kWgrad, Out::kBF16,
                   Sm90GroupedGemm<Op::kWgrad, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_256, cute::_64>,
                                   cute::Shape<cute::_1, cute::_2, cute::_1>, Cooperative>)
