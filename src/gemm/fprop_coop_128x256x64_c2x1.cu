// fprop, cooperative 128x256x64, cluster 2x1x1, bf16 output. Used for
// fallback for long reductions when N is not a multiple of 512 (where the 1x2 cluster would leave
// CTAs idle): PyTorch's configuration, two consumer warp groups share a 128x256 tile, the 2x1
// cluster multicasts each weight tile to two M tiles.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fprop_coop_128x256x64_c2x1, "coop_128x256x64_c2x1", Op::kFprop,
                   Sm90GroupedGemm<Op::kFprop, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_256, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Cooperative>)
