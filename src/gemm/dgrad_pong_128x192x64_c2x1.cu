// dgrad, ping-pong 128x192x64, cluster 2x1x1 (the weight tile multicast to two row blocks), bf16
// output, 64x64 epilogue subtiles. The dgrad tile of reductions up to 2048 into outputs at least
// 768 wide (fc1 dgrad of fine-grained experts; SonicMoE's choice for its dx): 1.5x fewer tiles
// than 128x128 and, unlike the cooperative 128x256, an epilogue that overlaps the other warp
// group's main loop. This cluster serves outputs of an odd number of 192-wide tiles.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_dgrad_pong_128x192x64_c2x1, "pong_128x192x64_c2x1", Op::kDgrad,
                   Sm90GroupedGemm<Op::kDgrad, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_192, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Pingpong,
                                   cute::Shape<cute::_64, cute::_64>>)
