// dgrad, ping-pong 128x192x64, cluster 1x2x1 (the dY tile multicast to two column blocks), bf16
// output, 64x64 epilogue subtiles. Chosen where 192-wide tile pairs fill the output, an even number
// of tiles (sonic-7b-fine's fc1 dgrad: 1.03x the 2x1 cluster; sonic-30b-coarse's, 4096 wide: 1.04x).
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_dgrad_pong_128x192x64_c1x2, "pong_128x192x64_c1x2", Op::kDgrad,
                   Sm90GroupedGemm<Op::kDgrad, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_192, cute::_64>,
                                   cute::Shape<cute::_1, cute::_2, cute::_1>, Pingpong,
                                   cute::Shape<cute::_64, cute::_64>>)
