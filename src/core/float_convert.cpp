#include "moe/float_convert.h"

#include <cmath>
#include <cstring>

namespace moe {

uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

uint16_t float_to_bf16_bits(float x) {
  uint32_t u = float_bits(x);
  if (std::isnan(x)) return static_cast<uint16_t>((u >> 16) | 0x0040);  // quiet NaN, keep sign
  // Round to nearest, ties to even, as __float2bfloat16_rn does.
  uint32_t lsb = (u >> 16) & 1u;
  u += 0x7FFFu + lsb;
  return static_cast<uint16_t>(u >> 16);
}

float bf16_bits_to_float(uint16_t b) { return float_from_bits(static_cast<uint32_t>(b) << 16); }

uint16_t float_to_fp16_bits(float x) {
  uint32_t u = float_bits(x);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t exp = (u >> 23) & 0xFFu;
  uint32_t man = u & 0x7FFFFFu;
  if (exp == 0xFF) return static_cast<uint16_t>(sign | 0x7C00u | (man ? 0x200u : 0u));  // inf / NaN
  int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return static_cast<uint16_t>(sign | 0x7C00u);  // overflow -> inf
  if (e <= 0) {
    // Subnormal (or zero) in fp16: shift the full mantissa, round to nearest even.
    if (e < -10) return static_cast<uint16_t>(sign);
    uint32_t m = man | 0x800000u;
    int shift = 14 - e;  // 13 + (1 - e)
    uint32_t half = 1u << (shift - 1);
    uint32_t rest = m & ((1u << shift) - 1);
    uint32_t r = m >> shift;
    if (rest > half || (rest == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = (static_cast<uint32_t>(e) << 10) | (man >> 13);
  uint32_t rest = man & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;  // may carry into the exponent: correct
  return static_cast<uint16_t>(sign | r);
}

float fp16_bits_to_float(uint16_t h) {
  uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0) {
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return float_from_bits(sign | 0x7F800000u | (man << 13));
  return float_from_bits(sign | ((exp - 15 + 127) << 23) | (man << 13));
}

}  // namespace moe
