// FP8 block-scaled wgrad, cooperative 128x128x128, cluster 2x1x1, fp32 output written or
// accumulated into main_grad (C = D, beta = 1): both operands are the tokens' columnwise copies
// with one scale per row and 128-token block, so a K tile is exactly one block of every row; the
// 2x1 cluster multicasts each X^T tile to two dY^T tiles.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fp8_wgrad_coop_128x128x128_c2x1_f32, "fp8_coop_128x128x128_c2x1", Op::kWgrad,
                   Sm90Fp8WgradGemm<float, float, cute::Shape<cute::_128, cute::_128, cute::_128>,
                                    cute::Shape<cute::_2, cute::_1, cute::_1>, Cooperative>)
