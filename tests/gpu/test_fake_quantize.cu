// GPU quantize-dequantize of token operands in expert groups (quant/fake_quantize.h) against the
// bitwise CPU reference (ref::fake_quantize_groups) and against moe::quantize + moe::dequantize of
// each group: every format, rowwise and columnwise, ragged groups (empty, one row, partial last
// blocks, rows past the last group), edge values, NVFP4 blocks whose encode factor overflows, in
// place, graph replay with new groups, errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moe/float_convert.h"
#include "moe/quantize.h"
#include "quant/fake_quantize.h"
#include "reference/quantize_ref.h"
#include "support/expect_error.h"
#include "support/gpu.h"

namespace moe {
namespace {

using ::moe::testing::CapturedGraph;
using ::moe::testing::DeviceBuffer;
using ::moe::testing::expect_error_naming;

class FakeQuantize : public ::moe::testing::StreamTest {};

// bf16 values over a wide range of magnitudes (a new magnitude every 8 elements, so blocks see
// different scales), with edge values: zeros, +-inf, NaN, subnormals, +-448 and ties.
std::vector<uint16_t> make_values(int64_t n, uint64_t seed, bool non_finite) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-10, 10);
  std::vector<uint16_t> x(n);
  float m = 1;
  for (int64_t i = 0; i < n; ++i) {
    if (i % 8 == 0) m = std::ldexp(1.0f, mag(rng));
    x[i] = float_to_bf16_bits(nd(rng) * m);
  }
  const float edges[] = {0.0f, -0.0f, std::ldexp(1.0f, -130), 448.0f, -448.0f, 1.0625f, 2.5f, 5.0f,
                         INFINITY, -INFINITY, NAN};
  const size_t count = sizeof(edges) / sizeof(edges[0]) - (non_finite ? 0 : 3);
  for (size_t e = 0; e < count && n > 0; ++e) x[(static_cast<int64_t>(e) * 7919 + 5) % n] = float_to_bf16_bits(edges[e]);
  return x;
}

std::vector<float> to_float(const std::vector<uint16_t>& x) {
  std::vector<float> f(x.size());
  for (size_t i = 0; i < x.size(); ++i) f[i] = bf16_bits_to_float(x[i]);
  return f;
}

struct Case {
  QuantFormat format;
  bool columnwise;
};

std::string name(const Case& c) {
  return std::string(quant_format_name(c.format)) + (c.columnwise ? " columnwise" : " rowwise");
}

const Case kCases[] = {{QuantFormat::kFP8Block, false}, {QuantFormat::kFP8Block, true},
                       {QuantFormat::kMXFP8, false},    {QuantFormat::kMXFP8, true},
                       {QuantFormat::kNVFP4, false},    {QuantFormat::kNVFP4, true}};

// Runs the kernel on x with the offsets; returns the output (rows outside the groups as `fill`).
std::vector<uint16_t> run(const QuantConfig& c, bool columnwise, const std::vector<uint16_t>& x, int64_t rows,
                          int64_t cols, const std::vector<int32_t>& offsets, bool in_place, cudaStream_t s) {
  DeviceBuffer<uint16_t> dx(x), dout(in_place ? 0 : x.size());
  DeviceBuffer<int32_t> dg(offsets);
  DeviceBuffer<uint8_t> ws(quant::fake_quantize_workspace_bytes(static_cast<int>(offsets.size()) - 1));
  uint16_t* out = in_place ? dx.get() : dout.get();
  if (!in_place) MOE_CUDA_CHECK(cudaMemset(out, 0, x.size() * 2));
  quant::fake_quantize_groups(c, columnwise, TensorView(dx.get(), DType::kBF16, {rows, cols}),
                              TensorView(dg.get(), DType::kInt32, {static_cast<int64_t>(offsets.size())}),
                              TensorView(out, DType::kBF16, {rows, cols}), ws.get(), s);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  std::vector<uint16_t> got(x.size());
  MOE_CUDA_CHECK(cudaMemcpy(got.data(), out, x.size() * 2, cudaMemcpyDeviceToHost));
  return got;
}

bool is_nan(uint16_t b) { return (b & 0x7FFF) > 0x7F80; }
// The same bf16 bits, or NaN on both sides (the device's arithmetic returns its canonical NaN,
// the host's keeps the payload).
bool same(uint16_t a, uint16_t b) { return a == b || (is_nan(a) && is_nan(b)); }

// Bitwise on the rows of the groups.
void expect_equal_in_groups(const std::vector<uint16_t>& got, const std::vector<float>& want, int64_t cols,
                            const std::vector<int32_t>& offsets, const std::string& what) {
  int64_t bad = 0;
  for (int64_t r = offsets.front(); r < offsets.back(); ++r)
    for (int64_t j = 0; j < cols; ++j) {
      const uint16_t w = float_to_bf16_bits(want[r * cols + j]);
      if (!same(got[r * cols + j], w) && bad++ < 5)
        ADD_FAILURE() << what << ": row " << r << " col " << j << " got 0x" << std::hex << got[r * cols + j]
                      << " want 0x" << w;
    }
  EXPECT_EQ(bad, 0) << what;
}

