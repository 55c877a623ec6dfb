// wgrad, cooperative 128x256x64, cluster 2x1x1, fp32 output. Used for
// ragged-K weight gradient in fp32: written (beta = 0) or accumulated into main_grad (C = D, beta
// = 1); cooperative 128x256 as for bf16.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_wgrad_coop_128x256x64_c2x1_f32, "coop_128x256x64_c2x1", Op::kWgrad,
                   Sm90GroupedGemm<Op::kWgrad, float, float,
                                   cute::Shape<cute::_128, cute::_256, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Cooperative>)
