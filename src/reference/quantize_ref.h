// Bitwise CPU reference of the quantization formats (FP8 block scaling, MXFP8, NVFP4): every
// conversion, scale rule, layout and the stochastic-rounding generator, written independently of
// the kernels (exact double arithmetic for the narrow-format roundings, the fp32 operations of
// the rules as single IEEE fp32 operations). The rules are in docs/quantization.md.
#pragma once

#include <cstdint>
#include <vector>

#include "moe/quant_format.h"

namespace moe::ref {

// ---- scalar conversions ----------------------------------------------------------------------
// E4M3 (OCP FP8, bias 7, max 448, no inf): round to nearest even, saturating (|x| > 448 and inf
// -> +-448); NaN -> 0x7F. The sign of zero is kept.
uint8_t e4m3_from_double(double x);
double e4m3_to_double(uint8_t code);  // 0x7F / 0xFF -> NaN
// E2M1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), one nibble. Round to nearest even,
// saturating (|v| > 6 and inf -> +-6); NaN -> 0. The sign of zero is kept.
uint8_t e2m1_from_float_rn(float v);
// Stochastic rounding with 32 random bits: |v| between neighbours lo < hi rounds up iff
// (rbits >> 8) < (|v| - lo) / (hi - lo) * 2^24; |v| >= 6 -> 6; NaN -> 0.
uint8_t e2m1_from_float_sr(float v, uint32_t rbits);
double e2m1_to_double(uint8_t nibble);
// MX shared exponent of a block with absolute maximum amax: the power of two 2^(e-127) with e the
// exponent of fp32(amax / 448) rounded up, clamped to [0, 254]; amax 0 -> 0, inf -> 254, NaN -> 255.
uint8_t e8m0_from_amax(float amax);
double e8m0_to_double(uint8_t e);  // 2^(e - 127); 255 -> NaN

// NaN-propagating absolute maximum as the kernels compute it: the largest fp32 bit pattern of |x|
// (so a NaN wins over inf, inf over every finite value).
float abs_max(const float* v, int64_t n, int64_t stride = 1);

// ---- scale rules -----------------------------------------------------------------------------
// FP8 block: scale = 448 / amax in fp32 (inf -> FLT_MAX), 1 where amax is 0, inf or NaN,
// optionally rounded down to a power of two. scale_inv = fp32(1 / scale).
float fp8_block_scale(float amax, bool pow2);
// NVFP4 global encode scale S = 2688 / global_amax in fp32 (inf -> FLT_MAX), 1 where the amax is
// 0, inf or NaN.
float nvfp4_global_scale(float global_amax);
// NVFP4 block scale: e4m3(fp32(fp32(block_amax * S) / 6)).
uint8_t nvfp4_block_scale(float block_amax, float S);

// ---- stochastic rounding generator -----------------------------------------------------------
// Philox4x32-10 (Salmon et al., SC'11), counter ctr[4], key key[2].
void philox4x32_10(const uint32_t ctr[4], const uint32_t key[2], uint32_t out[4]);
// Random bits of the element at flat position `index` of a copy (copy 0: rowwise, 1: columnwise):
// word (index % 4) of Philox(ctr = {g_lo, g_hi | copy << 31, offset_lo, offset_hi},
// key = {seed_lo, seed_hi}) with g = index / 4.
uint32_t sr_random_bits(uint64_t seed, uint64_t offset, int copy, uint64_t index);

// ---- whole tensors ---------------------------------------------------------------------------
// Index of block (r, j) of one matrix's scale tensor in the configured layout, where r is the row
// (1-D) or row block (2-D) and j the block along the columns; block_rows x block_cols blocks.
int64_t scale_index(ScaleLayout layout, int64_t r, int64_t j, int64_t block_rows, int64_t block_cols);

// A quantized tensor on the host, as raw bytes: data packed like the device copy (FP4: element
// 2i in the low nibble of byte i), scales as their storage bytes (fp32 little-endian for FP8
// block), pad entries of a layout 0.
struct Quantized {
  std::vector<uint8_t> rowwise_data, rowwise_scale, columnwise_data, columnwise_scale;
  std::vector<float> global_amax;  // NVFP4: one per matrix
};

// x: B matrices [M, K] of bf16 bits. Shape rules are the kernels' (docs/quantization.md); the
// reference itself accepts any sizes its blocks can describe.
Quantized quantize(const QuantConfig& c, const std::vector<uint16_t>& x, int64_t B, int64_t M, int64_t K);
// The same rules on fp32 values (the device takes fp32 x for FP8 block 128x128 only: master weights).
Quantized quantize_fp32(const QuantConfig& c, const std::vector<float>& x, int64_t B, int64_t M, int64_t K);

// fp32 values of one copy ([B, M, K] rowwise, [B, K, M] columnwise): element times its block's
// decode factor, one fp32 multiply (FP8 block: scale_inv; MXFP8: 2^(e-127); NVFP4: fp32(s / S)).
std::vector<float> dequantize(const QuantConfig& c, const Quantized& q, bool columnwise, int64_t B, int64_t M,
                              int64_t K);

// Quantize-dequantize of a token operand x [rows, cols] in expert groups (the emulated recipes'
// GEMM operands): the rows [offsets[e], offsets[e + 1]) of each group quantized as a matrix of their
// own with c's 1-D blocks -- along the columns (rowwise), or along the rows from the group's first
// row (columnwise, the last block partial) -- NVFP4 with one global amax per group; the dequantized
// values in x's orientation. Rows outside every group are 0.
std::vector<float> fake_quantize_groups(const QuantConfig& c, bool columnwise, const std::vector<float>& x,
                                        int64_t rows, int64_t cols, const std::vector<int64_t>& offsets);

}  // namespace moe::ref
