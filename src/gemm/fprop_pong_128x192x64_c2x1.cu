// fprop, ping-pong 128x192x64, cluster 2x1x1 (the weight tile multicast to two row blocks), bf16
// output, 64x64 epilogue subtiles. The tile of short reductions (fc2 at K = F <= 1024): 1.5x fewer
// tiles than 128x128, so fewer per-tile costs when a tile's main loop is a few k blocks (SonicMoE's
// down-projection uses this tile). This cluster serves output widths of an odd number of 192-wide
// tiles (qwen3-30b-a3b-ep8's H = 2048: 11). Each consumer warp group holds a 128x192 accumulator;
// the epilogue stores it as bf16 without an alpha multiply (epilogue_plain_conversion.cuh).
#include "gemm/epilogue_plain_conversion.cuh"
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_fprop_pong_128x192x64_c2x1, "pong_128x192x64_c2x1", Op::kFprop,
                   Sm90Gemm<Bf16Operands<Op::kFprop>, cutlass::bfloat16_t, void,
                            cute::Shape<cute::_128, cute::_192, cute::_64>,
                            cute::Shape<cute::_2, cute::_1, cute::_1>, Pingpong,
                            cute::Shape<cute::_64, cute::_64>, PlainConversion>)
