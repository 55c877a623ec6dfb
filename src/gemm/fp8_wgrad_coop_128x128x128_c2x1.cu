// FP8 block-scaled wgrad, cooperative 128x128x128, cluster 2x1x1, bf16 output (weight gradients
// written in bf16); the fp32 configuration's schedule (fp8_wgrad_coop_128x128x128_c2x1_f32.cu).
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fp8_wgrad_coop_128x128x128_c2x1, "fp8_coop_128x128x128_c2x1", Op::kWgrad,
                   Sm90Fp8WgradGemm<cutlass::bfloat16_t, void, cute::Shape<cute::_128, cute::_128, cute::_128>,
                                    cute::Shape<cute::_2, cute::_1, cute::_1>, Cooperative>)
