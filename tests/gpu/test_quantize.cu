// GPU quantize / dequantize against the bitwise CPU reference (src/reference/quantize_ref.h):
// every format, 1-D and 2-D blocks, both copies, every scale layout, batches, shapes with partial
// blocks where the format allows them, edge values (0, inf, NaN, subnormals, +-448, ties), NVFP4
// stochastic rounding, NVFP4 blocks whose encode factor overflows, data at the least alignment,
// graph capture + replay with new data, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe/error.h"
#include "moe/float_convert.h"
#include "moe/quantize.h"
#include "reference/quantize_ref.h"
#include "support/expect_error.h"
#include "support/gpu.h"

namespace moe {
namespace {

using ::moe::testing::CapturedGraph;
using ::moe::testing::DeviceBuffer;
using ::moe::testing::expect_error_naming;

std::vector<uint16_t> make_input(int64_t n, int64_t K, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-12, 12);
  std::vector<uint16_t> x(n);
  float m = 1;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 16 == 0) m = std::ldexp(1.0f, mag(rng));
    x[i] = float_to_bf16_bits(nd(rng) * m);
  }
  // Edge values at fixed places (when the tensor is large enough): a zero row, an inf, a -inf, a
  // NaN (odd seeds), subnormals, +-448, values on E4M3 / E2M1 ties after scaling by 1.
  const float edges[] = {INFINITY, -INFINITY, NAN, std::ldexp(1.0f, -130), -std::ldexp(3.0f, -133), 448.0f,
                         -448.0f,  1.0625f,   0.25f, 2.5f, 5.0f, 1.1875f};
  // Odd seeds carry the non-finite values too (which set the NVFP4 global scale to 1).
  for (size_t e = seed % 2 ? 0 : 3; e < sizeof(edges) / sizeof(edges[0]); ++e) {
    const int64_t at = (static_cast<int64_t>(e) * 7919 + 3) * 17 % (n > 0 ? n : 1);
    if (n > 0) x[at] = float_to_bf16_bits(edges[e]);
  }
  if (n >= 2 * K)
    for (int64_t j = 0; j < K; ++j) x[K + j] = 0;  // row 1 all zero (amax 0)
  return x;
}

bool bits_equal_or_both_nan(float a, float b) {
  uint32_t x, y;
  std::memcpy(&x, &a, 4);
  std::memcpy(&y, &b, 4);
  return x == y || (std::isnan(a) && std::isnan(b));  // NaN payloads are not specified
}

TensorView view(void* p, DType t, int64_t B, int64_t r, int64_t c, bool batched) {
  return batched ? TensorView(p, t, {B, r, c}) : TensorView(p, t, {r, c});
}

// Device buffers of one quantized tensor sized like the reference's output. data_offset bytes
// before each copy's data (a pointer less aligned than an allocation) stay poisoned.
struct DeviceQuantized {
  int64_t offset;
  DeviceBuffer<uint8_t> rd, rs, cd, cs;
  DeviceBuffer<float> amax;
  QuantizedTensor q;
  DeviceQuantized(const QuantConfig& c, const ref::Quantized& h, int64_t B, int64_t M, int64_t K, bool batched,
                  int64_t data_offset = 0)
      : offset(data_offset), rd(h.rowwise_data.size() + data_offset), rs(h.rowwise_scale.size()),
        cd(h.columnwise_data.size() + data_offset), cs(h.columnwise_scale.size()),
        amax(c.format == QuantFormat::kNVFP4 ? B : 0) {
    const DType dt = c.format == QuantFormat::kNVFP4 ? DType::kFP4E2M1 : DType::kFP8E4M3;
    for (auto* b : {&rd, &rs, &cd, &cs}) b->fill_bytes(0xA5);  // poison: unwritten bytes show
    if (c.rowwise) {
      const ScaleShape s = scale_shape(c, M, K);
      q.rowwise_data = view(rd.get() + offset, dt, B, M, K, batched);
      q.rowwise_scale = view(rs.get(), s.dtype, B, s.rows, s.cols, batched);
    }
    if (c.columnwise) {
      const ScaleShape s = scale_shape(c, K, M, /*columnwise=*/true);
      q.columnwise_data = view(cd.get() + offset, dt, B, K, M, batched);
      q.columnwise_scale = view(cs.get(), s.dtype, B, s.rows, s.cols, batched);
    }
    if (c.format == QuantFormat::kNVFP4) q.global_amax = TensorView(amax.get(), DType::kFP32, {B});
  }
  void expect_equal(const ref::Quantized& h, const std::string& what) const {
    auto poisoned_then = [&](const std::vector<uint8_t>& data) {
      std::vector<uint8_t> v(static_cast<size_t>(offset), 0xA5);
      v.insert(v.end(), data.begin(), data.end());
      return v;
    };
    EXPECT_EQ(rd.download(), poisoned_then(h.rowwise_data)) << what << " rowwise data";
    EXPECT_EQ(rs.download(), h.rowwise_scale) << what << " rowwise scale";
    EXPECT_EQ(cd.download(), poisoned_then(h.columnwise_data)) << what << " columnwise data";
    EXPECT_EQ(cs.download(), h.columnwise_scale) << what << " columnwise scale";
    if (!h.global_amax.empty()) {
      const std::vector<float> a = amax.download();
      ASSERT_EQ(a.size(), h.global_amax.size());
      for (size_t i = 0; i < a.size(); ++i) {
        uint32_t x, y;
        std::memcpy(&x, &a[i], 4);
        std::memcpy(&y, &h.global_amax[i], 4);
        EXPECT_EQ(x, y) << what << " global amax " << i;
      }
    }
  }
};

