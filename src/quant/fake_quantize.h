// Quantize-dequantize of token operands in expert groups: the GEMM operands of the emulated
// MXFP8 / NVFP4 experts (docs/quantization.md, "Emulated compute"). Each expert's rows
// [g[e], g[e + 1]) are quantized as a matrix of their own -- 1-D blocks along the columns
// (rowwise) or along the rows starting at the group's first row (columnwise; a last partial block
// counts its missing rows as zeros), NVFP4 with one global amax per group, as TransformerEngine
// quantizes each expert's split -- and the dequantized values are written back in x's orientation,
// rounded to bf16. Bitwise the decode of moe::quantize's codes (the same device rules), and
// ref::fake_quantize_groups on the host. Rows outside [g[0], g[E]) are not written.
//
// Graph-safe: no allocation, no synchronisation, no host read of device data.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "moe/quant_format.h"
#include "moe/tensor.h"

namespace moe::quant {

// Device workspace of fake_quantize_groups for `groups` groups.
size_t fake_quantize_workspace_bytes(int groups);

// x bf16 [rows, cols] -> out bf16 [rows, cols] (x itself, or not overlapping it). config: format,
// pow2_scale (FP8 block); 1-D blocks only; round to nearest; the copy flags and scale layouts are
// ignored. group_offsets int32 [E + 1] on the device, non-decreasing (a precondition: the device
// values are not checked; offsets past `rows` are clamped to it). Bad arguments raise moe::Error
// naming the argument.
void fake_quantize_groups(const QuantConfig& config, bool columnwise, const TensorView& x,
                          const TensorView& group_offsets, const TensorView& out, void* workspace,
                          cudaStream_t stream);

}  // namespace moe::quant
