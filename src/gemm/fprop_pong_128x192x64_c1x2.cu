// fprop, ping-pong 128x192x64, cluster 1x2x1 (the token tile multicast to two N tiles), bf16
// output, 64x64 epilogue subtiles. The tile of short reductions (see the 2x1 form) where the output
// width is a whole number of 384-wide tile pairs (sonic-7b-fine's H = 1536 = 4 x 384), so no
// cluster half idles at the right edge.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fprop_pong_128x192x64_c1x2, "pong_128x192x64_c1x2", Op::kFprop,
                   Sm90GroupedGemm<Op::kFprop, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_192, cute::_64>,
                                   cute::Shape<cute::_1, cute::_2, cute::_1>, Pingpong,
                                   cute::Shape<cute::_64, cute::_64>>)
