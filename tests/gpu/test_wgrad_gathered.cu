// The grouped weight gradient with gathered rows (fused/wgrad_gathered.h) against the fp64 CPU
// reference of the grouped wgrad on the materialized x_perm: uneven and empty groups, groups longer
// than the 4-stage ring, padding rows, M and N that are not tile multiples, bf16 / fp32 written and
// fp32 accumulated (main_grad), both output layouts and staged or element-wise stores (a dW_e off
// 16-byte alignment; all bitwise identical), the gathered and the contiguous form of the same rows
// (bitwise identical), and CUDA graph replay with a new routing (bitwise equal to eager). The tile
// queue: skewed groups over more tiles than the GPU has clusters, more experts than the kernel
// orders by rows, and the queue's counter left zero after every launch and replay.
//
// Tolerances, as for the grouped GEMM's wgrad (tests/gpu/test_grouped_gemm.cu): bf16 inputs give
// exact fp32 products, accumulated in fp32 and rounded once:
//   bf16 output: |gpu - ref| <= 2^-8 |ref| + red * 2^-22 * sum|a b|
//   fp32 output: |gpu - ref| <= 2^-22 (|ref| + |c|) + red * 2^-22 * sum|a b|   (c = prior main_grad)
// A gather or layout mistake gives errors of the order of |ref| itself.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fused/wgrad_gathered.h"
#include "moe/float_convert.h"
#include "moe/grouped_gemm.h"
#include "reference/grouped_gemm_ref.h"
#include "support/gpu.h"

namespace moe {
namespace {

using testing::DeviceBuffer;
using Bits = uint16_t;

// A dispatched batch: T tokens of `slots` slots routed to E experts, each group padded with
// padding rows (row_slots = -1) to a multiple of `align`.
struct Batch {
  int E = 0, slots = 0;
  int64_t T = 0, R = 0;
  int M = 0, N = 0;
  std::vector<int32_t> off, row_slots;
  std::vector<Bits> x, dy;  // x [T, N], dy [R, M]

  Batch(int E_, int slots_, int64_t T_, int M_, int N_, const std::vector<int>& counts, int align, uint64_t seed)
      : E(E_), slots(slots_), T(T_), M(M_), N(N_) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    // Distinct (token, slot) pairs, shuffled, dealt to the experts in order.
    std::vector<int32_t> pairs(T * slots);
    std::iota(pairs.begin(), pairs.end(), 0);
    std::shuffle(pairs.begin(), pairs.end(), rng);
    size_t next = 0;
    off.push_back(0);
    for (int e = 0; e < E; ++e) {
      const int c = counts[e];
      const int padded = align > 0 ? (c + align - 1) / align * align : c;
      for (int i = 0; i < padded; ++i) row_slots.push_back(i < c ? pairs.at(next++) : -1);
      off.push_back(static_cast<int32_t>(row_slots.size()));
    }
    R = static_cast<int64_t>(row_slots.size());
    x.resize(T * N);
    for (Bits& b : x) b = float_to_bf16_bits(u(rng));
    dy.resize(R * M);
    for (Bits& b : dy) b = float_to_bf16_bits(u(rng));
  }

  // x_perm [R, N]: row r is x[row_slots[r] / slots] (zeros on padding rows).
  std::vector<Bits> x_perm() const {
    std::vector<Bits> p(R * N, 0);
    for (int64_t r = 0; r < R; ++r)
      if (row_slots[r] >= 0) std::copy_n(x.begin() + (row_slots[r] / slots) * N, N, p.begin() + r * N);
    return p;
  }