TEST_F(FakeQuantize, MatchesTheReferenceBitwise) {
  // Groups: 37 rows (partial blocks of every size), empty, 1 row, 128, 16, 300; then 23 rows past
  // the last group, which are not written.
  const std::vector<int32_t> offsets = {0, 37, 37, 38, 166, 182, 482};
  const int64_t rows = 505, cols = 256;
  for (uint64_t seed : {1, 2}) {
    const std::vector<uint16_t> x = make_values(rows * cols, seed, seed == 2);
    const std::vector<int64_t> off64(offsets.begin(), offsets.end());
    for (const Case& k : kCases) {
      QuantConfig c;
      c.format = k.format;
      const std::vector<float> want = ref::fake_quantize_groups(c, k.columnwise, to_float(x), rows, cols, off64);
      const std::string what = name(k) + " seed " + std::to_string(seed);
      expect_equal_in_groups(run(c, k.columnwise, x, rows, cols, offsets, false, stream), want, cols, offsets, what);
      expect_equal_in_groups(run(c, k.columnwise, x, rows, cols, offsets, true, stream), want, cols, offsets,
                             what + " in place");
    }
  }
}

// NVFP4 groups whose amax is tiny (2^-108): a block of amax 2^-126 gets an infinite encode factor
// and its zeros multiply to NaN, which encode as 0 (the encoder's NaN test cannot be skipped).
TEST_F(FakeQuantize, Nvfp4BlocksWithAnInfiniteFactor) {
  const int64_t rows = 48, cols = 64;
  const std::vector<int32_t> offsets = {0, 20, 48};
  std::vector<uint16_t> x(rows * cols, 0);
  for (int64_t i = 0; i < 16; ++i) {
    x[i * cols + i] = float_to_bf16_bits(std::ldexp(i % 2 ? -1.0f : 1.0f, -126));
    x[(24 + i) * cols + 2 * i] = float_to_bf16_bits(std::ldexp(1.0f, -126));
  }
  x[5 * cols + 40] = float_to_bf16_bits(std::ldexp(1.0f, -108));   // group 0's amax
  x[30 * cols + 50] = float_to_bf16_bits(std::ldexp(-1.0f, -108));  // group 1's amax
  x[3 * cols + 5] = 0x8000;                                         // -0
  const std::vector<int64_t> off64(offsets.begin(), offsets.end());
  QuantConfig c;
  c.format = QuantFormat::kNVFP4;
  for (const bool columnwise : {false, true}) {
    const std::vector<float> want = ref::fake_quantize_groups(c, columnwise, to_float(x), rows, cols, off64);
    expect_equal_in_groups(run(c, columnwise, x, rows, cols, offsets, false, stream), want, cols, offsets,
                           columnwise ? "columnwise" : "rowwise");
  }
}

// Groups that fill whole blocks: each group is bitwise moe::quantize + moe::dequantize of its rows
// as a matrix (the emulated layer's values are the codes a Blackwell GEMM would read).
TEST_F(FakeQuantize, EqualsQuantizeThenDequantizeOfEachGroup) {
  const std::vector<int32_t> offsets = {0, 64, 64, 192, 256};
  const int64_t rows = 256, cols = 128;
  const std::vector<uint16_t> x = make_values(rows * cols, 3, false);
  for (const Case& k : kCases) {
    if (k.format == QuantFormat::kFP8Block && k.columnwise) continue;  // 128x1 blocks: groups of 64 are partial
    QuantConfig c;
    c.format = k.format;
    const std::vector<uint16_t> got = run(c, k.columnwise, x, rows, cols, offsets, false, stream);
    for (size_t e = 0; e + 1 < offsets.size(); ++e) {
      const int64_t r0 = offsets[e], n = offsets[e + 1] - offsets[e];
      if (n == 0) continue;
      QuantConfig q = c;
      q.rowwise = !k.columnwise;
      q.columnwise = k.columnwise;
      const ScaleShape ss = scale_shape(q, k.columnwise ? cols : n, k.columnwise ? n : cols, k.columnwise);
      const int64_t data_bytes = k.format == QuantFormat::kNVFP4 ? n * cols / 2 : n * cols;
      const int64_t scale_bytes = ss.rows * ss.cols * (k.format == QuantFormat::kFP8Block ? 4 : 1);
      DeviceBuffer<uint16_t> dx(std::vector<uint16_t>(x.begin() + r0 * cols, x.begin() + (r0 + n) * cols));
      DeviceBuffer<uint8_t> data(data_bytes), scale(scale_bytes);
      DeviceBuffer<float> amax(1);
      DeviceBuffer<uint16_t> deq(n * cols);
      QuantizedTensor t;
      const DType dt = k.format == QuantFormat::kNVFP4 ? DType::kFP4E2M1 : DType::kFP8E4M3;
      TensorView& d = k.columnwise ? t.columnwise_data : t.rowwise_data;
      TensorView& sc = k.columnwise ? t.columnwise_scale : t.rowwise_scale;
      d = k.columnwise ? TensorView(data.get(), dt, {cols, n}) : TensorView(data.get(), dt, {n, cols});
      sc = TensorView(scale.get(), ss.dtype, {ss.rows, ss.cols});
      if (k.format == QuantFormat::kNVFP4) t.global_amax = TensorView(amax.get(), DType::kFP32, {1});
      quantize(q, TensorView(dx.get(), DType::kBF16, {n, cols}), t, stream);
      const TensorView out = k.columnwise ? TensorView(deq.get(), DType::kBF16, {cols, n})
                                          : TensorView(deq.get(), DType::kBF16, {n, cols});
      dequantize(q, t, k.columnwise, out, stream);
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<uint16_t> want = deq.download();
      int64_t bad = 0;
      for (int64_t r = 0; r < n; ++r)
        for (int64_t j = 0; j < cols; ++j) {
          const uint16_t w = k.columnwise ? want[j * n + r] : want[r * cols + j];
          bad += !same(got[(r0 + r) * cols + j], w);
        }
      EXPECT_EQ(bad, 0) << name(k) << " group " << e;
    }
  }
}

