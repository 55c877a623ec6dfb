// CPU reference of the quantization formats: hand-computed conversions and scales, edge values
// (0, amax 0, inf, NaN, subnormals, +-448, rounding ties), the Philox known answers, the scale
// layouts, whole-tensor cases, exact round trips and the error bound |x - deq(q(x))| per format.
#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <cstring>
#include <random>
#include <set>
#include <vector>

#include "moe/error.h"
#include "moe/float_convert.h"
#include "moe/quant_format.h"
#include "reference/quantize_ref.h"
#include "support/expect_error.h"

namespace moe::ref {
namespace {

using ::moe::testing::expect_error_naming;

float f32(uint32_t bits) {
  float x;
  std::memcpy(&x, &bits, 4);
  return x;
}
float scale_inv_at(const std::vector<uint8_t>& bytes, int64_t i) {
  float x;
  std::memcpy(&x, &bytes[i * 4], 4);
  return x;
}
uint8_t nibble(const std::vector<uint8_t>& data, int64_t i) { return i % 2 ? data[i / 2] >> 4 : data[i / 2] & 0xF; }

QuantConfig config(QuantFormat f, QuantBlocking blk = QuantBlocking::k1D, bool rowwise = true, bool columnwise = true) {
  QuantConfig c;
  c.format = f;
  c.blocking = blk;
  c.rowwise = rowwise;
  c.columnwise = columnwise;
  return c;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> b(v.size());
  for (size_t i = 0; i < v.size(); ++i) b[i] = float_to_bf16_bits(v[i]);
  return b;
}

// Values spread over many binades, per-block magnitudes varying (what block scaling is for).
std::vector<uint16_t> random_bf16(int64_t n, int64_t block, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-20, 20);
  std::vector<float> v(n);
  float m = 1;
  for (int64_t i = 0; i < n; ++i) {
    if (i % block == 0) m = std::ldexp(1.0f, mag(rng));
    v[i] = nd(rng) * m;
  }
  return to_bf16(v);
}

TEST(QuantizeRef, E4M3Conversions) {
  EXPECT_EQ(e4m3_from_double(0.0), 0x00);
  EXPECT_EQ(e4m3_from_double(-0.0), 0x80);
  EXPECT_EQ(e4m3_from_double(1.0), 0x38);  // E = 7, M = 0
  EXPECT_EQ(e4m3_from_double(448.0), 0x7E);
  EXPECT_EQ(e4m3_from_double(-448.0), 0xFE);
  EXPECT_EQ(e4m3_from_double(449.0), 0x7E);  // saturating
  EXPECT_EQ(e4m3_from_double(1e30), 0x7E);
  EXPECT_EQ(e4m3_from_double(INFINITY), 0x7E);
  EXPECT_EQ(e4m3_from_double(-INFINITY), 0xFE);
  EXPECT_EQ(e4m3_from_double(NAN), 0x7F);
  EXPECT_EQ(e4m3_from_double(240.0), 0x77);                  // 1.875 * 2^7
  EXPECT_EQ(e4m3_from_double(std::ldexp(1.0, -9)), 0x01);    // smallest subnormal
  EXPECT_EQ(e4m3_from_double(std::ldexp(1.0, -10)), 0x00);   // tie between 0 and 2^-9: even (0)
  EXPECT_EQ(e4m3_from_double(std::ldexp(3.0, -10)), 0x02);   // tie between 2^-9 and 2^-8: even (2)
  EXPECT_EQ(e4m3_from_double(std::ldexp(1.0, -11)), 0x00);   // below half the smallest subnormal
  EXPECT_EQ(e4m3_from_double(-std::ldexp(1.0, -11)), 0x80);  // keeps the sign of zero
  EXPECT_EQ(e4m3_from_double(1.0625), 0x38);                 // tie between 1 and 1.125: even (1)
  EXPECT_EQ(e4m3_from_double(1.1875), 0x3A);                 // tie between 1.125 and 1.25: even (1.25)
  EXPECT_EQ(e4m3_from_double(std::ldexp(15.0, -10)), 0x08);  // 7.5 * 2^-9 rounds up to 2^-6 (code 8)
  // Every finite code decodes and re-encodes to itself.
  for (int c = 0; c < 256; ++c) {
    if ((c & 0x7F) == 0x7F) {
      EXPECT_TRUE(std::isnan(e4m3_to_double(static_cast<uint8_t>(c))));
      continue;
    }
    EXPECT_EQ(e4m3_from_double(e4m3_to_double(static_cast<uint8_t>(c))), c) << c;
  }
  EXPECT_EQ(e4m3_to_double(0x7E), 448.0);
  EXPECT_EQ(e4m3_to_double(0x01), std::ldexp(1.0, -9));
}

TEST(QuantizeRef, E2M1RoundToNearestEven) {
  const float grid[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
  for (int c = 0; c < 8; ++c) {
    EXPECT_EQ(e2m1_from_float_rn(grid[c]), c);
    EXPECT_EQ(e2m1_from_float_rn(-grid[c]), 8 | c);
    EXPECT_EQ(e2m1_to_double(static_cast<uint8_t>(c)), grid[c]);
    EXPECT_EQ(e2m1_to_double(static_cast<uint8_t>(8 | c)), -grid[c]);
  }
  // Ties go to the even code.
  EXPECT_EQ(e2m1_from_float_rn(0.25f), 0);
  EXPECT_EQ(e2m1_from_float_rn(0.75f), 2);
  EXPECT_EQ(e2m1_from_float_rn(1.25f), 2);
  EXPECT_EQ(e2m1_from_float_rn(1.75f), 4);
  EXPECT_EQ(e2m1_from_float_rn(2.5f), 4);
  EXPECT_EQ(e2m1_from_float_rn(3.5f), 6);
  EXPECT_EQ(e2m1_from_float_rn(5.0f), 6);
  EXPECT_EQ(e2m1_from_float_rn(-5.0f), 0xE);
  // Off ties: nearest.
  EXPECT_EQ(e2m1_from_float_rn(0.2500001f), 1);
  EXPECT_EQ(e2m1_from_float_rn(5.0000005f), 7);
  EXPECT_EQ(e2m1_from_float_rn(4.9999995f), 6);
  // Saturation, zero sign, NaN.
  EXPECT_EQ(e2m1_from_float_rn(6.5f), 7);
  EXPECT_EQ(e2m1_from_float_rn(INFINITY), 7);
  EXPECT_EQ(e2m1_from_float_rn(-INFINITY), 0xF);
  EXPECT_EQ(e2m1_from_float_rn(-0.0f), 8);
  EXPECT_EQ(e2m1_from_float_rn(-1e-30f), 8);
  EXPECT_EQ(e2m1_from_float_rn(NAN), 0);
}

TEST(QuantizeRef, E2M1StochasticRounding) {
  // 0.75 is half-way between 0.5 (code 1) and 1 (code 2): up iff rbits >> 8 < 2^23.
  EXPECT_EQ(e2m1_from_float_sr(0.75f, 0x7FFFFF00u), 2);
  EXPECT_EQ(e2m1_from_float_sr(0.75f, 0x80000000u), 1);
  EXPECT_EQ(e2m1_from_float_sr(0.75f, 0xFFFFFFFFu), 1);
  EXPECT_EQ(e2m1_from_float_sr(0.75f, 0x00000000u), 2);
  // Grid values never move, whatever the bits.
  for (uint32_t r : {0u, 0x12345678u, 0xFFFFFFFFu}) {
    EXPECT_EQ(e2m1_from_float_sr(3.0f, r), 5);
    EXPECT_EQ(e2m1_from_float_sr(-6.0f, r), 0xF);
    EXPECT_EQ(e2m1_from_float_sr(0.0f, r), 0);
    EXPECT_EQ(e2m1_from_float_sr(7.0f, r), 7);  // saturates, never rounds past 6
    EXPECT_EQ(e2m1_from_float_sr(NAN, r), 0);
  }
  // Unbiased: the mean over the generator's bits approaches the value. The standard error of the
  // mean of 200000 draws in [4, 6] is at most 1 / sqrt(200000) = 0.0022; allow 5 of them.
  for (float v : {0.1f, 0.6f, 1.3f, 2.2f, 4.9f, -3.3f}) {
    double sum = 0;
    const int n = 200000;
    for (int i = 0; i < n; ++i) sum += e2m1_to_double(e2m1_from_float_sr(v, sr_random_bits(7, 0, 0, i)));
    EXPECT_NEAR(sum / n, v, 0.011) << v;
  }
}

TEST(QuantizeRef, E8M0SharedExponent) {
  EXPECT_EQ(e8m0_from_amax(448.0f), 127);           // amax / 448 = 1 exactly
  EXPECT_EQ(e8m0_from_amax(449.0f), 128);           // mantissa non-zero: rounded up
  EXPECT_EQ(e8m0_from_amax(896.0f), 128);           // 2 exactly
  EXPECT_EQ(e8m0_from_amax(224.0f), 126);           // 0.5 exactly
  EXPECT_EQ(e8m0_from_amax(1.0f), 127 - 8);         // 1/448 in (2^-9, 2^-8]: 2^-8
  EXPECT_EQ(e8m0_from_amax(0.0f), 0);
  EXPECT_EQ(e8m0_from_amax(NAN), 255);
  EXPECT_EQ(e8m0_from_amax(INFINITY), 254);         // saturates
  EXPECT_EQ(e8m0_from_amax(std::ldexp(448.0f, -127)), 0);   // 2^-127 exactly (an fp32 subnormal)
  EXPECT_EQ(e8m0_from_amax(std::ldexp(449.0f, -127)), 1);
  EXPECT_EQ(e8m0_from_amax(std::ldexp(448.0f, -135)), 0);   // clamped
  EXPECT_EQ(e8m0_from_amax(f32(0x00000001u)), 0);          // the smallest subnormal amax
  EXPECT_EQ(e8m0_from_amax(FLT_MAX), 127 + 120);            // FLT_MAX / 448 < 2^120
  EXPECT_EQ(e8m0_to_double(127), 1.0);
  EXPECT_EQ(e8m0_to_double(0), std::ldexp(1.0, -127));
  EXPECT_TRUE(std::isnan(e8m0_to_double(255)));
}

TEST(QuantizeRef, ScaleRules) {
  EXPECT_EQ(fp8_block_scale(448.0f, false), 1.0f);
  EXPECT_EQ(fp8_block_scale(3.5f, false), 128.0f);
  EXPECT_EQ(fp8_block_scale(3.0f, false), 448.0f / 3.0f);
  EXPECT_EQ(fp8_block_scale(3.0f, true), 128.0f);  // 149.33 rounded down to a power of two
  EXPECT_EQ(fp8_block_scale(0.0f, false), 1.0f);
  EXPECT_EQ(fp8_block_scale(INFINITY, false), 1.0f);
  EXPECT_EQ(fp8_block_scale(NAN, true), 1.0f);
  EXPECT_EQ(fp8_block_scale(f32(1u), false), FLT_MAX);  // 448 / 2^-149 overflows
  EXPECT_EQ(fp8_block_scale(f32(1u), true), std::ldexp(1.0f, 127));
  EXPECT_EQ(nvfp4_global_scale(2688.0f), 1.0f);
  EXPECT_EQ(nvfp4_global_scale(1.0f), 2688.0f);
  EXPECT_EQ(nvfp4_global_scale(0.0f), 1.0f);
  EXPECT_EQ(nvfp4_global_scale(INFINITY), 1.0f);
  EXPECT_EQ(nvfp4_global_scale(NAN), 1.0f);
  EXPECT_EQ(nvfp4_global_scale(f32(1u)), FLT_MAX);
  // s = e4m3(block_amax * S / 6): block_amax 6, S 1 -> 1; the global amax block -> 448.
  EXPECT_EQ(nvfp4_block_scale(6.0f, 1.0f), 0x38);
  EXPECT_EQ(nvfp4_block_scale(2688.0f, 1.0f), 0x7E);
  EXPECT_EQ(nvfp4_block_scale(5.0f, nvfp4_global_scale(5.0f)), 0x7E);
  EXPECT_EQ(nvfp4_block_scale(0.0f, 3.0f), 0x00);
  EXPECT_EQ(nvfp4_block_scale(NAN, 1.0f), 0x7F);
  EXPECT_EQ(nvfp4_block_scale(INFINITY, 1.0f), 0x7E);
  // NaN-propagating absolute maximum.
  const float v[4] = {1.0f, -3.0f, NAN, INFINITY};
  EXPECT_EQ(abs_max(v, 2), 3.0f);
  EXPECT_EQ(abs_max(v + 1, 3, 1) != abs_max(v + 1, 3, 1), true);  // NaN
  EXPECT_EQ(abs_max(v + 3, 1), INFINITY);
  EXPECT_EQ(abs_max(v, 0), 0.0f);
}

// Known answers of Philox4x32-10 from the Random123 distribution (kat_vectors).
TEST(QuantizeRef, PhiloxKnownAnswers) {
  struct Kat {
    uint32_t ctr[4], key[2], out[4];
  };
  const Kat kats[] = {
      {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
      {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff},
       {0xffffffff, 0xffffffff},
       {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
      {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344},
       {0xa4093822, 0x299f31d0},
       {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
  };
  for (const Kat& k : kats) {
    uint32_t out[4];
    philox4x32_10(k.ctr, k.key, out);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(out[i], k.out[i]);
  }
  // The element stream: word index % 4 of the call at index / 4; copies and offsets differ.
  const uint32_t ctr[4] = {1, 0, 5, 0}, key[2] = {9, 0};
  uint32_t out[4];
  philox4x32_10(ctr, key, out);
  EXPECT_EQ(sr_random_bits(9, 5, 0, 6), out[2]);
  EXPECT_NE(sr_random_bits(9, 5, 1, 6), out[2]);
  EXPECT_NE(sr_random_bits(9, 6, 0, 6), out[2]);
}

TEST(QuantizeRef, ScaleShapesAndLayouts) {
  QuantConfig c = config(QuantFormat::kFP8Block);
  ScaleShape s = scale_shape(c, 5, 200);
  EXPECT_EQ(s.rows, 5);
  EXPECT_EQ(s.cols, 2);
  EXPECT_EQ(s.dtype, DType::kFP32);
  c.scale_layout = ScaleLayout::kMNMajor;
  s = scale_shape(c, 5, 200);
  EXPECT_EQ(s.rows, 2);
  EXPECT_EQ(s.cols, 8);
  EXPECT_EQ(scale_index(c.scale_layout, 3, 1, 5, 2), 1 * 8 + 3);
  c = config(QuantFormat::kFP8Block, QuantBlocking::k2D);
  s = scale_shape(c, 300, 129);
  EXPECT_EQ(s.rows, 3);
  EXPECT_EQ(s.cols, 2);
  c = config(QuantFormat::kMXFP8);
  c.scale_layout = ScaleLayout::kSwizzled128x4;
  s = scale_shape(c, 130, 32 * 5);
  EXPECT_EQ(s.rows, 256);
  EXPECT_EQ(s.cols, 8);
  EXPECT_EQ(s.dtype, DType::kE8M0);
  // Hand-computed offsets of the 128x4 tiles (512 bytes: row r % 32 at 16 bytes, r / 32 % 4 at
  // 4 bytes, the column within the tile at 1 byte; tiles row-major over [rows/128, cols/4]).
  EXPECT_EQ(scale_index(c.scale_layout, 0, 0, 130, 5), 0);
  EXPECT_EQ(scale_index(c.scale_layout, 1, 0, 130, 5), 16);
  EXPECT_EQ(scale_index(c.scale_layout, 32, 0, 130, 5), 4);
  EXPECT_EQ(scale_index(c.scale_layout, 0, 3, 130, 5), 3);
  EXPECT_EQ(scale_index(c.scale_layout, 0, 4, 130, 5), 512);
  EXPECT_EQ(scale_index(c.scale_layout, 129, 4, 130, 5), 3 * 512 + 16);
  // A bijection onto the padded storage.
  std::set<int64_t> seen;
  for (int64_t r = 0; r < 256; ++r)
    for (int64_t j = 0; j < 8; ++j) seen.insert(scale_index(c.scale_layout, r, j, 256, 8));
  EXPECT_EQ(seen.size(), 256u * 8u);
  EXPECT_EQ(*seen.rbegin(), 256 * 8 - 1);
  // A columnwise layout of its own applies to the columnwise copy only.
  c = config(QuantFormat::kFP8Block);
  c.columnwise_scale_layout = ScaleLayout::kMNMajor;
  s = scale_shape(c, 5, 200);
  EXPECT_EQ(s.rows, 5);
  EXPECT_EQ(s.cols, 2);
  s = scale_shape(c, 5, 200, /*columnwise=*/true);
  EXPECT_EQ(s.rows, 2);
  EXPECT_EQ(s.cols, 8);
  EXPECT_EQ(copy_scale_layout(c, false), ScaleLayout::kRowMajor);
  EXPECT_EQ(copy_scale_layout(c, true), ScaleLayout::kMNMajor);
  c = config(QuantFormat::kNVFP4, QuantBlocking::k2D);
  s = scale_shape(c, 32, 48);
  EXPECT_EQ(s.rows, 2);
  EXPECT_EQ(s.cols, 3);
  EXPECT_EQ(s.dtype, DType::kFP8E4M3);
}

TEST(QuantizeRef, BadConfigNamesTheOption) {
  QuantConfig c = config(QuantFormat::kMXFP8, QuantBlocking::k2D);
  expect_error_naming([&] { validate_quant_config(c); }, "config.blocking");
  c = config(QuantFormat::kFP8Block);
  c.scale_layout = ScaleLayout::kSwizzled128x4;
  expect_error_naming([&] { validate_quant_config(c); }, "config.scale_layout");
  c = config(QuantFormat::kMXFP8);
  c.scale_layout = ScaleLayout::kMNMajor;
  expect_error_naming([&] { validate_quant_config(c); }, "config.scale_layout");
  c = config(QuantFormat::kFP8Block, QuantBlocking::k2D);
  c.columnwise_scale_layout = ScaleLayout::kMNMajor;
  expect_error_naming([&] { validate_quant_config(c); }, "config.columnwise_scale_layout");
  c = config(QuantFormat::kMXFP8);
  c.pow2_scale = true;
  expect_error_naming([&] { validate_quant_config(c); }, "config.pow2_scale");
  c = config(QuantFormat::kFP8Block);
  c.stochastic_rounding = true;
  expect_error_naming([&] { validate_quant_config(c); }, "config.stochastic_rounding");
  c = config(QuantFormat::kNVFP4, QuantBlocking::k1D, false, false);
  expect_error_naming([&] { validate_quant_config(c); }, "rowwise and/or columnwise");
}

// FP8 block, one row of 200 (a full 1x128 block and a partial one of 72), hand-computed.
TEST(QuantizeRef, FP8BlockHandCase) {
  std::vector<float> row(200, 0.0f);
  row[0] = 2.0f;      // amax of block 0: scale 224, scale_inv 1/224
  row[1] = -1.0f;     // -224 -> e4m3 -224 (1.75 * 2^7): 0xF6
  row[2] = 0.001f;    // 0.224 (bf16 of 0.001 is 0.00099945) -> rounds in e4m3
  row[150] = 448.0f;  // block 1: amax 448, scale 1
  row[151] = 0.5f;
  QuantConfig c = config(QuantFormat::kFP8Block, QuantBlocking::k1D, true, false);
  const Quantized q = quantize(c, to_bf16(row), 1, 1, 200);
  ASSERT_EQ(q.rowwise_scale.size(), 8u);
  EXPECT_EQ(scale_inv_at(q.rowwise_scale, 0), 1.0f / 224.0f);
  EXPECT_EQ(scale_inv_at(q.rowwise_scale, 1), 1.0f);
  EXPECT_EQ(q.rowwise_data[0], 0x7E);
  EXPECT_EQ(q.rowwise_data[1], 0xF6);
  EXPECT_EQ(q.rowwise_data[2], e4m3_from_double(bf16_bits_to_float(float_to_bf16_bits(0.001f)) * 224.0f));
  EXPECT_EQ(q.rowwise_data[3], 0x00);
  EXPECT_EQ(q.rowwise_data[150], 0x7E);
  EXPECT_EQ(q.rowwise_data[151], 0x30);  // 0.5: E = 6, M = 0
  const std::vector<float> d = dequantize(c, q, false, 1, 1, 200);
  EXPECT_EQ(d[0], 448.0f * (1.0f / 224.0f));
  EXPECT_EQ(d[150], 448.0f);
  EXPECT_EQ(d[151], 0.5f);
}

// Edge blocks: amax 0, inf, NaN in each format.
TEST(QuantizeRef, EdgeBlocks) {
  const int64_t K = 128;
  std::vector<float> x(4 * K, 0.0f);
  x[1 * K + 0] = INFINITY;  // row 1: an inf
  x[1 * K + 1] = 3.0f;
  x[2 * K + 5] = NAN;       // row 2: a NaN
  x[2 * K + 6] = -2.0f;
  x[3 * K + 7] = std::ldexp(1.0f, -130);  // row 3: a subnormal only (bf16 keeps it)
  const auto xb = to_bf16(x);
  {
    QuantConfig c = config(QuantFormat::kFP8Block, QuantBlocking::k1D, true, false);
    const Quantized q = quantize(c, xb, 1, 4, K);
    EXPECT_EQ(scale_inv_at(q.rowwise_scale, 0), 1.0f);  // amax 0 -> scale 1
    EXPECT_EQ(q.rowwise_data[0], 0);
    EXPECT_EQ(scale_inv_at(q.rowwise_scale, 1), 1.0f);  // inf -> scale 1
    EXPECT_EQ(q.rowwise_data[K + 0], 0x7E);             // inf saturates
    EXPECT_EQ(q.rowwise_data[K + 1], e4m3_from_double(3.0));
    EXPECT_EQ(scale_inv_at(q.rowwise_scale, 2), 1.0f);  // NaN -> scale 1
    EXPECT_EQ(q.rowwise_data[2 * K + 5], 0x7F);
    EXPECT_EQ(q.rowwise_data[2 * K + 6], e4m3_from_double(-2.0));
    // The subnormal amax: 448 / 2^-130 = 1.75 * 2^138 overflows -> FLT_MAX.
    EXPECT_EQ(scale_inv_at(q.rowwise_scale, 3), 1.0f / FLT_MAX);
    EXPECT_EQ(q.rowwise_data[3 * K + 7], e4m3_from_double(static_cast<double>(std::ldexp(1.0f, -130) * FLT_MAX)));
  }
  {
    QuantConfig c = config(QuantFormat::kMXFP8, QuantBlocking::k1D, true, false);
    const Quantized q = quantize(c, xb, 1, 4, K);
    EXPECT_EQ(q.rowwise_scale[0 * 4], 0);    // amax 0
    EXPECT_EQ(q.rowwise_scale[1 * 4], 254);  // inf
    EXPECT_EQ(q.rowwise_data[K + 0], 0x7E);
    EXPECT_EQ(q.rowwise_data[K + 1], 0x00);  // 3 * 2^-127 -> 0
    EXPECT_EQ(q.rowwise_scale[2 * 4], 255);  // NaN
    EXPECT_EQ(q.rowwise_data[2 * K + 5], 0x7F);
    EXPECT_EQ(q.rowwise_scale[2 * 4 + 1], 0);  // the other blocks of the row are unaffected
    const std::vector<float> d = dequantize(c, q, false, 1, 4, K);
    EXPECT_TRUE(std::isnan(d[2 * K + 6]));  // a NaN scale decodes its whole block to NaN
    EXPECT_EQ(d[2 * K + 40], 0.0f);
    EXPECT_EQ(d[3 * K + 7], std::ldexp(1.0f, -130));  // 2^-130 = 448 * 2^-139 -> e = 0, q = 2^-3: exact
  }
  {
    QuantConfig c = config(QuantFormat::kNVFP4, QuantBlocking::k1D, true, false);
    std::vector<float> y(2 * K, 0.0f);
    y[3] = 6.0f;
    y[4] = -1.0f;
    y[K + 16] = 1.5f;  // second row, block 1
    Quantized q = quantize(c, to_bf16(y), 1, 2, K);
    ASSERT_EQ(q.global_amax.size(), 1u);
    EXPECT_EQ(q.global_amax[0], 6.0f);
    const float S = 2688.0f / 6.0f;  // 448
    EXPECT_EQ(q.rowwise_scale[0], 0x7E);  // 6 * 448 / 6 = 448
    EXPECT_EQ(q.rowwise_scale[1], 0x00);  // an all-zero block
    EXPECT_EQ(nibble(q.rowwise_data, 3), 7);
    EXPECT_EQ(nibble(q.rowwise_data, 4), 0xA);  // -1
    // Row 1, block 1: 1.5 * 448 / 6 = 112 -> e4m3 112 (1.75 * 2^6), enc = 448 / 112 = 4: 6.
    EXPECT_EQ(q.rowwise_scale[8 + 1], e4m3_from_double(112.0));
    EXPECT_EQ(nibble(q.rowwise_data, K + 16), 7);
    const std::vector<float> d = dequantize(c, q, false, 1, 2, K);
    EXPECT_EQ(d[3], 6.0f);
    EXPECT_EQ(d[4], -1.0f);
    EXPECT_EQ(d[K + 16], 6.0f * (112.0f / S));
    // A NaN anywhere: global amax NaN -> S = 1; its block's scale is NaN.
    y[K + 100] = NAN;
    q = quantize(c, to_bf16(y), 1, 2, K);
    EXPECT_TRUE(std::isnan(q.global_amax[0]));
    EXPECT_EQ(q.rowwise_scale[8 + 6], 0x7F);
    EXPECT_EQ(q.rowwise_scale[0], e4m3_from_double(1.0));  // 6 * 1 / 6
    EXPECT_EQ(nibble(q.rowwise_data, K + 100), 0);
  }
}

// Values that are representable exactly round-trip exactly: E4M3 values times a power of two
// with a block amax of 448 * 2^k (FP8 with pow2 scales and MXFP8), E2M1 values times 2^k with
// block amax 6 * 2^k and global amax the same (NVFP4: S = 448 / 2^k, s = 448).
TEST(QuantizeRef, ExactRoundTrips) {
  std::mt19937_64 rng(3);
  const int64_t M = 64, K = 256;
  for (QuantFormat f : {QuantFormat::kFP8Block, QuantFormat::kMXFP8, QuantFormat::kNVFP4}) {
    const int64_t b = quant_block_size(f);
    std::vector<float> x(M * K);
    const int k = static_cast<int>(rng() % 20) - 10;
    for (int64_t i = 0; i < M * K; ++i) {
      double v;
      if (f == QuantFormat::kNVFP4)
        v = e2m1_to_double(static_cast<uint8_t>(rng() % 16));
      else
        v = e4m3_to_double(static_cast<uint8_t>(rng() % 256));
      if (std::isnan(v)) v = 0;
      x[i] = static_cast<float>(std::ldexp(v, k));
    }
    const double top = f == QuantFormat::kNVFP4 ? 6.0 : 448.0;
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < K; j += b) x[r * K + j] = static_cast<float>(std::ldexp(top, k));
    // Columnwise blocks run down the columns: make each column's block amax 448 * 2^k too.
    for (int64_t r = 0; r < M; r += b)
      for (int64_t j = 0; j < K; ++j) x[r * K + j] = static_cast<float>(std::ldexp(top, k));
    QuantConfig c = config(f);
    c.pow2_scale = f == QuantFormat::kFP8Block;
    const Quantized q = quantize(c, to_bf16(x), 1, M, K);
    const std::vector<float> row = dequantize(c, q, false, 1, M, K);
    const std::vector<float> col = dequantize(c, q, true, 1, M, K);
    for (int64_t r = 0; r < M; ++r)
      for (int64_t j = 0; j < K; ++j) {
        ASSERT_EQ(row[r * K + j], x[r * K + j]) << quant_format_name(f) << " " << r << "," << j;
        ASSERT_EQ(col[j * M + r], x[r * K + j]) << quant_format_name(f) << " " << r << "," << j;
      }
  }
}

// The error bound of each format on random data over many binades:
//   FP8 block, MXFP8: |x - deq| <= 2^-4 |x| + 2^-10 d   (half an E4M3 step: 3 mantissa bits, or
//                     half the subnormal step 2^-9, in units of the decode factor d)
//   NVFP4:            |x - deq| <= |x| / 4 + d / 4 + max(0, |x| - 6 d)   (half an E2M1 step is at
//                     most a quarter of the value above 1 and 0.25 below; beyond 6 it saturates)
// each plus 2^-20 |x| for the fp32 multiplies of the rule.
TEST(QuantizeRef, ErrorBound) {
  const int64_t B = 2, M = 96, K = 384;
  for (QuantFormat f : {QuantFormat::kFP8Block, QuantFormat::kMXFP8, QuantFormat::kNVFP4}) {
    for (QuantBlocking blk : {QuantBlocking::k1D, QuantBlocking::k2D}) {
      if (f == QuantFormat::kMXFP8 && blk == QuantBlocking::k2D) continue;
      const std::vector<uint16_t> xb = random_bf16(B * M * K, quant_block_size(f), 11);
      const QuantConfig c = config(f, blk);
      const Quantized q = quantize(c, xb, B, M, K);
      for (bool columnwise : {false, true}) {
        const std::vector<float> d = dequantize(c, q, columnwise, B, M, K);
        // The decode factor of each element: dequantize of a copy whose data are all ones.
        Quantized ones = q;
        std::vector<uint8_t>& data = columnwise ? ones.columnwise_data : ones.rowwise_data;
        std::fill(data.begin(), data.end(), f == QuantFormat::kNVFP4 ? 0x22 : 0x38);
        const std::vector<float> dec = dequantize(c, ones, columnwise, B, M, K);
        for (int64_t m = 0; m < B; ++m)
          for (int64_t r = 0; r < M; ++r)
            for (int64_t j = 0; j < K; ++j) {
              const double x = bf16_bits_to_float(xb[(m * M + r) * K + j]);
              const int64_t i = columnwise ? (m * K + j) * M + r : (m * M + r) * K + j;
              const double dd = dec[i], ax = std::fabs(x);
              const double bound = f == QuantFormat::kNVFP4
                                       ? ax / 4 + dd / 4 + std::max(0.0, ax - 6 * dd) + ax * 0x1p-20
                                       : ax / 16 + dd * 0x1p-10 + ax * 0x1p-20;
              ASSERT_LE(std::fabs(x - d[i]), bound)
                  << quant_format_name(f) << (blk == QuantBlocking::k2D ? " 2d" : " 1d")
                  << (columnwise ? " col " : " row ") << m << "," << r << "," << j << " x=" << x;
            }
      }
    }
  }
}

// A columnwise layout of its own changes where the columnwise scales sit and nothing else: the
// copies equal those of two single-layout quantizations.
TEST(QuantizeRef, EachCopyInItsOwnLayout) {
  const int64_t B = 2, M = 131, K = 264;
  const std::vector<uint16_t> xb = random_bf16(B * M * K, 16, 23);
  QuantConfig mixed = config(QuantFormat::kFP8Block);
  mixed.columnwise_scale_layout = ScaleLayout::kMNMajor;
  QuantConfig row = config(QuantFormat::kFP8Block), col = row;
  col.scale_layout = ScaleLayout::kMNMajor;
  const Quantized q = quantize(mixed, xb, B, M, K), qr = quantize(row, xb, B, M, K), qc = quantize(col, xb, B, M, K);
  EXPECT_EQ(q.rowwise_data, qr.rowwise_data);
  EXPECT_EQ(q.rowwise_scale, qr.rowwise_scale);
  EXPECT_EQ(q.columnwise_data, qc.columnwise_data);
  EXPECT_EQ(q.columnwise_scale, qc.columnwise_scale);
  EXPECT_NE(q.columnwise_scale, qr.columnwise_scale);  // the layouts differ at this shape
  EXPECT_EQ(dequantize(mixed, q, true, B, M, K), dequantize(col, qc, true, B, M, K));
}

// The columnwise copy is the rowwise quantization of x^T (1-D), the transpose of the rowwise
// copy (2-D); a batch quantizes like its matrices one by one.
TEST(QuantizeRef, CopiesAndBatches) {
  const int64_t B = 3, M = 64, K = 48;
  for (QuantFormat f : {QuantFormat::kFP8Block, QuantFormat::kMXFP8, QuantFormat::kNVFP4}) {
    for (QuantBlocking blk : {QuantBlocking::k1D, QuantBlocking::k2D}) {
      if (f == QuantFormat::kMXFP8 && blk == QuantBlocking::k2D) continue;
      QuantConfig c = config(f, blk);
      c.stochastic_rounding = f == QuantFormat::kNVFP4 && blk == QuantBlocking::k2D;
      c.seed = 5;
      const std::vector<uint16_t> xb = random_bf16(B * M * K, 16, 21);
      const Quantized q = quantize(c, xb, B, M, K);
      const int nb = f == QuantFormat::kNVFP4 ? 4 : 8;
      auto elem = [&](const std::vector<uint8_t>& data, int64_t i) -> int {
        return nb == 4 ? nibble(data, i) : data[i];
      };
      for (int64_t m = 0; m < B; ++m) {
        std::vector<uint16_t> xm(xb.begin() + m * M * K, xb.begin() + (m + 1) * M * K), xt(M * K);
        for (int64_t r = 0; r < M; ++r)
          for (int64_t j = 0; j < K; ++j) xt[j * M + r] = xm[r * K + j];
        QuantConfig one = c;
        one.columnwise = false;
        const Quantized qm = quantize(one, xm, 1, M, K);
        const int64_t bytes = static_cast<int64_t>(qm.rowwise_data.size());
        const int64_t sbytes = static_cast<int64_t>(qm.rowwise_scale.size());
        if (!c.stochastic_rounding) {  // SR bits depend on the position in the batch
          for (int64_t i = 0; i < bytes; ++i) ASSERT_EQ(q.rowwise_data[m * bytes + i], qm.rowwise_data[i]);
        }
        for (int64_t i = 0; i < sbytes; ++i) ASSERT_EQ(q.rowwise_scale[m * sbytes + i], qm.rowwise_scale[i]);
        if (blk == QuantBlocking::k1D) {
          const Quantized qt = quantize(one, xt, 1, K, M);
          for (int64_t i = 0; i < bytes; ++i) ASSERT_EQ(q.columnwise_data[m * bytes + i], qt.rowwise_data[i]);
          for (int64_t i = 0; i < static_cast<int64_t>(qt.rowwise_scale.size()); ++i)
            ASSERT_EQ(q.columnwise_scale[m * qt.rowwise_scale.size() + i], qt.rowwise_scale[i]);
        } else {
          for (int64_t r = 0; r < M; ++r)
            for (int64_t j = 0; j < K; ++j)
              ASSERT_EQ(elem(q.columnwise_data, (m * K + j) * M + r), elem(q.rowwise_data, (m * M + r) * K + j))
                  << quant_format_name(f) << " " << r << "," << j;
        }
      }
    }
  }
}

// Token operands quantized per expert group: groups that fill whole blocks give the whole
// tensor's MXFP8 blocks; NVFP4 has a global amax per group, so one group's values never move
// another group's codes; rows of no group are 0.
TEST(QuantizeRef, FakeQuantizeGroups) {
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t rows = 160, cols = 64;
  std::vector<float> x(rows * cols);
  for (float& v : x) v = bf16_bits_to_float(float_to_bf16_bits(nd(rng)));
  const std::vector<int64_t> aligned = {0, 64, 64, 128};  // rows 128.. belong to no group

  QuantConfig mx;
  mx.format = QuantFormat::kMXFP8;
  for (bool columnwise : {false, true}) {
    QuantConfig one = mx;
    one.rowwise = !columnwise;
    one.columnwise = columnwise;
    const std::vector<float> whole = dequantize(one, quantize_fp32(one, x, 1, rows, cols), columnwise, 1, rows, cols);
    const std::vector<float> grouped = fake_quantize_groups(mx, columnwise, x, rows, cols, aligned);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j) {
        const float w = r < 128 ? (columnwise ? whole[j * rows + r] : whole[r * cols + j]) : 0.0f;
        ASSERT_EQ(grouped[r * cols + j], w) << "columnwise " << columnwise << " row " << r;
      }
  }

  QuantConfig nv;
  nv.format = QuantFormat::kNVFP4;
  const std::vector<int64_t> ragged = {0, 37, 37, 101, 150};
  std::vector<float> loud = x;
  for (int64_t i = 37 * cols; i < 101 * cols; ++i) loud[i] *= 1024.0f;  // group 2 only
  for (bool columnwise : {false, true}) {
    const std::vector<float> a = fake_quantize_groups(nv, columnwise, x, rows, cols, ragged);
    const std::vector<float> b = fake_quantize_groups(nv, columnwise, loud, rows, cols, ragged);
    for (int64_t i = 0; i < rows * cols; ++i) {
      const int64_t r = i / cols;
      if (r >= 37 && r < 101)
        EXPECT_EQ(b[i], a[i] * 1024.0f) << "row " << r;  // a power-of-two scale moves S and amax alike
      else
        ASSERT_EQ(b[i], a[i]) << "columnwise " << columnwise << " row " << r;
      if (r >= 150) ASSERT_EQ(a[i], 0.0f);
    }
  }
  // The whole tensor under one global amax is a different quantization (the loud group's amax
  // would set every group's scale).
  QuantConfig one = nv;
  const std::vector<float> whole = dequantize(one, quantize_fp32(one, loud, 1, rows, cols), false, 1, rows, cols);
  const std::vector<float> grouped = fake_quantize_groups(nv, false, loud, rows, cols, {0, 37, 101, 160});
  int64_t differ = 0;
  for (int64_t i = 0; i < 37 * cols; ++i) differ += whole[i] != grouped[i];
  EXPECT_GT(differ, 0);
  expect_error_naming([&] { fake_quantize_groups(nv, false, x, rows, cols + 1, ragged); }, "x has");
}

}  // namespace
}  // namespace moe::ref