  ref::Groups groups() const {
    ref::Groups g;
    for (int e = 0; e < E; ++e) {
      g.offset.push_back(off[e]);
      g.rows.push_back(off[e + 1] - off[e]);
    }
    return g;
  }
};

std::vector<double> to_double(const std::vector<Bits>& b, bool absolute = false) {
  std::vector<double> d(b.size());
  for (size_t i = 0; i < b.size(); ++i) d[i] = absolute ? std::fabs(bf16_bits_to_float(b[i])) : bf16_bits_to_float(b[i]);
  return d;
}

// Expected dW [E, M, N] (from zero) and the scale of its rounding error.
struct Expected {
  std::vector<double> value, abs_sum;
  int64_t red = 0;
};
Expected expect(const Batch& b) {
  const std::vector<Bits> xp = b.x_perm();
  const auto dyd = to_double(b.dy), xd = to_double(xp), dya = to_double(b.dy, true), xa = to_double(xp, true);
  Expected ex;
  const int64_t mn = int64_t(b.M) * b.N;
  ex.value.assign(b.E * mn, 0.0);
  ex.abs_sum.assign(b.E * mn, 0.0);
  std::vector<double*> v, a;
  for (int e = 0; e < b.E; ++e) {
    v.push_back(ex.value.data() + e * mn);
    a.push_back(ex.abs_sum.data() + e * mn);
  }
  ref::grouped_wgrad(b.groups(), dyd.data(), xd.data(), b.M, b.N, v.data(), false);
  ref::grouped_wgrad(b.groups(), dya.data(), xa.data(), b.M, b.N, a.data(), false);
  for (int64_t r : b.groups().rows) ex.red = std::max(ex.red, r);
  return ex;
}

// The batch on the device.
struct DeviceBatch {
  DeviceBuffer<Bits> x, x_perm, dy;
  DeviceBuffer<int32_t> off, row_slots;
  DeviceBuffer<int32_t> tile_counter{std::vector<int32_t>{0}};
  explicit DeviceBatch(const Batch& b)
      : x(b.x), x_perm(b.x_perm()), dy(b.dy), off(b.off), row_slots(b.row_slots.empty() ? std::vector<int32_t>{0} : b.row_slots) {}
  // Every launch must leave the tile queue's counter as it found it: zero.
  void expect_counter_zero(const std::string& when) const {
    EXPECT_EQ(tile_counter.download(), std::vector<int32_t>{0}) << "the tile queue's counter after " << when;
  }
};

fused::WgradGatheredArgs args(const Batch& b, const DeviceBatch& d, bool gathered) {
  fused::WgradGatheredArgs a;
  a.dy = d.dy.get();
  a.x = gathered ? d.x.get() : d.x_perm.get();
  a.row_slots = gathered ? d.row_slots.get() : nullptr;
  a.slots = b.slots;
  a.group_offsets = d.off.get();
  a.experts = b.E;
  a.R = b.R;
  a.M = b.M;
  a.N = b.N;
  a.tile_counter = d.tile_counter.get();
  return a;
}

// How run() stores dW: single grouped or through a table, the table's dW_e shifted by one element
// off 16-byte alignment (the kernel's element-wise stores), dW_e transposed ([N, M], x_major).
struct Store {
  bool table = false;
  bool misaligned = false;  // table only
  bool x_major = false;
};

// dW in bf16 or fp32 written, or accumulated over `prior` ([E, M, N] in and out, whatever `store`).
template <typename Out>
std::vector<Out> run(const Batch& b, const DeviceBatch& d, bool gathered, bool accumulate, Store store,
                     const std::vector<Out>& prior, fused::WgradSchedule schedule = fused::WgradSchedule::kAuto) {
  const int64_t mn = int64_t(b.M) * b.N;
  EXPECT_TRUE(store.table || !store.misaligned) << "a misaligned dW_e needs the table form";
  const int64_t shift = store.misaligned ? 1 : 0;
  // [E, M, N] <-> the stored layout.
  auto relayout = [&](const std::vector<Out>& v, bool to_stored) {
    if (!store.x_major) return v;
    std::vector<Out> t(v.size());
    for (int e = 0; e < b.E; ++e)
      for (int m = 0; m < b.M; ++m)
        for (int n = 0; n < b.N; ++n) {
          const int64_t mn_at = e * mn + int64_t(m) * b.N + n, nm_at = e * mn + int64_t(n) * b.M + m;
          if (to_stored) t[nm_at] = v[mn_at];
          else t[mn_at] = v[nm_at];
        }
    return t;
  };
  DeviceBuffer<Out> dw(b.E * mn + shift);
  if (accumulate) {
    std::vector<Out> init = relayout(prior, true);
    init.insert(init.begin(), shift, Out{});
    dw.upload(init);
  } else {
    dw.fill_bytes(0xFF);  // NaN everywhere: any element left unwritten shows
  }
  std::vector<void*> ptrs;
  for (int e = 0; e < b.E; ++e) ptrs.push_back(dw.get() + shift + e * mn);
  DeviceBuffer<void*> d_ptrs(ptrs);
  fused::WgradGatheredArgs a = args(b, d, gathered);
  if (store.table) {
    a.dw_table = d_ptrs.get();
  } else {
    a.dw_base = dw.get();
    a.dw_stride_bytes = mn * static_cast<int64_t>(sizeof(Out));
  }
  a.dw_fp32 = sizeof(Out) == 4;
  a.accumulate = accumulate;
  a.x_major = store.x_major;
  a.schedule = schedule;
  fused::launch_wgrad_gathered(a, nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  d.expect_counter_zero("a launch");
  std::vector<Out> got = dw.download();
  got.erase(got.begin(), got.begin() + shift);
  return relayout(got, false);
}

void check_bf16(const std::vector<Bits>& got, const Expected& ex, const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 10; ++i) {
    const double g = bf16_bits_to_float(got[i]);
    const double tol = std::ldexp(std::fabs(ex.value[i]), -8) + ex.red * std::ldexp(ex.abs_sum[i], -22);
    if (!(std::fabs(g - ex.value[i]) <= tol))
      ++bad, ADD_FAILURE() << what << ": element " << i << " = " << g << ", expected " << ex.value[i] << " +- " << tol;
  }
}

void check_f32(const std::vector<float>& got, const Expected& ex, const std::vector<float>& prior,
               const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 10; ++i) {
    const double c = prior.empty() ? 0.0 : prior[i];
    const double want = ex.value[i] + c;
    const double tol = std::ldexp(std::fabs(want) + std::fabs(c), -22) + ex.red * std::ldexp(ex.abs_sum[i], -22);
    if (!(std::fabs(got[i] - want) <= tol))
      ++bad, ADD_FAILURE() << what << ": element " << i << " = " << got[i] << ", expected " << want << " +- " << tol;
  }
}

