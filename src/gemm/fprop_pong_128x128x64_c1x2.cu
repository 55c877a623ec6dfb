// fprop, ping-pong 128x128x64, cluster 1x2x1, bf16 output. Used for short reductions (K <= 1024,
// or K <= 2048 with N <= 2048): one consumer warp group's epilogue overlaps the other's main loop;
// measured 1.03-1.18x the cooperative 128x256 tile on the fc2 products and the fine-grained fc1
// products of the named shapes (and 0.65-0.9x at K >= 4096). The epilogue stages 64x64 output
// subtiles (CUTLASS's default 64x32 makes eight TMA stores per tile, each waiting on the shared
// memory of the store two before it): 1.15x on sonic-7b-fine's fc2 (K = 256), 1.07x on
// sonic-30b-fine's, the same elsewhere.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fprop_pong_128x128x64_c1x2, "pong_128x128x64_c1x2", Op::kFprop,
                   Sm90GroupedGemm<Op::kFprop, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_128, cute::_64>,
                                   cute::Shape<cute::_1, cute::_2, cute::_1>, Pingpong,
                                   cute::Shape<cute::_64, cute::_64>>)
