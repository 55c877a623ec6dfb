// fprop, ping-pong 128x192x64, cluster 1x2x1 (the token tile multicast to two N tiles), bf16
// output, 64x64 epilogue subtiles stored without an alpha multiply (epilogue_plain_conversion.cuh).
// The tile of short reductions (see the 2x1 form) where the output is an even number of 192-wide
// tiles (sonic-7b-fine's H = 1536: 8; H = 4096: 22), so no cluster half idles at the right edge.
#include "gemm/epilogue_plain_conversion.cuh"
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fprop_pong_128x192x64_c1x2, "pong_128x192x64_c1x2", Op::kFprop,
                   Sm90Gemm<Bf16Operands<Op::kFprop>, cutlass::bfloat16_t, void,
                            cute::Shape<cute::_128, cute::_192, cute::_64>,
                            cute::Shape<cute::_1, cute::_2, cute::_1>, Pingpong,
                            cute::Shape<cute::_64, cute::_64>, PlainConversion>)
