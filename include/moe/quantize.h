// Quantization formats of the library: exact, graph-safe quantize / dequantize of bf16 matrices
// into FP8 block scaling, MXFP8 and NVFP4, each with an independent rowwise and columnwise copy.
// The rules (scale formulas, rounding, edge values) and the scale layouts are in
// docs/quantization.md; src/reference/quantize_ref.h is the bitwise CPU reference.
//
// A tensor is a matrix x [M, K] or a batch of matrices [B, M, K] (grouped expert weights); every
// matrix of a batch is quantized on its own (blocks never cross matrices, NVFP4 has one global
// amax per matrix), so a batch quantizes bitwise like its matrices one by one.
//
//   rowwise copy     data [B?, M, K], blocks along K (1 x b), or b x b tiles with 2-D blocks
//   columnwise copy  data [B?, K, M] = the quantization of x^T, blocks along M (b x 1 of x);
//                    with 2-D blocks it is exactly the transpose of the rowwise data
//
// Calls are graph-safe: no allocation, no synchronisation, no host read of device data (the
// NVFP4 global amax is computed on the device, order-independently, so results are
// deterministic). Bad arguments raise moe::Error naming the argument.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "moe/quant_format.h"
#include "moe/tensor.h"

namespace moe {

// Views of a quantized tensor. Copies that the config does not produce (and global_amax for
// formats other than NVFP4) may be left default-constructed.
struct QuantizedTensor {
  TensorView rowwise_data;      // fp8_e4m3 / fp4_e2m1 [B?, M, K]
  TensorView rowwise_scale;     // scale_shape(config, M, K), B prepended when batched
  TensorView columnwise_data;   // fp8_e4m3 / fp4_e2m1 [B?, K, M]
  TensorView columnwise_scale;  // scale_shape(config, K, M, true), B prepended when batched
  TensorView global_amax;       // NVFP4: fp32 [B] (or [1] unbatched), written by quantize
};

// Quantizes bf16 x [M, K] or [B, M, K] (contiguous, 16-byte aligned, K a multiple of 8) into the
// copies the config asks for. x may also be fp32 (without stochastic rounding): fp32 master
// weights quantized straight into quantized weights (no bf16 rounding between). Shape rules per
// format (partial blocks) are in docs/quantization.md; anything else is a moe::Error naming 'x'.
void quantize(const QuantConfig& config, const TensorView& x, const QuantizedTensor& out, cudaStream_t stream);

// Quantizes the rows of bf16 x [T, K] gathered through a row map: row r of the quantized matrix
// [rows, K] is x[row_slots[r] / slots], zeros where row_slots[r] = -1 -- bitwise quantize() of the
// x_perm that Dispatcher::permute writes for a plan whose map this is (Dispatcher::row_slots), with
// no x_perm written or read. row_slots int32 [rows], slots >= 1 (the plan's slots per token).
// FP8 block scaling or MXFP8 with 1-D blocks (a token operand: NVFP4's global amax would be the
// gathered matrix's). An entry below -1 or at or past T * slots reads as a zero row and ORs
// kErrBadRowMap into error_word (when given).
void quantize_gathered(const QuantConfig& config, const TensorView& x, const TensorView& row_slots, int slots,
                       const QuantizedTensor& out, uint32_t* error_word, cudaStream_t stream);

// Dequantizes one copy (columnwise = false: rowwise) into out (bf16 or fp32), shaped like that
// copy's data: [B?, M, K] for rowwise, [B?, K, M] for columnwise. A value is the fp32 product of
// the element and its block's decode factor (docs/quantization.md), rounded to bf16 when out is bf16.
void dequantize(const QuantConfig& config, const QuantizedTensor& q, bool columnwise, const TensorView& out,
                cudaStream_t stream);

}  // namespace moe