struct Shape {
  int E, slots;
  int64_t T;
  int M, N;
  std::vector<int> counts;  // rows per expert before padding (sum <= T * slots)
  int align;
};

class WgradGathered : public ::testing::TestWithParam<Shape> {};

TEST_P(WgradGathered, MatchesReferenceInEveryOutputMode) {
  MOE_REQUIRE_GPU();
  const Shape s = GetParam();
  const Batch b(s.E, s.slots, s.T, s.M, s.N, s.counts, s.align, 7);
  const DeviceBatch d(b);
  const Expected ex = expect(b);

  const Store grouped, table{true, false, false}, misaligned{true, true, false}, transposed{false, false, true},
      transposed_table{true, false, true}, transposed_misaligned{true, true, true};
  auto label = [](const Store& st) {
    return "table " + std::to_string(st.table) + " misaligned " + std::to_string(st.misaligned) + " x_major " +
           std::to_string(st.x_major);
  };
  const auto bf16 = run<Bits>(b, d, true, false, grouped, {});
  check_bf16(bf16, ex, "bf16 written");
  // The schedule the kernel picks (kAuto) and both forced ones give the same bits: a tile is one
  // CTA's whole reduction, whichever cluster takes it.
  const fused::WgradSchedule forced[] = {fused::WgradSchedule::kStride, fused::WgradSchedule::kQueue};
  for (fused::WgradSchedule sch : forced)
    EXPECT_EQ(bf16, run<Bits>(b, d, true, false, grouped, {}, sch)) << "bf16, schedule " << int(sch);
  EXPECT_EQ(bf16, run<Bits>(b, d, false, false, grouped, {})) << "gathered vs contiguous x_perm";
  // Every way of storing gives the same bits: staged stores (aligned) and element-wise ones
  // (misaligned), [M, N] and [N, M].
  for (const Store& st : {table, misaligned, transposed, transposed_table, transposed_misaligned})
    EXPECT_EQ(bf16, run<Bits>(b, d, true, false, st, {})) << "bf16, " << label(st);

  const auto f32 = run<float>(b, d, true, false, grouped, {});
  check_f32(f32, ex, {}, "fp32 written");
  for (const Store& st : {table, misaligned, transposed, transposed_table, transposed_misaligned})
    EXPECT_EQ(f32, run<float>(b, d, true, false, st, {})) << "fp32, " << label(st);

  std::mt19937_64 rng(11);
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<float> prior(f32.size());
  for (float& f : prior) f = u(rng);
  const auto acc = run<float>(b, d, true, true, grouped, prior);
  check_f32(acc, ex, prior, "fp32 accumulated");
  for (fused::WgradSchedule sch : forced)
    EXPECT_EQ(acc, run<float>(b, d, true, true, grouped, prior, sch)) << "accumulated, schedule " << int(sch);
  for (const Store& st : {table, misaligned, transposed, transposed_table, transposed_misaligned})
    EXPECT_EQ(acc, run<float>(b, d, true, true, st, prior)) << "accumulated, " << label(st);
  // Empty experts leave main_grad bitwise as it was.
  const int64_t mn = int64_t(b.M) * b.N;
  for (int e = 0; e < b.E; ++e)
    if (b.off[e + 1] == b.off[e])
      EXPECT_TRUE(std::equal(acc.begin() + e * mn, acc.begin() + (e + 1) * mn, prior.begin() + e * mn)) << "expert " << e;
}

