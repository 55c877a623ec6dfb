// wgrad, cooperative 128x256x64, cluster 2x1x1, bf16 output. Used for
// ragged-K weight gradient written in bf16; the reduction (tokens of an expert) is long, so the
// cooperative tile wins everywhere measured (ping-pong 128x128 0.6-1.0x, the 1x2 cluster
// 0.55-1.04x).
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_wgrad_coop_128x256x64_c2x1, "coop_128x256x64_c2x1", Op::kWgrad,
                   Sm90GroupedGemm<Op::kWgrad, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_256, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Cooperative>)
