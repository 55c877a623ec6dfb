// quantize() of fp32 input (FP8 block, 128x128 blocks: master weights into FP8 primary weights),
// after check_quantize_args, for a non-empty x (quantize() returns early on zero sizes); see
// quantize_fp32_kernel.cu.
#pragma once

#include <cuda_runtime_api.h>

#include "quant/quant_args.h"

namespace moe::quant {

void quantize_fp32_tiles(const QuantArgs& args, bool pow2, cudaStream_t stream);

}  // namespace moe::quant