// Zipf-like rows per expert (expert i gets about mean * E / (H_E (i + 1)), H_E the harmonic
// number), in a shuffled order so that the busiest experts do not come first by number.
std::vector<int> skewed_counts(int E, int mean, uint64_t seed) {
  double harmonic = 0;
  for (int i = 1; i <= E; ++i) harmonic += 1.0 / i;
  std::vector<int> c(E);
  for (int i = 0; i < E; ++i) c[i] = static_cast<int>(double(mean) * E / (harmonic * (i + 1)));
  std::shuffle(c.begin(), c.end(), std::mt19937_64(seed));
  return c;
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, WgradGathered,
    ::testing::Values(
        // Uneven and empty groups, partial M and N tiles, a group longer than the ring (300 rows).
        Shape{5, 2, 300, 192, 320, {0, 300, 1, 64, 129}, 0},
        // Padding rows inside the groups (A = 16), a single-row group.
        Shape{4, 3, 100, 64, 128, {1, 50, 0, 120}, 16},
        // The fc1 shape of a small SwiGLU layer (M = 2F) and many experts, one of them very long.
        Shape{16, 8, 256, 512, 256, {900, 3, 0, 40, 80, 128, 129, 255, 256, 1, 2, 64, 63, 65, 0, 2}, 0},
        // The smallest sizes.
        Shape{1, 1, 3, 8, 8, {3}, 0},
        // Every expert empty.
        Shape{3, 2, 10, 16, 24, {0, 0, 0}, 0},
        // More tiles (40 experts x 2 dY blocks x 1 pair of x blocks = 80 cluster tiles) than an
        // H100 has clusters (66): the persistent loop carries its ring and row indices across tiles.
        Shape{40, 4, 420, 512, 256,
              {40, 0, 33, 64, 65, 1, 100, 7, 40, 40, 40, 40, 0, 1, 2, 3, 90, 40, 40, 40,
               40, 40, 40, 40, 128, 40, 40, 40, 40, 40, 5, 40, 40, 40, 40, 40, 40, 40, 129, 40},
              0},
        // Skewed routing over 48 x 2 x 2 = 192 cluster tiles: the queue hands the busiest experts'
        // tiles out first (the order of the experts by rows), the clusters draw unequal numbers.
        Shape{48, 8, 512, 512, 512, skewed_counts(48, 80, 3), 0},
        // More experts than the kernel orders by rows (896): the queue in the experts' own order.
        Shape{1000, 4, 2000, 16, 24, skewed_counts(1000, 8, 4), 0}));

