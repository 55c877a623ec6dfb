// The branch-free conversions of the quantize / dequantize kernels (src/quant/quant_convert.h,
// compiled here for the host from the same source) against the CPU reference: every E4M3 and E2M1
// code decoded, and the E2M1 encoder on every fp32 sign / exponent / top-7-mantissa-bit pattern
// combined with low bits that land on, just below and just above each rounding tie.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>

#include "moe/float_convert.h"
#include "quant/quant_convert.h"
#include "reference/quantize_ref.h"

namespace moe {
namespace {

uint32_t bits(float x) { return float_bits(x); }
float from_bits(uint32_t u) { return float_from_bits(u); }

TEST(QuantConvert, E4M3DecodeEveryCode) {
  for (uint32_t c = 0; c < 256; ++c) {
    const float got = quant::e4m3_decode(c);
    const double want = ref::e4m3_to_double(static_cast<uint8_t>(c));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << c;
    } else {
      // Every E4M3 value is exact in fp32: the bits, signed zeros included, must agree.
      EXPECT_EQ(bits(got), bits(static_cast<float>(want))) << "code " << c;
    }
  }
}

TEST(QuantConvert, E2M1DecodeEveryCode) {
  for (uint32_t c = 0; c < 16; ++c)
    EXPECT_EQ(bits(quant::e2m1_decode(c)), bits(static_cast<float>(ref::e2m1_to_double(static_cast<uint8_t>(c)))))
        << "nibble " << c;
}

TEST(QuantConvert, E2M1EncodeMatchesReference) {
  std::mt19937 rng(7);
  int64_t checked = 0;
  for (uint32_t hi = 0; hi < (1u << 16); ++hi) {
    // Low 16 bits: exact ties (0), one above / below a tie of the low bits, all ones, random.
    const uint32_t lows[] = {0u, 1u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, static_cast<uint32_t>(rng() & 0xFFFFu)};
    for (uint32_t lo : lows) {
      const float v = from_bits(hi << 16 | lo);
      const uint32_t got = quant::e2m1_encode_rn(v);
      const uint32_t want = ref::e2m1_from_float_rn(v);
      ASSERT_EQ(got, want) << "input bits 0x" << std::hex << (hi << 16 | lo) << " (" << v << ")";
      if (!std::isnan(v))  // the encoder of blocks without NaN
        ASSERT_EQ(quant::e2m1_encode_rn_not_nan(v), want) << "input bits 0x" << std::hex << (hi << 16 | lo);
      ++checked;
    }
  }
  EXPECT_EQ(checked, int64_t(7) << 16);
}

TEST(QuantConvert, E2M1EncodeTiesAndEdges) {
  // The ties of the rule (docs/quantization.md) and the edges, both signs.
  const struct {
    float v;
    uint32_t code;
  } cases[] = {{0.0f, 0},  {0.25f, 0}, {0.26f, 1},  {0.75f, 2},  {1.25f, 2},   {1.75f, 4},    {2.5f, 4},
               {3.5f, 6},  {5.0f, 6},  {5.01f, 7},  {6.0f, 7},   {7.0f, 7},    {1e30f, 7},    {INFINITY, 7},
               {1e-40f, 0}, {0.5f, 1}, {0.74f, 1},  {2.9f, 5}};
  for (const auto& c : cases) {
    EXPECT_EQ(quant::e2m1_encode_rn(c.v), c.code) << c.v;
    EXPECT_EQ(quant::e2m1_encode_rn(-c.v), c.code | 8u) << -c.v;
  }
  EXPECT_EQ(quant::e2m1_encode_rn(NAN), 0u);
  EXPECT_EQ(quant::e2m1_encode_rn(-NAN), 0u);
}

}  // namespace
}  // namespace moe