TEST_F(FakeQuantize, GraphReplayWithNewGroupsAndData) {
  const int64_t rows = 192, cols = 128;  // whole 1x128 blocks for fp8_block rowwise
  const int E = 3;
  DeviceBuffer<uint16_t> dx(rows * cols), dout(rows * cols);
  DeviceBuffer<int32_t> dg(E + 1);
  DeviceBuffer<uint8_t> ws(quant::fake_quantize_workspace_bytes(E));
  for (const Case& k : kCases) {
    QuantConfig c;
    c.format = k.format;
    CapturedGraph graph(stream, [&] {
      quant::fake_quantize_groups(c, k.columnwise, TensorView(dx.get(), DType::kBF16, {rows, cols}),
                                  TensorView(dg.get(), DType::kInt32, {E + 1}),
                                  TensorView(dout.get(), DType::kBF16, {rows, cols}), ws.get(), stream);
    });
    uint64_t seed = 10;
    for (const std::vector<int32_t>& offsets : {std::vector<int32_t>{0, 50, 50, 180}, std::vector<int32_t>{0, 3, 130, 192}}) {
      const std::vector<uint16_t> x = make_values(rows * cols, ++seed, false);
      dx.upload(x);
      dg.upload(offsets);
      graph.launch();
      const std::vector<int64_t> off64(offsets.begin(), offsets.end());
      expect_equal_in_groups(dout.download(), ref::fake_quantize_groups(c, k.columnwise, to_float(x), rows, cols, off64),
                             cols, offsets, name(k) + " replay");
    }
  }
}

TEST_F(FakeQuantize, BadInputNamesTheArgument) {
  DeviceBuffer<uint16_t> x(64 * 48);
  DeviceBuffer<int32_t> g(std::vector<int32_t>{0, 64});
  DeviceBuffer<uint8_t> ws(quant::fake_quantize_workspace_bytes(1));
  const TensorView gv(g.get(), DType::kInt32, {2});
  QuantConfig mx;
  mx.format = QuantFormat::kMXFP8;
  const TensorView xv(x.get(), DType::kBF16, {64, 48});
  expect_error_naming([&] { quant::fake_quantize_groups(mx, false, xv, gv, xv, ws.get(), stream); }, "'x'");
  const TensorView ok(x.get(), DType::kBF16, {48, 64});
  expect_error_naming([&] { quant::fake_quantize_groups(mx, false, ok, gv, xv, ws.get(), stream); }, "'out'");
  expect_error_naming([&] { quant::fake_quantize_groups(mx, false, ok, gv, ok, nullptr, stream); }, "'workspace'");
  DeviceBuffer<uint16_t> big(64 * 48 + 64);
  const TensorView shifted(big.get() + 64, DType::kBF16, {48, 64});  // overlaps x partly
  expect_error_naming([&] {
    quant::fake_quantize_groups(mx, false, TensorView(big.get(), DType::kBF16, {48, 64}), gv, shifted, ws.get(), stream);
  }, "'out'");
  QuantConfig two_d = mx;
  two_d.format = QuantFormat::kNVFP4;
  two_d.blocking = QuantBlocking::k2D;
  expect_error_naming([&] { quant::fake_quantize_groups(two_d, false, ok, gv, ok, ws.get(), stream); },
                      "'config.blocking'");
  expect_error_naming([&] {
    quant::fake_quantize_groups(mx, false, ok, TensorView(g.get(), DType::kFP32, {2}), ok, ws.get(), stream);
  }, "'group_offsets'");
  // Zero-size: nothing to do, no workspace needed.
  quant::fake_quantize_groups(mx, true, TensorView(x.get(), DType::kBF16, {0, 64}), gv,
                              TensorView(x.get(), DType::kBF16, {0, 64}), nullptr, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
}

}  // namespace
}  // namespace moe
