// wgrad, ping-pong 128x128x64, cluster 2x1x1, fp32 output:
// fp32 weight gradient (write or main_grad accumulation), ping-pong 128x128.
#include "gemm/sm90_grouped_kernel.cuh"

MOE_GROUPED_KERNEL(entry_wgrad_pong_128x128x64_c2x1_f32, "pong_128x128x64_c2x1", Op::kWgrad, Out::kFP32,
                   Sm90GroupedGemm<Op::kWgrad, float, float,
                                   cute::Shape<cute::_128, cute::_128, cute::_64>,
                                   cute::Shape<cute::_2, cute::_1, cute::_1>, Pingpong>)
