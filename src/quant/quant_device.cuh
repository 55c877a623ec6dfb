// Device-side rules of the quantization formats: conversions (bit-exact: software ones that state
// the rules, and hardware ones where they give the same bits, NaN payloads aside), the per-block
// scale rules, the scale layouts and the Philox generator of stochastic rounding. The CPU reference (src/reference/quantize_ref)
// implements the same rules independently; docs/quantization.md states them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cfloat>
#include <cstdint>
#include <type_traits>

#include "moe/quant_format.h"
#include "quant/quant_convert.h"

namespace moe::quant {

// E4M3 encoding of the quantize kernels: the hardware conversion (cvt.rn.satfinite.e4m3x2.f32:
// round to nearest even, |v| > 448 and inf saturate to +-448, subnormals rounded, signed zeros)
// with every NaN byte rewritten to 0x7F, four values per call. false selects the software
// conversion below (bitwise the same results, several times the instructions); the GPU test
// QuantConvert.HardwareE4M3MatchesSoftware compares the two on every fp32 input.
constexpr bool kHardwareE4M3 = true;

// ---- conversions -----------------------------------------------------------------------------

__device__ __forceinline__ uint32_t abs_bits(float x) { return __float_as_uint(x) & 0x7FFFFFFFu; }

// fp32 -> E4M3, round to nearest even, saturating to +-448 (inf too); NaN -> 0x7F.
__device__ __forceinline__ uint8_t e4m3_from_float(float p) {
  const uint32_t u = __float_as_uint(p);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;                        // NaN
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  if (a >= 0x43E00000u) return sign | 0x7E;                // >= 448 (and inf)
  if (a < 0x3C800000u) {                                    // below 2^-6: E4M3 subnormals, step 2^-9
    const int n = __float2int_rn(__uint_as_float(a) * 512.0f);  // exact scaling; 0..8, 8 is 2^-6
    return sign | static_cast<uint8_t>(n);
  }
  const uint32_t e = (a >> 23) - 120u;  // E4M3 exponent field (bias 7)
  const uint32_t keep = (a >> 20) & 7u, rest = a & 0xFFFFFu;
  const uint32_t up = (rest > 0x80000u || (rest == 0x80000u && (keep & 1u))) ? 1u : 0u;
  return sign | static_cast<uint8_t>((e << 3) + keep + up);  // a carry moves into the exponent
}

__device__ __forceinline__ float e4m3_to_float(uint8_t c) {
  const uint32_t e = (c >> 3) & 0xFu, m = c & 7u;
  const uint32_t sign = static_cast<uint32_t>(c & 0x80u) << 24;
  if (e == 15u && m == 7u) return __uint_as_float(0x7FC00000u);
  if (e == 0u) return __uint_as_float(sign | __float_as_uint(static_cast<float>(m) * (1.0f / 512.0f)));
  return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}

// Two fp32 -> two E4M3 bytes (a in the low byte, the upper 16 bits zero) by the hardware
// conversion (cvt.rn.satfinite.e4m3x2.f32: round to nearest even, saturating). A NaN keeps its
// sign, so its byte is 0x7F or 0xFF: e4m3_nan_bytes_to_7f makes it the rule's 0x7F.
__device__ __forceinline__ uint32_t cvt_e4m3x2(float a, float b) {
  uint32_t r;
  // cvt packs its first source into the high byte.
  asm("{\n\t.reg .b16 c;\n\tcvt.rn.satfinite.e4m3x2.f32 c, %2, %1;\n\tcvt.u32.u16 %0, c;\n\t}"
      : "=r"(r)
      : "f"(a), "f"(b));
  return r;
}

// E4M3 has one NaN pattern per sign (S.1111.111): clear the sign of those bytes (NaN -> 0x7F).
__device__ __forceinline__ uint32_t e4m3_nan_bytes_to_7f(uint32_t bytes) {
  const uint32_t nan_bytes = ((bytes & 0x7F7F7F7Fu) + 0x01010101u) & 0x80808080u;
  return bytes & ~nan_bytes;
}

// One E4M3 byte of a value, by the conversion kHardwareE4M3 selects (the NVFP4 block scales).
__device__ __forceinline__ uint8_t e4m3_byte(float v) {
  if constexpr (kHardwareE4M3) {
    return static_cast<uint8_t>(e4m3_nan_bytes_to_7f(cvt_e4m3x2(v, 0.0f)));
  } else {
    return e4m3_from_float(v);
  }
}

// fp32 -> E2M1 nibble, round to nearest even, saturating; NaN -> 0 (quant_convert.h).
__device__ __forceinline__ uint8_t e2m1_from_float_rn(float v) { return static_cast<uint8_t>(e2m1_encode_rn(v)); }

// Stochastic rounding: up iff (rbits >> 8) < (|v| - lo) / (hi - lo) * 2^24, both sides exact in fp32.
__device__ __forceinline__ uint8_t e2m1_from_float_sr(float v, uint32_t rbits) {
  const float a = fabsf(v);
  if (a != a) return 0;
  const uint8_t sign = static_cast<uint8_t>((__float_as_uint(v) >> 28) & 8u);
  if (a >= 6.0f) return sign | 7;
  const int c = (a >= 0.5f) + (a >= 1.0f) + (a >= 1.5f) + (a >= 2.0f) + (a >= 3.0f) + (a >= 4.0f);
  const float lo = c < 4 ? 0.5f * c : (c == 4 ? 2.0f : (c == 5 ? 3.0f : 4.0f));
  const float inv_step = c < 4 ? 2.0f : (c < 6 ? 1.0f : 0.5f);
  const float frac = __fmul_rn(__fsub_rn(a, lo), inv_step);  // exact (Sterbenz; power-of-two step)
  const bool up = static_cast<float>(rbits >> 8) < __fmul_rn(frac, 16777216.0f);
  return sign | static_cast<uint8_t>(c + (up ? 1 : 0));
}

__device__ __forceinline__ float e2m1_to_float(uint32_t nibble) { return e2m1_decode(nibble); }

// Two E4M3 bytes (the low 16 bits of w) -> two fp32, exactly: the hardware conversion to f16x2
// (every E4M3 value, subnormals included, is an f16 value; NaN stays NaN), then f16 -> fp32.
__device__ __forceinline__ float2 e4m3x2_to_float2(uint32_t w) {
  uint32_t h;
  asm("{\n\t.reg .b16 lo;\n\tcvt.u16.u32 lo, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, lo;\n\t}" : "=r"(h) : "r"(w));
  return __half22float2(*reinterpret_cast<const __half2*>(&h));
}

// Two fp32 -> one word of two bf16 (a in the low half), round to nearest even, by the hardware
// conversion. Its only departure from bf16_bits_from_float is the NaN payload (always 0x7FFF),
// the same for the canonical NaN an fp32 multiply returns.
__device__ __forceinline__ uint32_t bf16x2_bits(float a, float b) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// 2^k for k in [-128, 127], exact (normal or subnormal fp32).
__device__ __forceinline__ float pow2f(int k) {
  return k >= -126 ? __uint_as_float(static_cast<uint32_t>(k + 127) << 23) : __uint_as_float(0x00400000u >> (-127 - k));
}

// MX shared exponent: exponent of fp32(amax / 448) rounded up, clamped to [0, 254]; inf -> 254, NaN -> 255.
__device__ __forceinline__ uint8_t e8m0_from_amax(float amax) {
  const uint32_t ab = __float_as_uint(amax);
  if (ab > 0x7F800000u) return 255;
  if (ab == 0x7F800000u) return 254;
  const uint32_t v = __float_as_uint(__fdiv_rn(amax, 448.0f));
  const uint32_t e = v >> 23, m = v & 0x7FFFFFu;
  if (e == 0u) return m > 0x400000u ? 1 : 0;  // zero or subnormal: 2^-127 or 2^-126 at most
  const uint32_t r = e + (m != 0u ? 1u : 0u);
  return static_cast<uint8_t>(r > 254u ? 254u : r);
}

__device__ __forceinline__ float e8m0_to_float(uint32_t e) {
  return e == 255u ? __uint_as_float(0x7FC00000u) : pow2f(static_cast<int>(e) - 127);
}

// fp32 -> bf16 bits, round to nearest even, NaN kept quiet with its sign (as moe::float_to_bf16_bits).
__device__ __forceinline__ uint16_t bf16_bits_from_float(float x) {
  uint32_t u = __float_as_uint(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// ---- scale rules -----------------------------------------------------------------------------

// Block length of a format along its blocked dimension: 128, 32 or 16.
template <QuantFormat F>
__host__ __device__ constexpr int block_len() {
  return F == QuantFormat::kFP8Block ? 128 : (F == QuantFormat::kMXFP8 ? 32 : 16);
}

__device__ __forceinline__ float fp8_block_scale(float amax, bool pow2) {
  if (amax == 0.0f || !isfinite(amax)) return 1.0f;
  float s = __fdiv_rn(448.0f, amax);
  if (isinf(s)) s = FLT_MAX;
  if (pow2) s = __uint_as_float(__float_as_uint(s) & 0xFF800000u);
  return s;
}

__device__ __forceinline__ float nvfp4_global_scale(float g) {
  if (g == 0.0f || !isfinite(g)) return 1.0f;
  const float s = __fdiv_rn(2688.0f, g);
  return isinf(s) ? FLT_MAX : s;
}

// The encode side of one block: what multiplies each element before its conversion, and the
// stored scale (fp32 scale_inv, or one byte).
struct BlockEncode {
  float factor;     // FP8 block: scale; MXFP8: 2^(127 - e); NVFP4: S / s (0 when s is 0 or NaN)
  float scale_f32;  // FP8 block: scale_inv
  uint8_t scale_u8; // MXFP8: e; NVFP4: s
};

template <QuantFormat F>
__device__ __forceinline__ BlockEncode block_encode(float amax, bool pow2, float S) {
  BlockEncode b;
  b.scale_f32 = 0.0f;
  b.scale_u8 = 0;
  if constexpr (F == QuantFormat::kFP8Block) {
    b.factor = fp8_block_scale(amax, pow2);
    b.scale_f32 = __fdiv_rn(1.0f, b.factor);
  } else if constexpr (F == QuantFormat::kMXFP8) {
    b.scale_u8 = e8m0_from_amax(amax);
    b.factor = pow2f(127 - static_cast<int>(b.scale_u8));
  } else {
    b.scale_u8 = e4m3_byte(__fdiv_rn(__fmul_rn(amax, S), 6.0f));
    const float sf = e4m3_decode(b.scale_u8);
    b.factor = sf > 0.0f ? __fdiv_rn(S, sf) : 0.0f;
  }
  return b;
}

// Whether x * factor is never NaN for the elements of an NVFP4 block with this encode factor, so
// the E2M1 encoder may skip its NaN test: a block holding a NaN has a NaN scale and so a zero
// factor, and a finite non-zero factor keeps every other element (finite or infinite) a number.
// The factor is infinite when the global scale is huge and the block scale tiny (a matrix whose
// amax is below about 2^-107): zeros times it are NaN, which encode as 0.
__device__ __forceinline__ bool products_are_numbers(float factor) { return factor != 0.0f && factor <= FLT_MAX; }

// E2M1 nibble of a product: without the NaN test where the block's products are numbers.
template <bool kNumbers>
__device__ __forceinline__ uint32_t e2m1_code(float p) {
  return kNumbers ? e2m1_encode_rn_not_nan(p) : e2m1_encode_rn(p);
}

// Runs f(std::true_type{}) when `numbers` (the block's products are numbers: products_are_numbers
// for NVFP4, no_nan_products for the FP8 formats) and f(std::false_type{}) otherwise; f passes the
// tag's value to e2m1_code or encode_e4m3x4 as kNumbers, so the common path is compiled without
// the NaN test or rewrite.
template <class Fn>
__device__ __forceinline__ void with_numbers_tag(bool numbers, Fn&& f) {
  if (numbers)
    f(std::true_type{});
  else
    f(std::false_type{});
}

// Whether no product x * factor of an FP8 block (FP8 block scaling or MXFP8) can be NaN, from the
// bits of the block's amax (the largest |x| bit pattern, so a NaN element makes it a NaN pattern):
// without a NaN element every factor of these formats is finite and not zero, so a product is a
// number or an infinity, which saturates to +-448. The E4M3 encoders then skip their NaN rewrite.
__device__ __forceinline__ bool no_nan_products(uint32_t amax_bits) { return amax_bits <= 0x7F800000u; }

// FP8 formats: one E4M3 byte of an element.
__device__ __forceinline__ uint8_t encode_e4m3(float x, float factor) { return e4m3_from_float(__fmul_rn(x, factor)); }

// Four products x[i] * factor as E4M3 bytes, x[0] in the low byte. kNumbers: the caller knows that
// no product is NaN (no_nan_products), so the NaN rewrite is left out.
template <bool kNumbers = false>
__device__ __forceinline__ uint32_t encode_e4m3x4(float x0, float x1, float x2, float x3, float factor) {
  const float p0 = __fmul_rn(x0, factor), p1 = __fmul_rn(x1, factor), p2 = __fmul_rn(x2, factor),
              p3 = __fmul_rn(x3, factor);
  if constexpr (kHardwareE4M3) {
    uint32_t r;
    // cvt packs its first source into the high byte of each 16-bit half.
    asm("{\n\t.reg .b16 lo, hi;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 lo, %2, %1;\n\t"
        "cvt.rn.satfinite.e4m3x2.f32 hi, %4, %3;\n\t"
        "mov.b32 %0, {lo, hi};\n\t}"
        : "=r"(r)
        : "f"(p0), "f"(p1), "f"(p2), "f"(p3));
    return kNumbers ? r : e4m3_nan_bytes_to_7f(r);
  } else {
    return static_cast<uint32_t>(e4m3_from_float(p0)) | (static_cast<uint32_t>(e4m3_from_float(p1)) << 8) |
           (static_cast<uint32_t>(e4m3_from_float(p2)) << 16) | (static_cast<uint32_t>(e4m3_from_float(p3)) << 24);
  }
}

// Eight consecutive bf16 (a 16-byte vector, element 0 in the low half of word 0).
__device__ __forceinline__ float bf16_word_lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf16_word_hi(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }

// Largest |x| bit pattern of the bf16 pairs in w, per 16-bit half, folded into acc.
__device__ __forceinline__ uint32_t abs_max_pairs(uint32_t acc, uint32_t w) { return __vmaxu2(acc, w & 0x7FFF7FFFu); }

// The amax of a pair accumulator as fp32 bits: the larger half, shifted into place.
__device__ __forceinline__ uint32_t pairs_amax_bits(uint32_t pairs) {
  return max(pairs << 16, pairs & 0xFFFF0000u);
}

// ---- scale layouts ---------------------------------------------------------------------------

__device__ __forceinline__ int64_t scale_index(ScaleLayout layout, int64_t r, int64_t j, int64_t block_rows,
                                               int64_t block_cols) {
  if (layout == ScaleLayout::kRowMajor) return r * block_cols + j;
  if (layout == ScaleLayout::kMNMajor) return j * ((block_rows + 3) / 4 * 4) + r;
  const int64_t tiles_per_row = (block_cols + 3) / 4;
  return ((r / 128) * tiles_per_row + j / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + j % 4;
}

// One block's scale into its copy: fp32 scale_inv (FP8 block) or one byte, at block (r, j) of
// matrix b. Copy: any struct with the copy's scale pointer, layout, block grid and scale entries
// per matrix (the kernels' parameter structs).
template <QuantFormat F, typename Copy>
__device__ __forceinline__ void store_scale_at(const Copy& c, int64_t i, const BlockEncode& e) {
  if constexpr (F == QuantFormat::kFP8Block)
    static_cast<float*>(c.scale)[i] = e.scale_f32;
  else
    static_cast<uint8_t*>(c.scale)[i] = e.scale_u8;
}
template <QuantFormat F, typename Copy>
__device__ __forceinline__ void store_block_scale(const Copy& c, int64_t b, int64_t r, int64_t j,
                                                  const BlockEncode& e) {
  store_scale_at<F>(c, b * c.scale_entries + scale_index(c.layout, r, j, c.block_rows, c.block_cols), e);
}

// How far a scale index moves when the block row moves by d with the block column fixed:
// scale_index(r + d, j) - scale_index(r, j). Exact for the linear layouts at any r; for the
// swizzled one when r and r + d lie in one group of 128 rows and either d is a multiple of 32 or r
// and r + d lie in one group of 32 (the steps the tile kernel takes).
template <typename Copy>
__device__ __forceinline__ int64_t scale_row_step(const Copy& c, int d) {
  return scale_index(c.layout, d, 0, c.block_rows, c.block_cols) - scale_index(c.layout, 0, 0, c.block_rows, c.block_cols);
}

// ---- stochastic rounding bits ----------------------------------------------------------------

struct Philox4 {
  uint32_t v[4];
};

__device__ __forceinline__ Philox4 philox4x32_10(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                                 uint32_t k1) {
#pragma unroll
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    const uint32_t hi0 = __umulhi(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    const uint32_t hi1 = __umulhi(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0;
    c1 = lo1;
    c2 = n2;
    c3 = lo0;
  }
  return Philox4{{c0, c1, c2, c3}};
}

// The four words of the call that serves flat positions 4g .. 4g + 3 of a copy.
__device__ __forceinline__ Philox4 sr_bits4(uint64_t seed, uint64_t offset, int copy, uint64_t g) {
  return philox4x32_10(static_cast<uint32_t>(g), static_cast<uint32_t>(g >> 32) | (static_cast<uint32_t>(copy) << 31),
                       static_cast<uint32_t>(offset), static_cast<uint32_t>(offset >> 32), static_cast<uint32_t>(seed),
                       static_cast<uint32_t>(seed >> 32));
}

}  // namespace moe::quant
