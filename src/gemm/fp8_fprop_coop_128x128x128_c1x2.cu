// FP8 block-scaled fprop form (fprop, and dgrad on the weights' columnwise copy), cooperative
// 128x128x128, cluster 1x2x1, bf16 output: a 128-deep K tile is one scale block, so each
// consumer promotes its WGMMA partial sums into the fp32 accumulator once per tile with the
// product of the two blocks' scales; the 1x2 cluster multicasts each token tile to two N tiles.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fp8_fprop_coop_128x128x128_c1x2, "fp8_coop_128x128x128_c1x2", Op::kFprop,
                   Sm90Fp8FpropGemm<cutlass::bfloat16_t, void, cute::Shape<cute::_128, cute::_128, cute::_128>,
                                    cute::Shape<cute::_1, cute::_2, cute::_1>, Cooperative>)
