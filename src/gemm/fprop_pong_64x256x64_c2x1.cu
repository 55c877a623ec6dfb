// fprop, ping-pong 64x256x64, cluster 2x1x1, bf16 output:
// ping-pong with the widest WGMMA (64x256) per warp group.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fprop_pong_64x256x64_c2x1, "pong_64x256x64_c2x1", Op::kFprop, Out::kBF16,
                   Sm90GroupedGemm<Op::kFprop, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_64, cute::_256, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Pingpong>)
