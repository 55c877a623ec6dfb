// quantize_gathered against the bitwise CPU reference applied to the gathered matrix (row r =
// x[row_slots[r] / slots], zeros where the entry is -1): FP8 block and MXFP8, every copy selection,
// power-of-two scales, partial tiles, tokens gathered twice and never, bad map entries (zero rows
// and the error bit), graph capture + replay with new data and a new map, zero sizes, argument
// errors. That it equals quantize() of Dispatcher::permute's x_perm is checked on real plans by the
// FP8 experts tests (forward_gathered against forward).
#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "moe/device_errors.h"
#include "moe/error.h"
#include "moe/error_word.h"
#include "moe/float_convert.h"
#include "moe/quantize.h"
#include "reference/quantize_ref.h"
#include "support/expect_error.h"
#include "support/gpu.h"
#include "support/quantized_copies.h"

namespace moe {
namespace {

using ::moe::testing::CapturedGraph;
using ::moe::testing::DeviceBuffer;
using ::moe::testing::expect_error_naming;
using Copies = ::moe::testing::QuantizedCopies;

QuantConfig config(QuantFormat f, bool rowwise, bool columnwise, bool pow2) {
  QuantConfig c;
  c.format = f;
  c.rowwise = rowwise;
  c.columnwise = columnwise;
  c.pow2_scale = pow2;
  if (f == QuantFormat::kFP8Block) c.columnwise_scale_layout = ScaleLayout::kMNMajor;  // the layer's layout
  return c;
}

std::vector<uint16_t> make_x(int64_t T, int64_t K, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> mag(-6, 6);
  std::vector<uint16_t> x(T * K);
  for (int64_t t = 0; t < T; ++t) {
    const float m = std::ldexp(1.0f, mag(rng));  // rows of different magnitudes: different scales
    for (int64_t j = 0; j < K; ++j) x[t * K + j] = float_to_bf16_bits(nd(rng) * m);
  }
  if (T > 1)
    for (int64_t j = 0; j < K; ++j) x[K + j] = 0;  // token 1 all zero (amax 0)
  return x;
}

// A row map like a plan's: each expert group's rows hold its tokens' slots, then -1 pad rows; some
// tokens appear in two groups (two slots), some in none; rows past the groups are -1.
std::vector<int32_t> make_map(int64_t rows, int64_t T, int slots, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> tok(0, T > 0 ? T - 1 : 0);
  std::uniform_int_distribution<int> slot(0, slots - 1), pad(0, 5);
  std::vector<int32_t> map(rows, -1);
  for (int64_t r = 0; r + 16 < rows; ++r)
    if (T > 0 && pad(rng) != 0) map[r] = static_cast<int32_t>(tok(rng) * slots + slot(rng));
  return map;
}

std::vector<uint16_t> gather(const std::vector<uint16_t>& x, const std::vector<int32_t>& map, int slots, int64_t K) {
  std::vector<uint16_t> g(map.size() * K, 0);
  const int64_t T = static_cast<int64_t>(x.size()) / (K > 0 ? K : 1);
  for (size_t r = 0; r < map.size(); ++r)
    if (map[r] >= 0 && map[r] < T * slots)
      for (int64_t j = 0; j < K; ++j) g[r * K + j] = x[(map[r] / slots) * K + j];
  return g;
}

TensorView x_view(const DeviceBuffer<uint16_t>& x, int64_t T, int64_t K) {
  return TensorView(x.get(), DType::kBF16, {T, K});
}
TensorView map_view(const DeviceBuffer<int32_t>& m, int64_t rows) {
  return TensorView(m.get(), DType::kInt32, {rows});
}

TEST(QuantizeGathered, MatchesTheReferenceOnTheGatheredRows) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Shape {
    int64_t T, rows, K;
    int slots;
  };
  // Whole tiles; partial tiles in both directions (rows % 16 != 0: the columnwise copy's row-by-row
  // stores; K not a multiple of 128: a partial last block); more rows than tokens (k = 4).
  const Shape shapes[] = {{200, 384, 256, 2}, {150, 300, 208, 2}, {64, 512, 128, 4}};
  const QuantFormat formats[] = {QuantFormat::kFP8Block, QuantFormat::kMXFP8};
  uint64_t seed = 1;
  ErrorWord errors;
  for (const Shape& sh : shapes) {
    const std::vector<uint16_t> x = make_x(sh.T, sh.K, seed);
    const std::vector<int32_t> map = make_map(sh.rows, sh.T, sh.slots, seed + 100);
    const std::vector<uint16_t> g = gather(x, map, sh.slots, sh.K);
    const DeviceBuffer<uint16_t> dx(x);
    const DeviceBuffer<int32_t> dmap(map);
    for (QuantFormat f : formats) {
      // MXFP8 needs whole 1x32 (and, columnwise, 32x1) blocks.
      const bool mx = f == QuantFormat::kMXFP8;
      if (mx && (sh.K % 32 != 0)) continue;
      for (int copies = 0; copies < 3; ++copies) {
        const bool rowwise = copies != 2, columnwise = copies != 1 && (!mx || sh.rows % 32 == 0);
        if (!rowwise && !columnwise) continue;
        const bool pow2 = ++seed % 2 == 0 && !mx;  // MXFP8 scales are powers of two already
        const QuantConfig c = config(f, rowwise, columnwise, pow2);
        const std::string what = std::string(mx ? "mxfp8" : "fp8") + " T=" + std::to_string(sh.T) +
                                 " rows=" + std::to_string(sh.rows) + " K=" + std::to_string(sh.K) +
                                 " copies=" + std::to_string(copies) + (pow2 ? " pow2" : "");
        const ref::Quantized want = ref::quantize(c, g, 1, sh.rows, sh.K);
        const Copies got(c, want, sh.rows, sh.K);
        quantize_gathered(c, x_view(dx, sh.T, sh.K), map_view(dmap, sh.rows), sh.slots, got.q, errors.device_ptr(),
                          stream);
        MOE_CUDA_CHECK(cudaStreamSynchronize(stream));  // the copies are read back on another stream
        got.expect_equal(want, what);
        EXPECT_EQ(errors.fetch_and_clear(stream), 0u) << what;
      }
    }
  }
  cudaStreamDestroy(stream);
}

TEST(QuantizeGathered, BadMapEntriesReadAsZeroRowsAndRaiseTheErrorBit) {
  MOE_REQUIRE_GPU();
  const int64_t T = 100, rows = 256, K = 128;
  const int slots = 2;
  const std::vector<uint16_t> x = make_x(T, K, 7);
  std::vector<int32_t> map = make_map(rows, T, slots, 8);
  map[5] = -2;
  map[130] = static_cast<int32_t>(T * slots);  // one past the last slot
  map[131] = static_cast<int32_t>(T * slots - 1);  // the last slot: valid
  std::vector<int32_t> cleaned = map;
  cleaned[5] = cleaned[130] = -1;
  const QuantConfig c = config(QuantFormat::kFP8Block, true, true, false);
  const ref::Quantized want = ref::quantize(c, gather(x, cleaned, slots, K), 1, rows, K);
  const DeviceBuffer<uint16_t> dx(x);
  const DeviceBuffer<int32_t> dmap(map);
  const Copies got(c, want, rows, K);
  ErrorWord errors;
  quantize_gathered(c, x_view(dx, T, K), map_view(dmap, rows), slots, got.q, errors.device_ptr(), nullptr);
  got.expect_equal(want, "bad entries");
  EXPECT_EQ(errors.fetch_and_clear(nullptr), static_cast<uint32_t>(kErrBadRowMap));
  // Without an error word the rows are the same.
  const Copies again(c, want, rows, K);
  quantize_gathered(c, x_view(dx, T, K), map_view(dmap, rows), slots, again.q, nullptr, nullptr);
  again.expect_equal(want, "bad entries, no error word");
}

TEST(QuantizeGathered, GraphReplayWithNewDataAndANewMap) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const int64_t T = 160, rows = 384, K = 256;
  const int slots = 2;
  std::vector<uint16_t> x = make_x(T, K, 21);
  std::vector<int32_t> map = make_map(rows, T, slots, 22);
  DeviceBuffer<uint16_t> dx(x);
  DeviceBuffer<int32_t> dmap(map);
  const QuantConfig c = config(QuantFormat::kFP8Block, true, true, false);
  const ref::Quantized first = ref::quantize(c, gather(x, map, slots, K), 1, rows, K);
  const Copies got(c, first, rows, K);
  const CapturedGraph graph(stream, [&] {
    quantize_gathered(c, x_view(dx, T, K), map_view(dmap, rows), slots, got.q, nullptr, stream);
  });
  graph.launch();
  got.expect_equal(first, "first replay");
  x = make_x(T, K, 23);
  map = make_map(rows, T, slots, 24);
  dx.upload(x);
  dmap.upload(map);
  const ref::Quantized second = ref::quantize(c, gather(x, map, slots, K), 1, rows, K);
  graph.launch();
  got.expect_equal(second, "second replay");
  cudaStreamDestroy(stream);
}

