// dgrad, ping-pong 128x192x64, cluster 2x1x1 (the weight tile multicast to two row blocks), bf16
// output, 64x64 epilogue subtiles. The short-reduction dgrad tile of fine-grained experts (fc1
// dgrad at N = 2F <= 768, SonicMoE's choice for its dx): 1.5x fewer tiles than 128x128, so fewer
// per-tile costs when the main loop is a few k blocks.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_dgrad_pong_128x192x64_c2x1, "pong_128x192x64_c2x1", Op::kDgrad,
                   Sm90GroupedGemm<Op::kDgrad, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_192, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Pingpong,
                                   cute::Shape<cute::_64, cute::_64>>)
