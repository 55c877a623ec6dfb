// dgrad, ping-pong 128x128x64, cluster 2x1x1, bf16 output. Used for short reductions (N <= 768,
// e.g. fc1 of fine-grained experts): ping-pong overlaps the epilogue; measured 1.07-1.17x the
// cooperative tile at N = 512. The epilogue stages 64x64 output subtiles instead of CUTLASS's
// 64x32 (half the TMA stores per tile): 1.04-1.05x on sonic-7b-fine's fc1 dgrad in round-robin
// order, the same or up to 1.02x on the other products; in runs of 4 tiles (what the heuristic
// takes at N <= 512) both subtiles give the same speed (481 vs 469-483 TFLOP/s).
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_dgrad_pong_128x128x64_c2x1, "pong_128x128x64_c2x1", Op::kDgrad,
                   Sm90GroupedGemm<Op::kDgrad, cutlass::bfloat16_t, void,
                                   cute::Shape<cute::_128, cute::_128, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Pingpong,
                                   cute::Shape<cute::_64, cute::_64>>)
