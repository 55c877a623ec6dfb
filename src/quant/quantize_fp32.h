// quantize() of fp32 input (master weights into quantized primary weights), after
// check_quantize_args, for a non-empty x (quantize() returns early on zero sizes); see
// quantize_fp32_kernel.cu.
#pragma once

#include <cuda_runtime_api.h>

#include "quant/quant_args.h"

namespace moe::quant {

// FP8 block 128x128.
void quantize_fp32_tiles(const QuantArgs& args, bool pow2, cudaStream_t stream);
// Every other format and blocking (no stochastic rounding); NVFP4 after global_amax_fp32.
void quantize_fp32_blocks(const QuantArgs& args, const QuantConfig& config, cudaStream_t stream);
// NVFP4: each matrix's global amax into args.global_amax (zeroed by the caller).
void global_amax_fp32(const QuantArgs& args, cudaStream_t stream);

}  // namespace moe::quant