TEST(QuantizeGathered, ZeroSizesAreValid) {
  MOE_REQUIRE_GPU();
  const QuantConfig c = config(QuantFormat::kFP8Block, true, true, false);
  const int64_t K = 128;
  // No rows.
  {
    const DeviceBuffer<uint16_t> dx(make_x(4, K, 3));
    const ref::Quantized want = ref::quantize(c, {}, 1, 0, K);
    const Copies got(c, want, 0, K);
    quantize_gathered(c, x_view(dx, 4, K), TensorView(nullptr, DType::kInt32, {0}), 1, got.q, nullptr, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    got.expect_equal(want, "no rows");
  }
  // No tokens (x without memory): every row is a pad row.
  {
    const int64_t rows = 128;
    const DeviceBuffer<int32_t> dmap(std::vector<int32_t>(rows, -1));
    const ref::Quantized want = ref::quantize(c, std::vector<uint16_t>(rows * K, 0), 1, rows, K);
    const Copies got(c, want, rows, K);
    ErrorWord errors;
    quantize_gathered(c, TensorView(nullptr, DType::kBF16, {0, K}), map_view(dmap, rows), 2, got.q,
                      errors.device_ptr(), nullptr);
    got.expect_equal(want, "no tokens");
    EXPECT_EQ(errors.fetch_and_clear(nullptr), 0u);
  }
}

TEST(QuantizeGathered, BadInputNamesTheArgument) {
  MOE_REQUIRE_GPU();
  const int64_t T = 64, rows = 128, K = 128;
  const DeviceBuffer<uint16_t> dx(make_x(T, K, 5));
  const DeviceBuffer<int32_t> dmap(make_map(rows, T, 2, 6));
  const QuantConfig c = config(QuantFormat::kFP8Block, true, true, false);
  const ref::Quantized shape = ref::quantize(c, std::vector<uint16_t>(rows * K, 0), 1, rows, K);
  const Copies out(c, shape, rows, K);
  auto run = [&](const QuantConfig& cfg, const TensorView& x, const TensorView& map, int slots,
                 const QuantizedTensor& q) { quantize_gathered(cfg, x, map, slots, q, nullptr, nullptr); };
  const TensorView x = x_view(dx, T, K), map = map_view(dmap, rows);
  QuantConfig two_d = config(QuantFormat::kFP8Block, true, true, false);
  two_d.blocking = QuantBlocking::k2D;
  two_d.columnwise_scale_layout = ScaleLayout::kRowMajor;  // MN-major is for 1-D blocks
  expect_error_naming([&] { run(two_d, x, map, 2, out.q); }, "'config'");
  QuantConfig nv = config(QuantFormat::kNVFP4, true, false, false);
  expect_error_naming([&] { run(nv, x, map, 2, out.q); }, "'config'");
  expect_error_naming([&] { run(c, TensorView(dx.get(), DType::kBF16, {T * K}), map, 2, out.q); }, "'x'");
  expect_error_naming([&] { run(c, TensorView(dx.get(), DType::kFP32, {T / 2, K}), map, 2, out.q); }, "'x'");
  expect_error_naming([&] { run(c, TensorView(dx.get(), DType::kBF16, {T, K - 4}), map, 2, out.q); }, "'x'");
  expect_error_naming([&] { run(c, x, map, 0, out.q); }, "'slots'");
  expect_error_naming([&] { run(c, x, TensorView(dmap.get(), DType::kInt32, {2, rows / 2}), 2, out.q); },
                      "'row_slots'");
  expect_error_naming([&] { run(c, x, TensorView(dmap.get(), DType::kInt64, {rows / 2}), 2, out.q); },
                      "'row_slots'");
  const int64_t too_many = 65535 * 128 + 1;  // the view is only checked, never read
  expect_error_naming([&] { run(c, x, TensorView(dmap.get(), DType::kInt32, {too_many}), 2, out.q); },
                      "'row_slots'");
  const QuantConfig mx = config(QuantFormat::kMXFP8, false, true, false);
  expect_error_naming([&] { run(mx, x, TensorView(dmap.get(), DType::kInt32, {rows - 16}), 2, out.q); },
                      "'row_slots'");
  QuantizedTensor bad = out.q;
  bad.rowwise_data = TensorView(out.rd.get(), DType::kFP8E4M3, {rows - 16, K});
  expect_error_naming([&] { run(c, x, map, 2, bad); }, "'out.rowwise_data'");
  bad = out.q;
  bad.columnwise_scale = TensorView();
  expect_error_naming([&] { run(c, x, map, 2, bad); }, "'out.columnwise_scale'");
}

}  // namespace
}  // namespace moe