// Captured once, replayed with a new routing (new offsets and row map, same buffers): bitwise the
// eager result of the new routing.
TEST(WgradGathered, GraphReplayWithNewRoutingEqualsEager) {
  MOE_REQUIRE_GPU();
  const Batch first(6, 2, 200, 256, 384, {100, 0, 150, 50, 99, 1}, 0, 21);
  const Batch second(6, 2, 200, 256, 384, {3, 200, 0, 97, 50, 50}, 0, 22);
  ASSERT_EQ(first.R, second.R);
  DeviceBatch d(first);
  const int64_t mn = int64_t(first.M) * first.N;
  DeviceBuffer<float> dw(first.E * mn);
  fused::WgradGatheredArgs a = args(first, d, true);
  a.dw_base = dw.get();
  a.dw_stride_bytes = mn * 4;
  a.dw_fp32 = true;

  cudaStream_t s;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  fused::launch_wgrad_gathered(a, s);
  MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  d.x.upload(second.x);
  d.dy.upload(second.dy);
  d.off.upload(second.off);
  d.row_slots.upload(second.row_slots);
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  const std::vector<float> replayed = dw.download();
  d.expect_counter_zero("a replay");
  // Replayed again: the queue starts from zero each time (a counter left past the tiles would skip them).
  dw.fill_bytes(0xFF);
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  EXPECT_EQ(dw.download(), replayed) << "the third replay";
  d.expect_counter_zero("three replays");

  const DeviceBatch fresh(second);
  EXPECT_EQ(replayed, run<float>(second, fresh, true, false, Store{}, {}));
  check_f32(replayed, expect(second), {}, "graph replay");
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  MOE_CUDA_CHECK(cudaStreamDestroy(s));
}

// The gathered kernel and the grouped GEMM's wgrad on the materialized x_perm run the same
// accumulation (WGMMA 64x256x16 k steps in row order from each group's first row), so the layer's
// fused path gives the unfused path's weight gradients bit for bit.
TEST(WgradGathered, BitwiseEqualToGroupedGemmWgradOnXPerm) {
  MOE_REQUIRE_GPU();
  const Batch b(8, 4, 512, 384, 512, {300, 0, 257, 64, 500, 1, 129, 700}, 0, 31);
  const DeviceBatch d(b);
  GroupedGemm gg(b.E, b.R);
  DeviceBuffer<uint8_t> ws(gg.workspace_bytes());
  const int64_t mn = int64_t(b.M) * b.N;
  for (DType out : {DType::kBF16, DType::kFP32}) {
    const size_t bytes = out == DType::kFP32 ? 4 : 2;
    DeviceBuffer<uint8_t> dw(b.E * mn * bytes);
    gg.wgrad(TensorView(d.dy.get(), DType::kBF16, {b.R, b.M}), TensorView(d.x_perm.get(), DType::kBF16, {b.R, b.N}),
             TensorView(d.off.get(), DType::kInt32, {int64_t(b.E) + 1}),
             ExpertMatrices::grouped(TensorView(dw.get(), out, {int64_t(b.E), int64_t(b.M), int64_t(b.N)}), "dw"),
             false, TensorView(ws.get(), DType::kUInt8, {int64_t(ws.size())}), nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint8_t> want = dw.download();
    std::vector<uint8_t> got;
    if (out == DType::kFP32) {
      const auto f = run<float>(b, d, true, false, Store{}, {});
      got.assign(reinterpret_cast<const uint8_t*>(f.data()), reinterpret_cast<const uint8_t*>(f.data() + f.size()));
    } else {
      const auto h = run<Bits>(b, d, true, false, Store{}, {});
      got.assign(reinterpret_cast<const uint8_t*>(h.data()), reinterpret_cast<const uint8_t*>(h.data() + h.size()));
    }
    size_t differ = 0;
    for (size_t i = 0; i < got.size(); ++i) differ += got[i] != want[i];
    EXPECT_EQ(differ, 0u) << dtype_name(out) << ": bytes that differ from the grouped GEMM's wgrad";
  }
}

}  // namespace
}  // namespace moe
