// Branch-free conversions of the quantize / dequantize inner loops, written once for the host and
// the device so that a CPU test (tests/cpu/test_quant_convert.cpp) checks them against the
// reference (src/reference/quantize_ref.h) over every input class: the E2M1 encoder of NVFP4 and
// the E4M3 / E2M1 decoders of dequantize. Every operation is integer or a single IEEE fp32
// multiply or add whose operands make the result exact or whose rounding is the rule's (so
// nothing depends on FMA contraction or on flushing subnormals: nvcc keeps them by default).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOE_QUANT_HD __host__ __device__ __forceinline__
#else
#define MOE_QUANT_HD inline
#endif

namespace moe::quant {

MOE_QUANT_HD uint32_t bits_of(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}

MOE_QUANT_HD float float_of(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// One fp32 product / sum, never contracted with a neighbouring operation.
MOE_QUANT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

MOE_QUANT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// E4M3 code -> fp32. The low seven bits placed at the top of an fp32 exponent / mantissa read as
// 2^(e - 127) * (1 + m / 8) (e > 0) or m * 2^-129 (e = 0, an fp32 subnormal); times 2^120 (exact)
// that is the E4M3 value, subnormals included. 0x7F / 0xFF are NaN.
MOE_QUANT_HD float e4m3_decode(uint32_t code) {
  const uint32_t mag = code & 0x7Fu;
  const float v = mul_rn(float_of((mag << 20) | ((code & 0x80u) << 24)), 1.329227995784916e36f /* 2^120 */);
  return mag == 0x7Fu ? float_of(0x7FC00000u) : v;
}

// E2M1 nibble -> fp32, the same construction: 2^(e - 127) * (1 + m / 2) or m * 2^-127, times
// 2^126 (exact): 0, 0.5, 1, 1.5, 2, 3, 4, 6 with the sign of bit 3.
MOE_QUANT_HD float e2m1_decode(uint32_t nibble) {
  return mul_rn(float_of(((nibble & 7u) << 22) | ((nibble & 8u) << 28)), 8.507059173023462e37f /* 2^126 */);
}

// fp32 -> E2M1 nibble for any v but NaN: round to nearest even, saturating to +-6 (inf too), the
// sign of zero kept. |v| >= 1 rounds its fp32 bits to one mantissa bit (ties to even: the
// +0x1FFFFF plus the kept bit), which reads as the code 2 + 2 (exponent - 127) + mantissa (min 7
// saturates); |v| < 1 rounds v + 2^22 to a multiple of 0.5 in one fp32 add (ties to even), giving
// code 0, 1 or 2 directly (0.25 -> 0, 0.75 -> 1.0).
MOE_QUANT_HD uint32_t e2m1_encode_rn_not_nan(float v) {
  const uint32_t u = bits_of(v);
  const uint32_t a = u & 0x7FFFFFFFu;
  const uint32_t rounded = (a + 0x1FFFFFu + ((a >> 22) & 1u)) >> 22;  // (exponent << 1 | mantissa), rounded
  const uint32_t normal = rounded - 252u;                             // 127 << 1 is code 2 (1.0)
  const uint32_t small = bits_of(add_rn(float_of(a), 4194304.0f /* 2^22 */)) - 0x4A800000u;
  const uint32_t code = a < 0x3F800000u ? small : (normal < 7u ? normal : 7u);
  return code | ((u >> 28) & 8u);
}

// fp32 -> E2M1 nibble, the same with NaN -> 0.
MOE_QUANT_HD uint32_t e2m1_encode_rn(float v) {
  return (bits_of(v) & 0x7FFFFFFFu) > 0x7F800000u ? 0u : e2m1_encode_rn_not_nan(v);
}

}  // namespace moe::quant