// Dequantizes each copy of q to fp32 and bf16 (outputs poisoned first) and compares them with
// ref::dequantize of the reference's copies: bitwise, NaN payloads aside (a NaN stays a NaN).
void expect_dequantize_matches(const QuantConfig& c, const ref::Quantized& h, const QuantizedTensor& q, int64_t B,
                               int64_t M, int64_t K, bool batched, const std::string& what, cudaStream_t stream) {
  for (bool columnwise : {false, true}) {
    if (columnwise ? !c.columnwise : !c.rowwise) continue;
    const int64_t rows = columnwise ? K : M, cols = columnwise ? M : K;
    const std::vector<float> want = ref::dequantize(c, h, columnwise, B, M, K);
    DeviceBuffer<float> o32(want.size());
    DeviceBuffer<uint16_t> o16(want.size());
    o32.fill_bytes(0xFF);
    o16.fill_bytes(0xFF);
    dequantize(c, q, columnwise, view(o32.get(), DType::kFP32, B, rows, cols, batched), stream);
    dequantize(c, q, columnwise, view(o16.get(), DType::kBF16, B, rows, cols, batched), stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<float> got32 = o32.download();
    const std::vector<uint16_t> got16 = o16.download();
    for (size_t i = 0; i < want.size(); ++i) {
      ASSERT_TRUE(bits_equal_or_both_nan(got32[i], want[i]))
          << what << (columnwise ? " col" : " row") << " fp32 at " << i << ": " << got32[i] << " vs " << want[i];
      const bool nan16 = (got16[i] & 0x7FFF) > 0x7F80;
      ASSERT_TRUE(got16[i] == float_to_bf16_bits(want[i]) || (std::isnan(want[i]) && nan16))
          << what << (columnwise ? " col" : " row") << " bf16 at " << i;
    }
  }
}

struct Case {
  QuantConfig config;
  int64_t B, M, K;
  bool batched;
};

std::string describe(const Case& t) {
  const QuantConfig& c = t.config;
  std::string s = std::string(quant_format_name(c.format)) + (c.blocking == QuantBlocking::k2D ? " 2d" : " 1d") +
                  (c.rowwise ? " row" : "") + (c.columnwise ? " col" : "") + " layout " +
                  std::to_string(static_cast<int>(c.scale_layout)) +
                  (c.columnwise_scale_layout ? "/" + std::to_string(static_cast<int>(*c.columnwise_scale_layout)) : "") +
                  (c.pow2_scale ? " pow2" : "") +
                  (c.stochastic_rounding ? " sr" : "") + " [" + std::to_string(t.B) + "," + std::to_string(t.M) +
                  "," + std::to_string(t.K) + "]";
  return s;
}

std::vector<Case> cases() {
  std::vector<Case> out;
  auto add = [&](QuantFormat f, QuantBlocking blk, ScaleLayout layout, bool row, bool col, int64_t B, int64_t M,
                 int64_t K, bool batched, bool pow2 = false, bool sr = false) {
    Case t;
    t.config.format = f;
    t.config.blocking = blk;
    t.config.scale_layout = layout;
    t.config.rowwise = row;
    t.config.columnwise = col;
    t.config.pow2_scale = pow2;
    t.config.stochastic_rounding = sr;
    t.config.seed = 0x1234567890ABCDEFull;
    t.config.offset = 77;
    t.B = B;
    t.M = M;
    t.K = K;
    t.batched = batched;
    out.push_back(t);
  };
  using QF = QuantFormat;
  using QB = QuantBlocking;
  using SL = ScaleLayout;
  // FP8 block: K any multiple of 8 (partial 1x128 blocks), M any (partial 128x1 blocks).
  add(QF::kFP8Block, QB::k1D, SL::kRowMajor, true, true, 1, 256, 512, false);
  add(QF::kFP8Block, QB::k1D, SL::kRowMajor, true, true, 1, 200, 136, false, true);
  add(QF::kFP8Block, QB::k1D, SL::kMNMajor, true, true, 1, 131, 264, false);
  add(QF::kFP8Block, QB::k1D, SL::kRowMajor, true, false, 1, 7, 8, false);
  add(QF::kFP8Block, QB::k2D, SL::kRowMajor, true, true, 3, 300, 136, true);
  add(QF::kFP8Block, QB::k2D, SL::kRowMajor, true, true, 1, 256, 384, false, true);
  // MXFP8: K a multiple of 32; M a multiple of 32 for the columnwise copy.
  add(QF::kMXFP8, QB::k1D, SL::kRowMajor, true, true, 1, 96, 160, false);
  add(QF::kMXFP8, QB::k1D, SL::kSwizzled128x4, true, true, 2, 160, 288, true);
  add(QF::kMXFP8, QB::k1D, SL::kRowMajor, true, false, 1, 45, 64, false);
  // NVFP4: K a multiple of 16; M a multiple of 16 for the columnwise copy and 2-D blocks.
  add(QF::kNVFP4, QB::k1D, SL::kRowMajor, true, true, 1, 48, 80, false);
  add(QF::kNVFP4, QB::k1D, SL::kSwizzled128x4, true, true, 2, 144, 272, true);
  add(QF::kNVFP4, QB::k1D, SL::kRowMajor, true, false, 1, 33, 48, false);
  add(QF::kNVFP4, QB::k1D, SL::kRowMajor, true, true, 1, 160, 208, false, false, true);
  add(QF::kNVFP4, QB::k2D, SL::kRowMajor, true, true, 3, 64, 144, true);
  add(QF::kNVFP4, QB::k2D, SL::kRowMajor, true, true, 1, 160, 96, false, false, true);
  add(QF::kNVFP4, QB::k1D, SL::kRowMajor, false, true, 1, 32, 16, false);
  // Tails and loop structure of the kernels: rowwise-only 1-D calls (one lane group per block,
  // several tasks per lane, block counts per row that do not divide the grid's stride), tiles cut
  // by M and K, columnwise rows whose length is not a multiple of 16 (element-wise stores and
  // dequantize), a columnwise-only call, and tensors big enough for several loop trips.
  add(QF::kFP8Block, QB::k1D, SL::kRowMajor, true, false, 1, 3, 136, false);
  add(QF::kFP8Block, QB::k1D, SL::kMNMajor, true, false, 2, 37, 392, true, true);
  add(QF::kFP8Block, QB::k1D, SL::kRowMajor, true, false, 1, 4096, 1160, false);
  add(QF::kFP8Block, QB::k1D, SL::kRowMajor, true, true, 1, 17, 24, false);
  // One tile shorter than a columnwise run pair and narrower than the rowwise lanes of a block:
  // scales are stored by lanes whose own chunks lie outside x.
  add(QF::kFP8Block, QB::k1D, SL::kMNMajor, true, true, 1, 9, 40, false);
  add(QF::kFP8Block, QB::k1D, SL::kRowMajor, true, true, 2, 13, 16, true);
  add(QF::kFP8Block, QB::k1D, SL::kMNMajor, false, true, 2, 147, 40, true);
  add(QF::kFP8Block, QB::k1D, SL::kMNMajor, true, true, 1, 1040, 1160, false);
  // Each copy in its own layout (FP8 training: row-major rowwise scales, mn_major columnwise).
  add(QF::kFP8Block, QB::k1D, SL::kRowMajor, true, true, 1, 131, 264, false);
  out.back().config.columnwise_scale_layout = SL::kMNMajor;
  add(QF::kFP8Block, QB::k1D, SL::kRowMajor, true, true, 2, 1040, 392, true, true);
  out.back().config.columnwise_scale_layout = SL::kMNMajor;
  add(QF::kFP8Block, QB::k2D, SL::kRowMajor, true, true, 2, 129, 264, true);
  add(QF::kFP8Block, QB::k2D, SL::kRowMajor, false, true, 1, 5, 8, false);
  add(QF::kMXFP8, QB::k1D, SL::kSwizzled128x4, true, false, 3, 131, 96, true);
  add(QF::kMXFP8, QB::k1D, SL::kRowMajor, true, false, 1, 2048, 2080, false);
  add(QF::kMXFP8, QB::k1D, SL::kSwizzled128x4, true, true, 1, 64, 32, false);
  add(QF::kMXFP8, QB::k1D, SL::kRowMajor, false, true, 1, 288, 160, false);
  add(QF::kMXFP8, QB::k1D, SL::kSwizzled128x4, true, true, 1, 1056, 1312, false);
  add(QF::kNVFP4, QB::k1D, SL::kSwizzled128x4, true, false, 2, 5, 16, true);
  add(QF::kNVFP4, QB::k1D, SL::kRowMajor, true, false, 1, 2048, 4000, false);
  add(QF::kNVFP4, QB::k1D, SL::kRowMajor, true, false, 1, 37, 80, false, false, true);
  add(QF::kNVFP4, QB::k1D, SL::kSwizzled128x4, true, true, 1, 144, 48, false);
  add(QF::kNVFP4, QB::k1D, SL::kRowMajor, true, true, 1, 1040, 1168, false, false, true);
  add(QF::kNVFP4, QB::k2D, SL::kRowMajor, true, true, 2, 144, 272, true);
  add(QF::kNVFP4, QB::k2D, SL::kRowMajor, false, true, 1, 16, 16, false, false, true);
  return out;
}

TEST(Quantize, MatchesReferenceBitwise) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint64_t seed = 1;
  for (const Case& t : cases()) {
    const std::string what = describe(t);
    const std::vector<uint16_t> x = make_input(t.B * t.M * t.K, t.K, seed++);
    const ref::Quantized h = ref::quantize(t.config, x, t.B, t.M, t.K);
    DeviceBuffer<uint16_t> dx(x);
    DeviceQuantized d(t.config, h, t.B, t.M, t.K, t.batched);
    quantize(t.config, view(dx.get(), DType::kBF16, t.B, t.M, t.K, t.batched), d.q, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    d.expect_equal(h, what);
    // Dequantize each copy to fp32 and bf16 from the device copy.
    expect_dequantize_matches(t.config, h, d.q, t.B, t.M, t.K, t.batched, what, stream);
  }
  cudaStreamDestroy(stream);
}

// Quantized data at the least alignment the API accepts (8 bytes FP8, 4 bytes FP4), in both copies:
// the kernels fall back from their 16- and 8-byte vectors to narrower accesses there.
TEST(Quantize, DataAtTheLeastAlignment) {
  MOE_REQUIRE_GPU();
  struct Aligned {
    QuantFormat format;
    bool columnwise;
    int64_t M, K, offset;
  };
  for (const Aligned& t : {Aligned{QuantFormat::kFP8Block, false, 37, 272, 8},
                           Aligned{QuantFormat::kMXFP8, false, 33, 96, 8},
                           Aligned{QuantFormat::kNVFP4, false, 35, 208, 4},
                           Aligned{QuantFormat::kFP8Block, true, 40, 264, 8},
                           Aligned{QuantFormat::kMXFP8, true, 64, 96, 8},
                           Aligned{QuantFormat::kNVFP4, true, 48, 208, 4}}) {
    QuantConfig c;
    c.format = t.format;
    c.columnwise = t.columnwise;
    const std::string what = std::string(quant_format_name(c.format)) + (t.columnwise ? " row+col" : " row") +
                             " at offset " + std::to_string(t.offset);
    const std::vector<uint16_t> x = make_input(t.M * t.K, t.K, 5);
    const ref::Quantized h = ref::quantize(c, x, 1, t.M, t.K);
    DeviceBuffer<uint16_t> dx(x);
    DeviceQuantized d(c, h, 1, t.M, t.K, false, t.offset);
    quantize(c, TensorView(dx.get(), DType::kBF16, {t.M, t.K}), d.q, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    d.expect_equal(h, what);
    expect_dequantize_matches(c, h, d.q, 1, t.M, t.K, false, what, nullptr);
  }
}

// NVFP4 of a matrix whose amax is tiny (2^-108): the global scale 2688 / amax is about 2^119, and
// a block of amax 2^-126 gets the smallest E4M3 block scale, so its encode factor overflows to
// inf and its zeros multiply to NaN, which encodes as 0 (its non-zero values saturate to 6). Every
// kernel's encoder: rowwise only, both copies with 1-D blocks, 16 x 16 blocks.
TEST(Quantize, Nvfp4BlocksWithAnInfiniteFactor) {
  MOE_REQUIRE_GPU();
  const int64_t M = 32, K = 64;
  std::vector<uint16_t> x(M * K, 0);
  for (int64_t i = 0; i < 16; ++i) x[i * K + i] = float_to_bf16_bits(std::ldexp(i % 2 ? -1.0f : 1.0f, -126));
  x[20 * K + 40] = float_to_bf16_bits(std::ldexp(1.0f, -108));  // the global amax
  x[3 * K + 5] = 0x8000;                                        // -0 in a block with an infinite factor
  for (const QuantBlocking blocking : {QuantBlocking::k1D, QuantBlocking::k2D})
    for (const bool columnwise : {false, true}) {
      if (blocking == QuantBlocking::k2D && !columnwise) continue;
      QuantConfig c;
      c.format = QuantFormat::kNVFP4;
      c.blocking = blocking;
      c.columnwise = columnwise;
      const std::string what = std::string(blocking == QuantBlocking::k2D ? "16x16" : "1x16") +
                               (columnwise ? " row+col" : " row");
      const ref::Quantized h = ref::quantize(c, x, 1, M, K);
      DeviceBuffer<uint16_t> dx(x);
      DeviceQuantized d(c, h, 1, M, K, false);
      quantize(c, TensorView(dx.get(), DType::kBF16, {M, K}), d.q, nullptr);
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
      d.expect_equal(h, what);
    }
}

// fp32 x (FP8 block 128x128: master weights into FP8 weights): bitwise the reference on fp32
// values that bf16 cannot hold, over 2^-140 .. 2^120, with the fp32 edge values (NaN, +-inf, fp32
// subnormals, +-448, the largest finite) at fixed places; partial tiles, batches, single copies,
// power-of-two scales, M not a multiple of 16 (bytewise columnwise stores); graph replay.
TEST(Quantize, Fp32MasterWeightsMatchTheReference) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  uint64_t seed = 40;
  // x of fp32 values (one magnitude per stretch, so blocks of every range, or dense normal data:
  // every code of a tile non-zero, so the transpose is checked on all of them) with edge values;
  // eager and captured-then-replayed on new values, both bitwise the reference.
  auto check = [&](const QuantConfig& c, int64_t B, int64_t M, int64_t K, bool batched, bool dense) {
    const std::string what = describe(Case{c, B, M, K, batched}) + " fp32";
    const int64_t n = B * M * K;
    std::mt19937_64 rng(seed++);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    std::uniform_int_distribution<int> mag(-140, 120);
    std::vector<float> x(n);
    float m = 1;
    for (int64_t i = 0; i < n; ++i) {
      if (i % 4096 == 0 && !dense) m = std::ldexp(1.0f, mag(rng));
      x[i] = nd(rng) * m;
    }
    const float edges[] = {NAN, INFINITY, -INFINITY, std::ldexp(1.0f, -149), -std::ldexp(3.0f, -140), 448.0f, -448.0f,
                           3.4028235e38f, 1.00000012f, 0.0f};
    for (size_t e = 0; e < sizeof(edges) / sizeof(edges[0]); ++e)
      x[(static_cast<int64_t>(e) * 7919 + 11) * 131 % n] = edges[e];
    const ref::Quantized h = ref::quantize_fp32(c, x, B, M, K);
    DeviceBuffer<float> dx(x);
    DeviceQuantized d(c, h, B, M, K, batched);
    const TensorView vx = view(dx.get(), DType::kFP32, B, M, K, batched);
    quantize(c, vx, d.q, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    d.expect_equal(h, what);
    std::vector<float> x2(x);
    for (float& v : x2) v = -2.5f * v;
    const ref::Quantized h2 = ref::quantize_fp32(c, x2, B, M, K);
    const CapturedGraph graph(stream, [&] { quantize(c, vx, d.q, stream); });
    dx.upload(x2);
    graph.launch();
    d.expect_equal(h2, what + " replay");
  };
  // FP8 block 128x128 (the tile kernel), partial tiles and pow2 scales included.
  struct Fp32Case {
    int64_t B, M, K;
    bool batched, row, col, pow2;
  };
  const Fp32Case cases[] = {{3, 300, 136, true, true, true, false}, {1, 256, 384, false, true, false, false},
                            {1, 131, 264, false, false, true, true}, {2, 5, 8, true, true, true, false},
                            {1, 1040, 1160, false, true, true, false}, {2, 256, 256, true, true, true, false}};
  for (const Fp32Case& t : cases) {
    QuantConfig c;
    c.format = QuantFormat::kFP8Block;
    c.blocking = QuantBlocking::k2D;
    c.rowwise = t.row;
    c.columnwise = t.col;
    c.pow2_scale = t.pow2;
    check(c, t.B, t.M, t.K, t.batched, &t == &cases[sizeof(cases) / sizeof(cases[0]) - 1]);
  }
  // Every other format and blocking (the one-thread-per-block kernel): MXFP8 and NVFP4 master
  // weights, both copies, row-major and swizzled scales; FP8 1-D with partial blocks.
  auto config = [](QuantFormat f, QuantBlocking b, bool row, bool col, ScaleLayout layout) {
    QuantConfig c;
    c.format = f;
    c.blocking = b;
    c.rowwise = row;
    c.columnwise = col;
    c.scale_layout = layout;
    return c;
  };
  check(config(QuantFormat::kMXFP8, QuantBlocking::k1D, true, true, ScaleLayout::kRowMajor), 3, 96, 160, true, false);
  check(config(QuantFormat::kMXFP8, QuantBlocking::k1D, true, true, ScaleLayout::kSwizzled128x4), 1, 160, 96, false,
        true);
  check(config(QuantFormat::kNVFP4, QuantBlocking::k1D, true, true, ScaleLayout::kRowMajor), 2, 48, 80, true, false);
  check(config(QuantFormat::kNVFP4, QuantBlocking::k1D, true, false, ScaleLayout::kSwizzled128x4), 1, 37, 64, false,
        true);
  check(config(QuantFormat::kNVFP4, QuantBlocking::k2D, true, true, ScaleLayout::kRowMajor), 4, 64, 96, true, false);
  check(config(QuantFormat::kNVFP4, QuantBlocking::k2D, true, true, ScaleLayout::kRowMajor), 1, 256, 384, false, true);
  check(config(QuantFormat::kFP8Block, QuantBlocking::k1D, true, true, ScaleLayout::kRowMajor), 2, 131, 264, true,
        false);
  // Stochastic rounding takes bf16 (gradients); master weights round to nearest.
  QuantConfig sr = config(QuantFormat::kNVFP4, QuantBlocking::k1D, true, false, ScaleLayout::kRowMajor);
  sr.stochastic_rounding = true;
  DeviceBuffer<float> dx(64 * 64);
  DeviceBuffer<uint8_t> data(64 * 32), scale(64 * 4);
  DeviceBuffer<float> amax(1);
  QuantizedTensor q;
  q.rowwise_data = TensorView(data.get(), DType::kFP4E2M1, {64, 64});
  q.rowwise_scale = TensorView(scale.get(), DType::kFP8E4M3, {64, 4});
  q.global_amax = TensorView(amax.get(), DType::kFP32, {1});
  expect_error_naming([&] { quantize(sr, TensorView(dx.get(), DType::kFP32, {64, 64}), q, stream); },
                      "stochastic rounding takes bf16");
  MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

// Captured once, replayed on new data (and a new NVFP4 global amax): bitwise the reference of the
// new data, and equal to an eager call.
TEST(Quantize, GraphReplayWithNewData) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (QuantFormat f : {QuantFormat::kFP8Block, QuantFormat::kMXFP8, QuantFormat::kNVFP4}) {
    QuantConfig c;
    c.format = f;
    c.rowwise = c.columnwise = true;
    c.scale_layout = f == QuantFormat::kFP8Block ? ScaleLayout::kMNMajor : ScaleLayout::kSwizzled128x4;
    c.stochastic_rounding = f == QuantFormat::kNVFP4;
    c.seed = 99;
    const int64_t M = 160, K = 256;
    const std::vector<uint16_t> x1 = make_input(M * K, K, 5), x2 = make_input(M * K, K, 6);
    const ref::Quantized h1 = ref::quantize(c, x1, 1, M, K), h2 = ref::quantize(c, x2, 1, M, K);
    DeviceBuffer<uint16_t> dx(x1);
    DeviceQuantized d(c, h1, 1, M, K, false);
    const TensorView vx(dx.get(), DType::kBF16, {M, K});
    const CapturedGraph graph(stream, [&] { quantize(c, vx, d.q, stream); });
    graph.launch();
    d.expect_equal(h1, std::string(quant_format_name(f)) + " replay 1");
    dx.upload(x2);
    graph.launch();
    d.expect_equal(h2, std::string(quant_format_name(f)) + " replay 2");
    // Twice in a row (the global amax is re-zeroed inside the graph).
    graph.launch();
    d.expect_equal(h2, std::string(quant_format_name(f)) + " replay 3");
  }
  cudaStreamDestroy(stream);
}

TEST(Quantize, ZeroSizeIsValid) {
  MOE_REQUIRE_GPU();
  for (QuantFormat f : {QuantFormat::kFP8Block, QuantFormat::kMXFP8, QuantFormat::kNVFP4}) {
    QuantConfig c;
    c.format = f;
    c.columnwise = true;
    const ref::Quantized h = ref::quantize(c, {}, 1, 0, 64);
    DeviceBuffer<uint16_t> dx(16);
    DeviceQuantized d(c, h, 1, 0, 64, false);
    quantize(c, TensorView(dx.get(), DType::kBF16, {0, 64}), d.q, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    d.expect_equal(h, quant_format_name(f));
  }
}

// Every kind of empty tensor (no rows, no columns, no matrices): valid, nothing written but the
// NVFP4 global amax (0); dequantize of the empty copies is a no-op.
TEST(Quantize, EmptyShapesAreValid) {
  MOE_REQUIRE_GPU();
  const struct {
    int64_t B, M, K;
    bool batched;
  } shapes[] = {{1, 64, 0, false}, {1, 0, 0, false}, {0, 32, 64, true}, {3, 0, 32, true}, {2, 64, 0, true}};
  for (QuantFormat f : {QuantFormat::kFP8Block, QuantFormat::kMXFP8, QuantFormat::kNVFP4}) {
    for (bool two_d : {false, true}) {
      if (two_d && f == QuantFormat::kMXFP8) continue;
      for (const auto& s : shapes) {
        QuantConfig c;
        c.format = f;
        c.blocking = two_d ? QuantBlocking::k2D : QuantBlocking::k1D;
        c.columnwise = true;
        const std::string what = std::string(quant_format_name(f)) + (two_d ? " 2d [" : " 1d [") +
                                 std::to_string(s.B) + "," + std::to_string(s.M) + "," + std::to_string(s.K) + "]";
        const ref::Quantized h = ref::quantize(c, {}, s.B, s.M, s.K);
        DeviceBuffer<uint16_t> dx(16);
        DeviceQuantized d(c, h, s.B, s.M, s.K, s.batched);
        if (f == QuantFormat::kNVFP4) d.amax.fill_bytes(0xA5);  // must be overwritten with 0
        quantize(c, view(dx.get(), DType::kBF16, s.B, s.M, s.K, s.batched), d.q, nullptr);
        MOE_CUDA_CHECK(cudaDeviceSynchronize());
        d.expect_equal(h, what);
        DeviceBuffer<float> out(16);
        dequantize(c, d.q, false, view(out.get(), DType::kFP32, s.B, s.M, s.K, s.batched), nullptr);
        dequantize(c, d.q, true, view(out.get(), DType::kFP32, s.B, s.K, s.M, s.batched), nullptr);
        MOE_CUDA_CHECK(cudaDeviceSynchronize());
      }
    }
  }
}

TEST(Quantize, BadInputNamesTheArgument) {
  MOE_REQUIRE_GPU();
  const int64_t M = 64, K = 128;
  DeviceBuffer<uint16_t> dx(M * K);
  DeviceBuffer<uint8_t> data(M * K), scale(4 * M * K);
  DeviceBuffer<float> amax(1);
  QuantConfig c;
  c.format = QuantFormat::kMXFP8;
  const ScaleShape s = scale_shape(c, M, K);
  QuantizedTensor q;
  q.rowwise_data = TensorView(data.get(), DType::kFP8E4M3, {M, K});
  q.rowwise_scale = TensorView(scale.get(), DType::kE8M0, {s.rows, s.cols});
  const TensorView x(dx.get(), DType::kBF16, {M, K});
  // bf16 and fp32 (master weights) are the accepted inputs.
  expect_error_naming([&] { quantize(c, TensorView(dx.get(), DType::kFP8E4M3, {M, K}), q, nullptr); }, "'x'");
  expect_error_naming([&] { quantize(c, TensorView(dx.get(), DType::kBF16, {M, 48}), q, nullptr); }, "'x'");
  expect_error_naming([&] { quantize(c, TensorView(dx.get(), DType::kBF16, {M, K}, Device::kCPU), q, nullptr); }, "'x'");
  QuantizedTensor bad = q;
  bad.rowwise_scale = TensorView(scale.get(), DType::kE8M0, {s.rows, s.cols + 1});
  expect_error_naming([&] { quantize(c, x, bad, nullptr); }, "'out.rowwise_scale'");
  bad = q;
  bad.rowwise_data = TensorView(data.get(), DType::kFP4E2M1, {M, K});
  expect_error_naming([&] { quantize(c, x, bad, nullptr); }, "'out.rowwise_data'");
  QuantConfig col = c;
  col.columnwise = true;
  expect_error_naming([&] { quantize(col, TensorView(dx.get(), DType::kBF16, {40, K}), q, nullptr); }, "'x'");
  expect_error_naming([&] { quantize(col, x, q, nullptr); }, "'out.columnwise_data'");
  QuantConfig nv;
  nv.format = QuantFormat::kNVFP4;
  const ScaleShape ns = scale_shape(nv, M, K);
  QuantizedTensor qn;
  qn.rowwise_data = TensorView(data.get(), DType::kFP4E2M1, {M, K});
  qn.rowwise_scale = TensorView(scale.get(), DType::kFP8E4M3, {ns.rows, ns.cols});
  expect_error_naming([&] { quantize(nv, x, qn, nullptr); }, "'out.global_amax'");
  qn.global_amax = TensorView(amax.get(), DType::kFP32, {1});
  expect_error_naming([&] { quantize(nv, TensorView(dx.get(), DType::kBF16, {M, 24}), qn, nullptr); }, "'x'");
  QuantConfig sr = nv;
  sr.stochastic_rounding = true;
  expect_error_naming([&] { quantize(sr, TensorView(dx.get(), DType::kFP32, {M, K}), qn, nullptr); }, "'x'");
  DeviceBuffer<float> out(M * K);
  expect_error_naming([&] { dequantize(nv, qn, true, TensorView(out.get(), DType::kFP32, {K, M}), nullptr); },
                      "'columnwise'");
  expect_error_naming([&] { dequantize(nv, qn, false, TensorView(out.get(), DType::kFP16, {M, K}), nullptr); },
                      "'out'");
  expect_error_naming([&] { dequantize(nv, qn, false, TensorView(out.get(), DType::kFP32, {M, K + 16}), nullptr); },
                      "'out'");
  QuantConfig bad_cfg = c;
  bad_cfg.blocking = QuantBlocking::k2D;
  expect_error_naming([&] { quantize(bad_cfg, x, q, nullptr); }, "config.blocking");
}

}  // namespace
}  // namespace moe
