// fprop, ping-pong 128x128x64, cluster 1x2x1, bf16 output:
// candidate: ping-pong with the 1x2 cluster.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fprop_pong_128x128x64_c1x2, "pong_128x128x64_c1x2", Op::kFprop, Out::kBF16,
                   Sm90GroupedGemm<Op::kFprop, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_128, cute::_64>,
                                   cute::Shape<cute::_1, cute::_2, cute::_1>, Pingpong>)
