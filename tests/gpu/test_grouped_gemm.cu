// GPU grouped GEMM (fprop, dgrad, wgrad) against the fp64 CPU reference: uneven and empty groups,
// a single group, E = 256, the smallest aligned N and K, both weight layouts (bitwise identical),
// main_grad accumulation, CUDA graph capture + replay with new group sizes (bitwise equal to eager),
// clamping of offsets past the buffer, and argument errors.
//
// Tolerances (stated once, used by every comparison). Inputs are bf16, so products are exact in
// fp32; the kernel accumulates in fp32 and rounds once to the output type:
//   bf16 output: |gpu - ref| <= 2^-8 |ref| + red * 2^-22 * sum|a b|
//   fp32 output: |gpu - ref| <= 2^-22 (|ref| + |c|) + red * 2^-22 * sum|a b|   (c = prior main_grad)
// 2^-8 is one bf16 ulp (rounding costs half of one); red * 2^-23 * sum|a b| bounds fp32 summation of
// `red` terms even with truncating adds, doubled for margin. An indexing or layout mistake gives
// errors of the order of |ref| itself, orders of magnitude above these bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe/error.h"
#include "moe/error_word.h"
#include "moe/float_convert.h"
#include "moe/grouped_gemm.h"
#include "reference/grouped_gemm_ref.h"
#include "support/gpu.h"
#include "support/expect_error.h"
#include "support/layer_data.h"

namespace moe {
namespace {

using testing::DeviceBuffer;
using testing::layer_data::transpose_experts;
using Bits = uint16_t;

// The engine and one call workspace of its own (the engine holds no device memory; every call
// names the workspace its argument arrays and CUTLASS state go to).
struct TestGemm {
  TestGemm(int E, int64_t R, int max_sms = 0) : gg(E, R, max_sms), ws(gg.workspace_bytes()) {}
  GroupedGemm gg;
  DeviceBuffer<uint8_t> ws;
  TensorView workspace() const { return TensorView(ws.get(), DType::kUInt8, {int64_t(ws.size())}); }
  void fprop(const TensorView& x, const ExpertMatrices& w, const TensorView& o, const TensorView& y, cudaStream_t s) {
    gg.fprop(x, w, o, y, workspace(), s);
  }
  void dgrad(const TensorView& dy, const ExpertMatrices& w, const TensorView& o, const TensorView& dx,
             cudaStream_t s) {
    gg.dgrad(dy, w, o, dx, workspace(), s);
  }
  void wgrad(const TensorView& dy, const TensorView& x, const TensorView& o, const ExpertMatrices& dw, bool acc,
             cudaStream_t s) {
    gg.wgrad(dy, x, o, dw, acc, workspace(), s);
  }
  void force_config(GemmOp op, const std::string& name, bool along_n = false, int tile_run = 1) {
    gg.force_config(op, name, along_n, tile_run);
  }
  std::string chosen_config(GemmOp op, int64_t N, int64_t K, DType out = DType::kBF16) const {
    return gg.chosen_config(op, N, K, out);
  }
};
constexpr Bits kPoison = 0xFFFF;        // a bf16 NaN: any value written over it is visible

std::vector<Bits> random_bf16(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<Bits> v(n);
  for (Bits& b : v) b = float_to_bf16_bits(u(rng));
  return v;
}
std::vector<float> random_f32(size_t n, std::mt19937_64& rng) {
  std::uniform_real_distribution<float> u(-4.0f, 4.0f);
  std::vector<float> v(n);
  for (float& f : v) f = u(rng);
  return v;
}
std::vector<double> to_double(const std::vector<Bits>& b) {
  std::vector<double> d(b.size());
  for (size_t i = 0; i < b.size(); ++i) d[i] = bf16_bits_to_float(b[i]);
  return d;
}
std::vector<double> absolute(std::vector<double> v) {
  for (double& x : v) x = std::fabs(x);
  return v;
}

// Groups of the reference from device-style offsets, clamped into [0, rows] as the GPU does.
ref::Groups groups_from(const std::vector<int32_t>& off, int64_t rows) {
  ref::Groups g;
  for (size_t e = 0; e + 1 < off.size(); ++e) {
    const int64_t lo = std::min<int64_t>(std::max<int64_t>(off[e], 0), rows);
    const int64_t hi = std::min<int64_t>(std::max<int64_t>(off[e + 1], lo), rows);
    g.offset.push_back(lo);
    g.rows.push_back(hi - lo);
  }
  return g;
}
std::vector<int32_t> offsets_from_sizes(const std::vector<int>& sizes) {
  std::vector<int32_t> off{0};
  for (int s : sizes) off.push_back(off.back() + s);
  return off;
}

// One grouped problem: data on the host (bf16 bits) and on the device.
struct Problem {
  int E;
  int64_t N, K, R;
  std::vector<int32_t> off;
  std::vector<Bits> x, w, dy;  // x [R, K], w [E, N, K], dy [R, N]
  DeviceBuffer<Bits> d_x, d_w, d_dy;
  DeviceBuffer<int32_t> d_off;

  Problem(int E_, int64_t N_, int64_t K_, int64_t R_, std::vector<int32_t> off_, uint64_t seed)
      : E(E_), N(N_), K(K_), R(R_), off(std::move(off_)) {
    std::mt19937_64 rng(seed);
    x = random_bf16(R * K, rng);
    w = random_bf16(E * N * K, rng);
    dy = random_bf16(R * N, rng);
    d_x = DeviceBuffer<Bits>(x);
    d_w = DeviceBuffer<Bits>(w);
    d_dy = DeviceBuffer<Bits>(dy);
    d_off = DeviceBuffer<int32_t>(off);
  }
  TensorView x_view() const { return TensorView(d_x.get(), DType::kBF16, {R, K}); }
  TensorView dy_view() const { return TensorView(d_dy.get(), DType::kBF16, {R, N}); }
  TensorView off_view() const { return TensorView(d_off.get(), DType::kInt32, {int64_t(E) + 1}); }
  ExpertMatrices w_grouped() const {
    return ExpertMatrices::grouped(TensorView(d_w.get(), DType::kBF16, {int64_t(E), N, K}), "w");
  }
  // The same weights as E separate allocations (kept in *storage): the per-expert layout.
  ExpertMatrices w_per_expert(std::vector<DeviceBuffer<Bits>>* storage) const {
    std::vector<TensorView> views;
    for (int e = 0; e < E; ++e) {
      storage->emplace_back(std::vector<Bits>(w.begin() + e * N * K, w.begin() + (e + 1) * N * K));
      views.emplace_back(storage->back().get(), DType::kBF16, std::initializer_list<int64_t>{N, K});
    }
    return ExpertMatrices::per_expert(views, "w");
  }
  ref::Groups groups() const { return groups_from(off, R); }
  std::vector<const double*> w_ptrs(const std::vector<double>& wd) const {
    std::vector<const double*> p;
    for (int e = 0; e < E; ++e) p.push_back(wd.data() + e * N * K);
    return p;
  }
  int64_t used_rows() const {  // rows inside some group
    const ref::Groups g = groups();
    int64_t end = 0;
    for (int e = 0; e < E; ++e) end = std::max(end, g.offset[e] + g.rows[e]);
    return end;
  }
};

// Expected token-side output (fprop: [R, N], dgrad: [R, K]) and its tolerance scale.
struct Expected {
  std::vector<double> value, abs_sum;
  int64_t red = 0;  // length of the reduction
};

Expected expect_fprop(const Problem& p) {
  Expected ex;
  const auto xd = to_double(p.x), wd = to_double(p.w);
  const auto xa = absolute(xd), wa = absolute(wd);
  ex.value.assign(p.R * p.N, 0.0);
  ex.abs_sum.assign(p.R * p.N, 0.0);
  ref::grouped_fprop(p.groups(), xd.data(), p.w_ptrs(wd).data(), p.N, p.K, ex.value.data());
  ref::grouped_fprop(p.groups(), xa.data(), p.w_ptrs(wa).data(), p.N, p.K, ex.abs_sum.data());
  ex.red = p.K;
  return ex;
}

Expected expect_dgrad(const Problem& p) {
  Expected ex;
  const auto dyd = to_double(p.dy), wd = to_double(p.w);
  const auto dya = absolute(dyd), wa = absolute(wd);
  ex.value.assign(p.R * p.K, 0.0);
  ex.abs_sum.assign(p.R * p.K, 0.0);
  ref::grouped_dgrad(p.groups(), dyd.data(), p.w_ptrs(wd).data(), p.N, p.K, ex.value.data());
  ref::grouped_dgrad(p.groups(), dya.data(), p.w_ptrs(wa).data(), p.N, p.K, ex.abs_sum.data());
  ex.red = p.N;
  return ex;
}

// Weight gradient [E, N, K] (written, from zero).
Expected expect_wgrad(const Problem& p) {
  Expected ex;
  const auto dyd = to_double(p.dy), xd = to_double(p.x);
  const auto dya = absolute(dyd), xa = absolute(xd);
  ex.value.assign(p.E * p.N * p.K, 0.0);
  ex.abs_sum.assign(p.E * p.N * p.K, 0.0);
  std::vector<double*> v, a;
  for (int e = 0; e < p.E; ++e) {
    v.push_back(ex.value.data() + e * p.N * p.K);
    a.push_back(ex.abs_sum.data() + e * p.N * p.K);
  }
  ref::grouped_wgrad(p.groups(), dyd.data(), xd.data(), p.N, p.K, v.data(), false);
  ref::grouped_wgrad(p.groups(), dya.data(), xa.data(), p.N, p.K, a.data(), false);
  for (int64_t r : p.groups().rows) ex.red = std::max(ex.red, r);
  return ex;
}

// Token-side bf16 output: rows inside groups within tolerance, rows past the groups untouched.
void check_rows_bf16(const std::vector<Bits>& got, const Expected& ex, int64_t used_rows, int64_t cols,
                     const std::string& what) {
  int bad = 0;
  for (int64_t i = 0; i < int64_t(got.size()) && bad < 10; ++i) {
    if (i / cols >= used_rows) {
      if (got[i] != kPoison) ++bad, ADD_FAILURE() << what << ": row " << i / cols << " past the groups was written";
      continue;
    }
    const double g = bf16_bits_to_float(got[i]);
    const double tol = std::ldexp(std::fabs(ex.value[i]), -8) + ex.red * std::ldexp(ex.abs_sum[i], -22);
    if (!(std::fabs(g - ex.value[i]) <= tol))
      ++bad, ADD_FAILURE() << what << ": element " << i << " (row " << i / cols << ", col " << i % cols
                           << ") = " << g << ", expected " << ex.value[i] << " +- " << tol;
  }
}

void check_wgrad_bf16(const std::vector<Bits>& got, const Expected& ex, const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 10; ++i) {
    const double g = bf16_bits_to_float(got[i]);
    const double tol = std::ldexp(std::fabs(ex.value[i]), -8) + ex.red * std::ldexp(ex.abs_sum[i], -22);
    if (!(std::fabs(g - ex.value[i]) <= tol))
      ++bad, ADD_FAILURE() << what << ": dW element " << i << " = " << g << ", expected " << ex.value[i] << " +- " << tol;
  }
}

// fp32 weight gradient; `prior` = main_grad before accumulation (empty: written from zero).
void check_wgrad_f32(const std::vector<float>& got, const Expected& ex, const std::vector<float>& prior,
                     const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 10; ++i) {
    const double c = prior.empty() ? 0.0 : prior[i];
    const double want = c + ex.value[i];
    const double tol = std::ldexp(std::fabs(want) + std::fabs(c), -22) + ex.red * std::ldexp(ex.abs_sum[i], -22);
    if (!(std::fabs(got[i] - want) <= tol))
      ++bad, ADD_FAILURE() << what << ": dW element " << i << " = " << got[i] << ", expected " << want << " +- " << tol;
  }
}

// The bf16 output of one op on `p`, written over a poisoned (NaN) buffer: y [R, N] (fprop),
// dx [R, K] (dgrad) or dw [E, N, K] written (wgrad; empty experts must be zero-filled).
std::vector<Bits> run_bf16(TestGemm& gg, const Problem& p, GemmOp op) {
  const int64_t n = op == GemmOp::kFprop ? p.R * p.N : op == GemmOp::kDgrad ? p.R * p.K : p.E * p.N * p.K;
  DeviceBuffer<Bits> out(n);
  out.fill_bytes(0xFF);
  if (op == GemmOp::kFprop)
    gg.fprop(p.x_view(), p.w_grouped(), p.off_view(), TensorView(out.get(), DType::kBF16, {p.R, p.N}), nullptr);
  if (op == GemmOp::kDgrad)
    gg.dgrad(p.dy_view(), p.w_grouped(), p.off_view(), TensorView(out.get(), DType::kBF16, {p.R, p.K}), nullptr);
  if (op == GemmOp::kWgrad)
    gg.wgrad(p.dy_view(), p.x_view(), p.off_view(),
             ExpertMatrices::grouped(TensorView(out.get(), DType::kBF16, {int64_t(p.E), p.N, p.K}), "dw"), false,
             nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  return out.download();
}

void check_fprop(TestGemm& gg, const Problem& p, const std::string& what) {
  check_rows_bf16(run_bf16(gg, p, GemmOp::kFprop), expect_fprop(p), p.used_rows(), p.N, what + " fprop");
}

void check_dgrad(TestGemm& gg, const Problem& p, const std::string& what) {
  check_rows_bf16(run_bf16(gg, p, GemmOp::kDgrad), expect_dgrad(p), p.used_rows(), p.K, what + " dgrad");
}

// wgrad written in bf16, written in fp32, and accumulated into an fp32 main_grad.
void check_wgrad(TestGemm& gg, const Problem& p, const std::string& what) {
  const Expected ex = expect_wgrad(p);
  const int64_t wn = p.E * p.N * p.K;
  check_wgrad_bf16(run_bf16(gg, p, GemmOp::kWgrad), ex, what + " wgrad bf16");
  {
    DeviceBuffer<float> dw(wn);
    dw.fill_bytes(0xFF);
    gg.wgrad(p.dy_view(), p.x_view(), p.off_view(),
             ExpertMatrices::grouped(TensorView(dw.get(), DType::kFP32, {int64_t(p.E), p.N, p.K}), "dw"), false,
             nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    check_wgrad_f32(dw.download(), ex, {}, what + " wgrad fp32");
  }
  {
    std::mt19937_64 rng(99);
    std::vector<float> prior = random_f32(wn, rng);
    DeviceBuffer<float> mg(prior);
    gg.wgrad(p.dy_view(), p.x_view(), p.off_view(),
             ExpertMatrices::grouped(TensorView(mg.get(), DType::kFP32, {int64_t(p.E), p.N, p.K}), "main_grad"), true,
             nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<float> got = mg.download();
    check_wgrad_f32(got, ex, prior, what + " wgrad accumulate");
    // Empty experts leave main_grad bitwise untouched.
    const ref::Groups g = p.groups();
    for (int e = 0; e < p.E; ++e)
      if (g.rows[e] == 0)
        EXPECT_EQ(std::memcmp(got.data() + e * p.N * p.K, prior.data() + e * p.N * p.K, p.N * p.K * sizeof(float)), 0)
            << what << ": main_grad of empty expert " << e << " changed";
  }
}

// Every op on `p` with the configurations `gg` chooses.
void run_and_check_all(TestGemm& gg, const Problem& p, const std::string& what) {
  check_fprop(gg, p, what);
  check_dgrad(gg, p, what);
  check_wgrad(gg, p, what);
}

TEST(GroupedGemm, EveryConfigurationUnevenAndEmptyGroups) {
  MOE_REQUIRE_GPU();
  // Uneven groups (not multiples of any tile), empty ones at both ends and inside, a group of one
  // row, and 19 rows past the last group; N and K multiples of 8 but not of the tile sizes.
  const std::vector<int> sizes = {0, 37, 0, 300, 1, 257, 0};
  const auto off = offsets_from_sizes(sizes);
  Problem p(int(sizes.size()), 264, 200, off.back() + 19, off, 1);
  TestGemm gg(p.E, p.R);
  for (GemmOp op : {GemmOp::kFprop, GemmOp::kDgrad, GemmOp::kWgrad}) {
    std::vector<std::string> names = GroupedGemm::configs(op, DType::kBF16);
    for (const std::string& n : GroupedGemm::configs(op, DType::kFP32))
      if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
    ASSERT_FALSE(names.empty());
    for (const std::string& name : names)
      for (bool along_n : {false, true}) {
        gg.force_config(op, name, along_n);
        const std::string what = std::string(gemm_op_name(op)) + " " + name + (along_n ? "/N" : "/M");
        if (op == GemmOp::kFprop) check_fprop(gg, p, what);
        if (op == GemmOp::kDgrad) check_dgrad(gg, p, what);
        if (op == GemmOp::kWgrad) check_wgrad(gg, p, what);
      }
    gg.force_config(op, "");
  }
  // The shape heuristic's choices (ping-pong for this short reduction of fprop) on the same problem.
  run_and_check_all(gg, p, "heuristic");
}

TEST(GroupedGemm, WgradWarpGroupStoresGiveTheTmaEpiloguesBits) {
  MOE_REQUIRE_GPU();
  // The warp-group store epilogue (the fp32 configuration the engine takes for main_grad
  // accumulation) against CUTLASS's TMA epilogue on the same main loop: the same bytes written and
  // added into a main_grad, in both tile orders, with partial tiles (N = 264, K = 200), empty and
  // one-row experts, and several tiles per CTA (4 SMs), so that each warp group's buffer is reused
  // across tiles and groups.
  const std::vector<int> sizes = {0, 37, 0, 300, 1, 257, 0};
  const auto off = offsets_from_sizes(sizes);
  Problem p(int(sizes.size()), 264, 200, off.back() + 19, off, 5);
  const int64_t wn = p.E * p.N * p.K;
  std::mt19937_64 rng(17);
  const std::vector<float> prior = random_f32(wn, rng);
  const auto run = [&](const std::string& config, bool along_n) {
    TestGemm gg(p.E, p.R, 4);
    gg.force_config(GemmOp::kWgrad, config, along_n);
    EXPECT_EQ(gg.chosen_config(GemmOp::kWgrad, p.N, p.K, DType::kFP32), config + (along_n ? "/N" : "/M"));
    DeviceBuffer<float> dw(wn), mg(prior);
    dw.fill_bytes(0xFF);
    const auto dw_of = [&](DeviceBuffer<float>& b) {
      return ExpertMatrices::grouped(TensorView(b.get(), DType::kFP32, {int64_t(p.E), p.N, p.K}), "dw");
    };
    gg.wgrad(p.dy_view(), p.x_view(), p.off_view(), dw_of(dw), false, nullptr);
    gg.wgrad(p.dy_view(), p.x_view(), p.off_view(), dw_of(mg), true, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    return std::make_pair(dw.download(), mg.download());
  };
  const auto same_bytes = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
  };
  for (bool along_n : {false, true}) {
    const auto tma = run("coop_128x256x64_c2x1", along_n), rows = run("coop_128x256x64_c2x1_wgstores", along_n);
    EXPECT_TRUE(same_bytes(rows.first, tma.first)) << "written, along " << (along_n ? "N" : "M");
    EXPECT_TRUE(same_bytes(rows.second, tma.second)) << "added into main_grad, along " << (along_n ? "N" : "M");
    EXPECT_FALSE(same_bytes(tma.second, prior)) << "the accumulation changed main_grad";
  }
}

TEST(GroupedGemm, TileRunsCoverEveryTileOnce) {
  MOE_REQUIRE_GPU();
  // The persistent schedule in runs of consecutive cluster tiles (run_group_scheduler.cuh): full
  // rounds, then the tail split into near-equal shares. Six SMs (three clusters of two) give every
  // CTA many rounds and a tail; 40 groups (the group walk goes past one warp's 32) are uneven, empty
  // or one row. Runs 2, 3, 7 and one longer than all tiles (one contiguous share per cluster), in
  // both tile orders, must give bitwise the output of the round-robin order (each tile is computed
  // by the same code whichever CTA takes it), which is checked against the reference; the outputs
  // start poisoned, so a skipped tile shows.
  std::vector<int> sizes;
  for (int e = 0; e < 40; ++e) sizes.push_back(e % 7 == 3 ? 0 : e % 11 == 5 ? 1 : 17 + (e * 53) % 260);
  const auto off = offsets_from_sizes(sizes);
  Problem p(int(sizes.size()), 520, 136, off.back() + 5, off, 21);
  TestGemm gg(p.E, p.R, 6);
  for (GemmOp op : {GemmOp::kFprop, GemmOp::kDgrad, GemmOp::kWgrad}) {
    for (const std::string& name : GroupedGemm::configs(op, DType::kBF16))
      for (bool along_n : {false, true}) {
        const std::string what = std::string(gemm_op_name(op)) + " " + name + (along_n ? "/N" : "/M");
        gg.force_config(op, name, along_n, 1);
        if (op == GemmOp::kFprop) check_fprop(gg, p, what);
        if (op == GemmOp::kDgrad) check_dgrad(gg, p, what);
        if (op == GemmOp::kWgrad) check_wgrad(gg, p, what);
        // The rows GEMM keeps its own schedule (no tile runs; RowsKernels... below).
        if (name.rfind("rows_", 0) == 0) continue;
        const std::vector<Bits> round_robin = run_bf16(gg, p, op);
        for (int run : {2, 3, 7, 1024}) {
          gg.force_config(op, name, along_n, run);
          // The run reaches the launch (reported with the configuration).
          EXPECT_EQ(gg.chosen_config(op, p.N, p.K), name + (along_n ? "/N" : "/M") + "/run" + std::to_string(run));
          EXPECT_TRUE(run_bf16(gg, p, op) == round_robin)
              << what << " run " << run << " differs from the round-robin order";
        }
      }
    gg.force_config(op, "");
  }
  ::moe::testing::expect_error_naming([&] { gg.force_config(GemmOp::kFprop, "pong_128x128x64_c1x2", true, 0); },
                                      "tile_run");
  ::moe::testing::expect_error_naming([&] { gg.force_config(GemmOp::kDgrad, "rows_coop_128x256x64_c2x1", false, 4); },
                                      "tile_run");
  ::moe::testing::expect_error_naming([&] { gg.force_config(GemmOp::kFprop, "", false, 4); }, "tile_run");
  // The FP8 configurations keep CUTLASS's round-robin schedule.
  ::moe::testing::expect_error_naming([&] { gg.force_config(GemmOp::kFprop, "fp8_coop_128x128x128_c1x2", false, 4); },
                                      "tile_run");
}

TEST(GroupedGemm, SingleGroupAndLargeReduction) {
  MOE_REQUIRE_GPU();
  Problem p(1, 136, 1032, 515, {0, 515}, 2);
  TestGemm gg(1, p.R);
  run_and_check_all(gg, p, "single group");
}

TEST(GroupedGemm, HeuristicConfigurationsOnClusterAlignedShapes) {
  MOE_REQUIRE_GPU();
  // N = 1536, K = 512: the heuristic picks ping-pong 128x192 with the 1x2 cluster for fprop, the
  // cooperative tile with the 1x2 cluster for dgrad and the N-ordered scheduler for wgrad -- the
  // paths the named shapes take, here with full cluster pairs.
  const auto off = offsets_from_sizes({130, 0, 250});
  Problem p(3, 1536, 512, off.back(), off, 13);
  TestGemm gg(3, p.R);
  EXPECT_EQ(gg.chosen_config(GemmOp::kFprop, p.N, p.K), "pong_128x192x64_c1x2/N/run4");
  EXPECT_EQ(gg.chosen_config(GemmOp::kDgrad, p.N, p.K), "coop_128x256x64_c1x2/M");
  EXPECT_EQ(gg.chosen_config(GemmOp::kWgrad, p.N, p.K), "coop_128x256x64_c2x1/N");
  run_and_check_all(gg, p, "heuristic N=1536 K=512");
  // An output width that is no whole number of 192-wide tile pairs (qwen3-30b-a3b-ep8's fc2) takes
  // the 2x1 cluster instead.
  EXPECT_EQ(gg.chosen_config(GemmOp::kFprop, 2048, 768), "pong_128x192x64_c2x1/N");
  // The choices for every named shape's products, the dgrad rule included, are checked on the host
  // (tests/cpu/test_tile_heuristic.cpp).
}

TEST(GroupedGemm, ManyExpertsSmallestAlignedSizes) {
  MOE_REQUIRE_GPU();
  // E = 256 experts, about a third empty, N = K = 8 (the smallest 16-byte aligned bf16 rows), then
  // N = 8, K = 16 and N = 16, K = 8 so that N != K catches any transposed dimension.
  std::mt19937_64 rng(5);
  std::vector<int> sizes(256);
  for (int& s : sizes) s = (rng() % 3 == 0) ? 0 : int(rng() % 40);
  const auto off = offsets_from_sizes(sizes);
  for (auto [N, K] : {std::pair<int64_t, int64_t>{8, 8}, {8, 16}, {16, 8}}) {
    Problem p(256, N, K, off.back() + 3, off, 10 + N + K);
    TestGemm gg(256, p.R);
    run_and_check_all(gg, p, "E=256 N=" + std::to_string(N) + " K=" + std::to_string(K));
  }
}

TEST(GroupedGemm, AllGroupsEmptyAndZeroRows) {
  MOE_REQUIRE_GPU();
  // Every expert empty (nothing may hang; wgrad writes zeros or leaves main_grad untouched)...
  Problem p(4, 16, 24, 64, {0, 0, 0, 0, 0}, 3);
  TestGemm gg(4, 64);
  run_and_check_all(gg, p, "all empty");
  // ... and a batch with zero rows (null token-side data).
  Problem z(3, 16, 24, 0, {0, 0, 0, 0}, 4);
  run_and_check_all(gg, z, "zero rows");
}

TEST(GroupedGemm, OffsetsPastTheBufferAreClamped) {
  MOE_REQUIRE_GPU();
  // A dispatch that overflowed its row bound hands offsets beyond R: groups are cut at R, nothing
  // outside the buffers is read or written (compute-sanitizer memcheck runs this test too).
  Problem p(3, 24, 32, 100, {0, 60, 130, 170}, 6);
  TestGemm gg(3, 100);
  run_and_check_all(gg, p, "clamped");
}

TEST(GroupedGemm, WeightLayoutsGiveBitwiseIdenticalResults) {
  MOE_REQUIRE_GPU();
  const std::vector<int> sizes = {130, 0, 77, 256, 9};
  const auto off = offsets_from_sizes(sizes);
  Problem p(5, 136, 264, off.back(), off, 7);
  TestGemm gg(5, p.R);
  cudaStream_t stream = nullptr;
  const int64_t nk = p.N * p.K;

  std::vector<DeviceBuffer<Bits>> w_sep;
  const ExpertMatrices w_per = p.w_per_expert(&w_sep);

  DeviceBuffer<Bits> y1(p.R * p.N), y2(p.R * p.N), dx1(p.R * p.K), dx2(p.R * p.K);
  gg.fprop(p.x_view(), p.w_grouped(), p.off_view(), TensorView(y1.get(), DType::kBF16, {p.R, p.N}), stream);
  gg.fprop(p.x_view(), w_per, p.off_view(), TensorView(y2.get(), DType::kBF16, {p.R, p.N}), stream);
  gg.dgrad(p.dy_view(), p.w_grouped(), p.off_view(), TensorView(dx1.get(), DType::kBF16, {p.R, p.K}), stream);
  gg.dgrad(p.dy_view(), w_per, p.off_view(), TensorView(dx2.get(), DType::kBF16, {p.R, p.K}), stream);
  EXPECT_EQ(y1.download(), y2.download());
  EXPECT_EQ(dx1.download(), dx2.download());

  for (DType dt : {DType::kBF16, DType::kFP32}) {
    for (bool acc : {false, true}) {
      if (acc && dt != DType::kFP32) continue;
      const size_t eb = dt == DType::kFP32 ? 4 : 2;
      std::vector<uint8_t> init(p.E * nk * eb);
      std::mt19937_64 rng(8);
      for (size_t i = 0; i < init.size(); i += 4) {  // finite fp32 / bf16 pairs
        const float f = float(int(rng() % 2001) - 1000) / 256.0f;
        if (dt == DType::kFP32) std::memcpy(&init[i], &f, 4);
        else { const Bits b = float_to_bf16_bits(f); std::memcpy(&init[i], &b, 2); std::memcpy(&init[i + 2], &b, 2); }
      }
      DeviceBuffer<uint8_t> g1(init);
      std::vector<DeviceBuffer<uint8_t>> g2;
      std::vector<TensorView> g2_views;
      for (int e = 0; e < p.E; ++e) {
        g2.emplace_back(std::vector<uint8_t>(init.begin() + e * nk * eb, init.begin() + (e + 1) * nk * eb));
        g2_views.emplace_back(g2.back().get(), dt, std::initializer_list<int64_t>{p.N, p.K});
      }
      gg.wgrad(p.dy_view(), p.x_view(), p.off_view(),
               ExpertMatrices::grouped(TensorView(g1.get(), dt, {int64_t(p.E), p.N, p.K}), "dw"), acc, stream);
      gg.wgrad(p.dy_view(), p.x_view(), p.off_view(), ExpertMatrices::per_expert(g2_views, "dw"), acc, stream);
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
      const std::vector<uint8_t> a = g1.download();
      for (int e = 0; e < p.E; ++e)
        EXPECT_EQ(std::memcmp(a.data() + e * nk * eb, g2[e].download().data(), nk * eb), 0)
            << "wgrad " << dtype_name(dt) << (acc ? " accumulate" : "") << ": expert " << e << " differs";
    }
  }
}

// Bytes as elements of T.
template <class T>
std::vector<T> elements(const std::vector<uint8_t>& bytes) {
  std::vector<T> v(bytes.size() / sizeof(T));
  std::memcpy(v.data(), bytes.data(), v.size() * sizeof(T));
  return v;
}

// Expert matrices stored transposed (W_e^T [K, N], read through as_transposed()) in both weight
// layouts: fprop, dgrad and the three wgrad epilogues match the CPU reference and are bitwise the
// results of the standard orientation, with uneven and empty groups and N, K not tile multiples.
TEST(GroupedGemm, TransposedExpertMatricesMatchTheStandardOrientation) {
  MOE_REQUIRE_GPU();
  const std::vector<int> sizes = {0, 130, 77, 0, 256, 9};
  const auto off = offsets_from_sizes(sizes);
  Problem p(int(sizes.size()), 136, 264, off.back() + 5, off, 17);
  TestGemm gg(p.E, p.R);
  cudaStream_t stream = nullptr;
  const int64_t nk = p.N * p.K;
  const std::vector<Bits> wt = transpose_experts(p.w, p.E, p.N, p.K);
  DeviceBuffer<Bits> d_wt(wt);
  std::vector<DeviceBuffer<Bits>> wt_sep;
  std::vector<TensorView> wt_views;
  for (int e = 0; e < p.E; ++e) {
    wt_sep.emplace_back(std::vector<Bits>(wt.begin() + e * nk, wt.begin() + (e + 1) * nk));
    wt_views.emplace_back(wt_sep.back().get(), DType::kBF16, std::initializer_list<int64_t>{p.K, p.N});
  }
  const ExpertMatrices grouped_t =
      ExpertMatrices::grouped(TensorView(d_wt.get(), DType::kBF16, {int64_t(p.E), p.K, p.N}), "w").as_transposed();
  const ExpertMatrices per_t = ExpertMatrices::per_expert(wt_views, "w").as_transposed();
  ASSERT_TRUE(grouped_t.transposed() && grouped_t.rows() == p.N && grouped_t.cols() == p.K);

  DeviceBuffer<Bits> y0(p.R * p.N), dx0(p.R * p.K);
  gg.fprop(p.x_view(), p.w_grouped(), p.off_view(), TensorView(y0.get(), DType::kBF16, {p.R, p.N}), stream);
  gg.dgrad(p.dy_view(), p.w_grouped(), p.off_view(), TensorView(dx0.get(), DType::kBF16, {p.R, p.K}), stream);
  const std::vector<Bits> y_std = y0.download(), dx_std = dx0.download();
  for (const ExpertMatrices* w : {&grouped_t, &per_t}) {
    const std::string what = w == &grouped_t ? "grouped, transposed" : "per expert, transposed";
    DeviceBuffer<Bits> y(p.R * p.N), dx(p.R * p.K);
    y.fill_bytes(0xFF);
    dx.fill_bytes(0xFF);
    gg.fprop(p.x_view(), *w, p.off_view(), TensorView(y.get(), DType::kBF16, {p.R, p.N}), stream);
    gg.dgrad(p.dy_view(), *w, p.off_view(), TensorView(dx.get(), DType::kBF16, {p.R, p.K}), stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::vector<Bits> yg = y.download(), dxg = dx.download();
    check_rows_bf16(yg, expect_fprop(p), p.used_rows(), p.N, what + " fprop");
    check_rows_bf16(dxg, expect_dgrad(p), p.used_rows(), p.K, what + " dgrad");
    for (int64_t i = 0; i < p.used_rows() * p.N; ++i) ASSERT_EQ(yg[i], y_std[i]) << what << " fprop element " << i;
    for (int64_t i = 0; i < p.used_rows() * p.K; ++i) ASSERT_EQ(dxg[i], dx_std[i]) << what << " dgrad element " << i;
  }

  // wgrad into transposed gradients [E, K, N]: bf16 and fp32 written (empty experts zero-filled
  // over poison), fp32 accumulated (empty experts untouched); compared in the [E, N, K] order.
  const Expected ex = expect_wgrad(p);
  std::mt19937_64 rng(5);
  const std::vector<float> prior = random_f32(p.E * nk, rng);
  for (int mode = 0; mode < 3; ++mode) {
    const bool acc = mode == 2;
    const DType dt = mode == 0 ? DType::kBF16 : DType::kFP32;
    const size_t eb = mode == 0 ? 2 : 4;
    DeviceBuffer<uint8_t> g_std(p.E * nk * eb), g_t(p.E * nk * eb);
    if (acc) {
      std::vector<uint8_t> a(p.E * nk * 4), b(p.E * nk * 4);
      const std::vector<float> prior_t = transpose_experts(prior, p.E, p.N, p.K);
      std::memcpy(a.data(), prior.data(), a.size());
      std::memcpy(b.data(), prior_t.data(), b.size());
      g_std = DeviceBuffer<uint8_t>(a);
      g_t = DeviceBuffer<uint8_t>(b);
    } else {
      g_std.fill_bytes(0xFF);
      g_t.fill_bytes(0xFF);
    }
    gg.wgrad(p.dy_view(), p.x_view(), p.off_view(),
             ExpertMatrices::grouped(TensorView(g_std.get(), dt, {int64_t(p.E), p.N, p.K}), "dw"), acc, stream);
    gg.wgrad(p.dy_view(), p.x_view(), p.off_view(),
             ExpertMatrices::grouped(TensorView(g_t.get(), dt, {int64_t(p.E), p.K, p.N}), "dw").as_transposed(), acc,
             stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const std::string what = std::string("wgrad ") + dtype_name(dt) + (acc ? " accumulate" : "");
    if (mode == 0) {
      const std::vector<Bits> got = transpose_experts(elements<Bits>(g_t.download()), p.E, p.K, p.N);
      check_wgrad_bf16(got, ex, what);
      EXPECT_EQ(got, elements<Bits>(g_std.download())) << what;
    } else {
      const std::vector<float> got = transpose_experts(elements<float>(g_t.download()), p.E, p.K, p.N);
      check_wgrad_f32(got, ex, acc ? prior : std::vector<float>(), what);
      EXPECT_EQ(std::memcmp(got.data(), elements<float>(g_std.download()).data(), got.size() * 4), 0) << what;
    }
  }
}

TEST(GroupedGemm, GraphReplayWithNewGroupSizesEqualsEager) {
  MOE_REQUIRE_GPU();
  const int E = 6;
  const int64_t N = 72, K = 136, R = 800;
  // Capture with one set of group sizes, replay with others (including empty experts) and new data.
  const auto off_a = offsets_from_sizes({100, 100, 100, 100, 100, 100});
  const auto off_b = offsets_from_sizes({0, 311, 5, 0, 290, 64});
  Problem p(E, N, K, R, off_a, 11);
  TestGemm gg(E, R);
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  DeviceBuffer<Bits> y(R * N), dx(R * K), dw(E * N * K);
  DeviceBuffer<float> mg(E * N * K);
  const ExpertMatrices dw_m = ExpertMatrices::grouped(TensorView(dw.get(), DType::kBF16, {E, N, K}), "dw");
  const ExpertMatrices mg_m = ExpertMatrices::grouped(TensorView(mg.get(), DType::kFP32, {E, N, K}), "main_grad");
  auto step = [&] {
    gg.fprop(p.x_view(), p.w_grouped(), p.off_view(), TensorView(y.get(), DType::kBF16, {R, N}), stream);
    gg.dgrad(p.dy_view(), p.w_grouped(), p.off_view(), TensorView(dx.get(), DType::kBF16, {R, K}), stream);
    gg.wgrad(p.dy_view(), p.x_view(), p.off_view(), dw_m, false, stream);
    gg.wgrad(p.dy_view(), p.x_view(), p.off_view(), mg_m, true, stream);
  };
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  step();
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  std::mt19937_64 rng(12);
  const std::vector<float> mg0 = random_f32(E * N * K, rng);
  auto reset_outputs = [&] {
    y.fill_bytes(0xFF);
    dx.fill_bytes(0xFF);
    dw.fill_bytes(0xFF);
    mg.upload(mg0);
  };
  // New routing and data in the same buffers (the graph holds their addresses).
  p.off = off_b;
  p.d_off.upload(off_b);
  p.x = random_bf16(R * K, rng);
  p.d_x.upload(p.x);
  p.dy = random_bf16(R * N, rng);
  p.d_dy.upload(p.dy);

  reset_outputs();
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto gy = y.download(), gdx = dx.download(), gdw = dw.download();
  const auto gmg = mg.download();

  reset_outputs();
  step();
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(gy, y.download());
  EXPECT_EQ(gdx, dx.download());
  EXPECT_EQ(gdw, dw.download());
  EXPECT_EQ(std::memcmp(gmg.data(), mg.download().data(), gmg.size() * sizeof(float)), 0);
  // And the replay is right, not merely repeatable.
  check_rows_bf16(gy, expect_fprop(p), p.used_rows(), N, "graph fprop");
  check_rows_bf16(gdx, expect_dgrad(p), p.used_rows(), K, "graph dgrad");
  check_wgrad_bf16(gdw, expect_wgrad(p), "graph wgrad");
  check_wgrad_f32(gmg, expect_wgrad(p), mg0, "graph wgrad accumulate");

  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

using ::moe::testing::expect_error_naming;

const char* const kRowsConfigs[] = {"rows_coop_128x256x64_c2x1", "rows_pong_64x256x64_c2x1",
                                    "rows_pong_128x192x64_c2x1"};

// The rows GEMM (our own kernel for the token-side products, src/fused/rows_gemm.cu) in its three
// schedules, fprop form (B K-major) and dgrad form (B MN-major): 40 uneven groups (empty, one row,
// odd and even numbers of row blocks, so the split of an odd last block between the cluster's CTAs
// runs, with an odd number of output blocks: 3 of 256 and of 192 columns), a reduction that ends
// inside a k block, six SMs (every CTA takes many tiles: the ping-pong warp groups alternate over
// many turns) and all of them. Checked against the reference, rows past the groups untouched; the
// two 256-column schedules give the same bits, and the transposed weights (the other form of the
// same product) the same bits as the standard ones.
TEST(GroupedGemm, RowsKernelsManyTilesOddBlocksBothForms) {
  MOE_REQUIRE_GPU();
  std::vector<int> sizes;
  for (int e = 0; e < 40; ++e) sizes.push_back(e % 7 == 3 ? 0 : e % 11 == 5 ? 1 : 17 + (e * 53) % 300);
  const auto off = offsets_from_sizes(sizes);
  Problem p(int(sizes.size()), 520, 136, off.back() + 5, off, 23);
  const std::vector<Bits> wt = transpose_experts(p.w, p.E, p.N, p.K);
  DeviceBuffer<Bits> d_wt(wt);
  const ExpertMatrices w_t =
      ExpertMatrices::grouped(TensorView(d_wt.get(), DType::kBF16, {int64_t(p.E), p.K, p.N}), "w").as_transposed();
  const Expected ex_f = expect_fprop(p), ex_d = expect_dgrad(p);
  for (int sms : {6, 0}) {
    TestGemm gg(p.E, p.R, sms);
    std::vector<std::vector<Bits>> ys, dxs;
    for (const char* name : kRowsConfigs) {
      const std::string what = std::string(name) + " on " + (sms ? std::to_string(sms) : std::string("all")) + " SMs";
      gg.force_config(GemmOp::kFprop, name);
      gg.force_config(GemmOp::kDgrad, name);
      EXPECT_EQ(gg.chosen_config(GemmOp::kFprop, p.N, p.K), std::string(name) + "/M");
      ys.push_back(run_bf16(gg, p, GemmOp::kFprop));
      dxs.push_back(run_bf16(gg, p, GemmOp::kDgrad));
      check_rows_bf16(ys.back(), ex_f, p.used_rows(), p.N, what + " fprop");
      check_rows_bf16(dxs.back(), ex_d, p.used_rows(), p.K, what + " dgrad");
      // Transposed weights: fprop runs the dgrad form, dgrad the fprop form.
      DeviceBuffer<Bits> y(p.R * p.N), dx(p.R * p.K);
      y.fill_bytes(0xFF);
      dx.fill_bytes(0xFF);
      gg.fprop(p.x_view(), w_t, p.off_view(), TensorView(y.get(), DType::kBF16, {p.R, p.N}), nullptr);
      gg.dgrad(p.dy_view(), w_t, p.off_view(), TensorView(dx.get(), DType::kBF16, {p.R, p.K}), nullptr);
      MOE_CUDA_CHECK(cudaDeviceSynchronize());
      EXPECT_TRUE(y.download() == ys.back()) << what << ": fprop on transposed weights";
      EXPECT_TRUE(dx.download() == dxs.back()) << what << ": dgrad on transposed weights";
    }
    EXPECT_TRUE(ys[0] == ys[1]) << "the two 256-column schedules' fprop differ";
    EXPECT_TRUE(dxs[0] == dxs[1]) << "the two 256-column schedules' dgrad differ";
  }
}

// Calls the rows GEMM does not take run the heuristic's kernel even when it is forced: per-expert
// weight tables (no single tensor map) and calls without rows; and every expert empty (the kernel
// runs no tile: nothing may hang or be written). All give the reference's results.
TEST(GroupedGemm, RowsKernelsFallBackWhereTheyDoNotApply) {
  MOE_REQUIRE_GPU();
  const auto off = offsets_from_sizes({130, 0, 77, 256, 9});
  Problem p(5, 136, 264, off.back(), off, 29);
  std::vector<DeviceBuffer<Bits>> w_sep;
  const ExpertMatrices w_per = p.w_per_expert(&w_sep);
  TestGemm gg(p.E, p.R);
  for (const char* name : kRowsConfigs) {
    gg.force_config(GemmOp::kFprop, name);
    gg.force_config(GemmOp::kDgrad, name);
    DeviceBuffer<Bits> y(p.R * p.N), dx(p.R * p.K);
    gg.fprop(p.x_view(), w_per, p.off_view(), TensorView(y.get(), DType::kBF16, {p.R, p.N}), nullptr);
    gg.dgrad(p.dy_view(), w_per, p.off_view(), TensorView(dx.get(), DType::kBF16, {p.R, p.K}), nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    check_rows_bf16(y.download(), expect_fprop(p), p.used_rows(), p.N, std::string(name) + " per-expert fprop");
    check_rows_bf16(dx.download(), expect_dgrad(p), p.used_rows(), p.K, std::string(name) + " per-expert dgrad");
  }
  const Problem empty(4, 16, 24, 64, {0, 0, 0, 0, 0}, 3), none(3, 16, 24, 0, {0, 0, 0, 0}, 4);
  TestGemm g4(4, 64);
  for (const char* name : kRowsConfigs) {
    g4.force_config(GemmOp::kFprop, name);
    g4.force_config(GemmOp::kDgrad, name);
    for (const Problem* q : {&empty, &none}) {
      check_fprop(g4, *q, std::string(name) + (q == &empty ? " all empty" : " zero rows"));
      check_dgrad(g4, *q, std::string(name) + (q == &empty ? " all empty" : " zero rows"));
    }
  }
}

// Windows of a's rows (GemmProblem::a_row_begin) through the rows GEMM, fprop and dgrad: every
// window starts 16 rows after its group, on copies of x and dy shifted by 16 rows, so the output is
// bitwise the plain call's (a kernel that ignored the windows would read other rows); then the last
// expert's window starts 40 rows further and runs past the end of a: its rows past it are neither
// read nor written, its other rows are the plain call's rows 40 further on, and
// kErrBadGroupOffsets is raised.
TEST(GroupedGemm, RowsKernelsReadWindowsOfRows) {
  MOE_REQUIRE_GPU();
  const auto off = offsets_from_sizes({130, 0, 77, 256, 90});
  Problem p(5, 136, 264, off.back(), off, 37);  // no rows past the groups: every shifted row is computed
  constexpr int64_t kShift = 16;
  const auto shifted = [&](const std::vector<Bits>& v, int64_t cols) {
    std::vector<Bits> out(kShift * cols, kPoison);
    out.insert(out.end(), v.begin(), v.end());
    return DeviceBuffer<Bits>(out);
  };
  const DeviceBuffer<Bits> x_s = shifted(p.x, p.K), dy_s = shifted(p.dy, p.N);
  std::vector<int32_t> begin_rows(off.begin(), off.end() - 1);
  for (int32_t& b : begin_rows) b += kShift;
  std::vector<int32_t> past = begin_rows;
  past.back() += 40;  // the last group (90 rows) now ends 40 rows past a's end
  const DeviceBuffer<int32_t> begin(begin_rows), begin_past(past);
  TestGemm gg(p.E, p.R + kShift);
  ErrorWord ew;
  for (const char* name : kRowsConfigs)
    for (GemmOp op : {GemmOp::kFprop, GemmOp::kDgrad}) {
      const std::string what = std::string(name) + " " + gemm_op_name(op);
      gg.force_config(op, name);
      const int64_t in_cols = op == GemmOp::kFprop ? p.K : p.N, out_cols = op == GemmOp::kFprop ? p.N : p.K;
      const std::vector<Bits> plain = run_bf16(gg, p, op);
      for (const DeviceBuffer<int32_t>* b : {&begin, &begin_past}) {
        DeviceBuffer<Bits> out(p.R * out_cols);
        out.fill_bytes(0xFF);
        GemmProblem pr;
        pr.op = op;
        pr.a = TensorView((op == GemmOp::kFprop ? x_s : dy_s).get(), DType::kBF16, {p.R + kShift, in_cols});
        pr.w = p.w_grouped();
        pr.d = TensorView(out.get(), DType::kBF16, {p.R, out_cols});
        pr.group_offsets = p.off_view();
        pr.a_row_begin = TensorView(b->get(), DType::kInt32, {int64_t(p.E)});
        pr.error_word = ew.device_ptr();
        gg.gg.run(pr, gg.workspace(), nullptr);
        const bool clamped = ew.fetch_and_clear(nullptr) != 0;
        const std::vector<Bits> got = out.download();
        // Rows of a after the last window's start: R + 16 - (off[4] + 16 + 40) = 90 - 40 = 50.
        const int64_t kept_end = b == &begin ? p.used_rows() : off[4] + (p.R - off[4] - 40);
        EXPECT_EQ(clamped, b == &begin_past) << what;
        for (int64_t i = 0; i < p.R * out_cols; ++i) {
          const int64_t r = i / out_cols;
          // The last group's rows come from 40 rows further down in the window past a's end.
          const int64_t from = b == &begin_past && r >= off[4] ? i + 40 * out_cols : i;
          const Bits want = r < kept_end ? plain[from] : kPoison;
          if (got[i] != want) {
            ADD_FAILURE() << what << (b == &begin ? " windows" : " window past a's end") << ": row " << r
                          << " column " << i % out_cols << " differs";
            break;
          }
        }
      }
      gg.force_config(op, "");
    }
}

// The rows GEMM in a captured graph replayed with new group sizes and data: bitwise the eager
// call's results, and right.
TEST(GroupedGemm, RowsKernelsGraphReplayWithNewGroupSizes) {
  MOE_REQUIRE_GPU();
  const int E = 6;
  const int64_t N = 264, K = 136, R = 800;
  Problem p(E, N, K, R, offsets_from_sizes({100, 100, 100, 100, 100, 100}), 31);
  const auto off_b = offsets_from_sizes({0, 311, 5, 0, 290, 64});
  TestGemm gg(E, R);
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  for (const char* name : kRowsConfigs) {
    gg.force_config(GemmOp::kFprop, name);
    gg.force_config(GemmOp::kDgrad, name);
    DeviceBuffer<Bits> y(R * N), dx(R * K);
    auto step = [&] {
      gg.fprop(p.x_view(), p.w_grouped(), p.off_view(), TensorView(y.get(), DType::kBF16, {R, N}), stream);
      gg.dgrad(p.dy_view(), p.w_grouped(), p.off_view(), TensorView(dx.get(), DType::kBF16, {R, K}), stream);
    };
    p.off = offsets_from_sizes({100, 100, 100, 100, 100, 100});
    p.d_off.upload(p.off);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    step();
    MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::mt19937_64 rng(32);
    p.off = off_b;
    p.d_off.upload(off_b);
    p.x = random_bf16(R * K, rng);
    p.d_x.upload(p.x);
    p.dy = random_bf16(R * N, rng);
    p.d_dy.upload(p.dy);
    y.fill_bytes(0xFF);
    dx.fill_bytes(0xFF);
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    const auto gy = y.download(), gdx = dx.download();
    y.fill_bytes(0xFF);
    dx.fill_bytes(0xFF);
    step();
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_TRUE(gy == y.download()) << name << ": replayed fprop differs from eager";
    EXPECT_TRUE(gdx == dx.download()) << name << ": replayed dgrad differs from eager";
    check_rows_bf16(gy, expect_fprop(p), p.used_rows(), N, std::string(name) + " graph fprop");
    check_rows_bf16(gdx, expect_dgrad(p), p.used_rows(), K, std::string(name) + " graph dgrad");
    MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
    MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  }
  MOE_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST(GroupedGemm, RejectsUnsupportedArgumentsBeforeLaunch) {
  MOE_REQUIRE_GPU();
  const int E = 2;
  DeviceBuffer<Bits> buf(64 * 64 * 4);
  DeviceBuffer<float> fbuf(64 * 64 * 2);
  DeviceBuffer<int32_t> off(std::vector<int32_t>{0, 10, 20});
  Bits* b = buf.get();
  const TensorView offs(off.get(), DType::kInt32, {E + 1});
  const ExpertMatrices w = ExpertMatrices::grouped(TensorView(b, DType::kBF16, {E, 16, 32}), "w");
  TestGemm gg(E, 64);
  cudaStream_t s = nullptr;
  // K not a multiple of 8 (TMA needs 16-byte rows).
  expect_error_naming([&] { gg.fprop(TensorView(b, DType::kBF16, {64, 12}), w, offs, TensorView(b, DType::kBF16, {64, 16}), s); }, "'x'");
  // Weight K differs from x's K.
  expect_error_naming([&] { gg.fprop(TensorView(b, DType::kBF16, {64, 40}), w, offs, TensorView(b, DType::kBF16, {64, 16}), s); }, "'w'");
  // Output of the wrong shape / dtype.
  expect_error_naming([&] { gg.fprop(TensorView(b, DType::kBF16, {64, 32}), w, offs, TensorView(b, DType::kBF16, {64, 24}), s); }, "'y'");
  expect_error_naming([&] { gg.fprop(TensorView(b, DType::kBF16, {64, 32}), w, offs, TensorView(fbuf.get(), DType::kFP32, {64, 16}), s); }, "'y'");
  // Misaligned operand.
  expect_error_naming([&] { gg.fprop(TensorView(b + 1, DType::kBF16, {64, 32}), w, offs, TensorView(b, DType::kBF16, {64, 16}), s); }, "'x'");
  // More rows than the bound, offsets of the wrong length or dtype.
  expect_error_naming([&] { gg.fprop(TensorView(b, DType::kBF16, {65, 32}), w, offs, TensorView(b, DType::kBF16, {65, 16}), s); }, "'x'");
  expect_error_naming([&] { gg.fprop(TensorView(b, DType::kBF16, {64, 32}), w, TensorView(off.get(), DType::kInt32, {E}), TensorView(b, DType::kBF16, {64, 16}), s); }, "'group_offsets'");
  expect_error_naming([&] { gg.fprop(TensorView(b, DType::kBF16, {64, 32}), w, TensorView(off.get(), DType::kInt64, {E + 1}), TensorView(b, DType::kBF16, {64, 16}), s); }, "'group_offsets'");
  // More experts than the bound.
  const ExpertMatrices w3 = ExpertMatrices::grouped(TensorView(b, DType::kBF16, {3, 16, 32}), "w");
  expect_error_naming([&] { gg.fprop(TensorView(b, DType::kBF16, {64, 32}), w3, TensorView(off.get(), DType::kInt32, {4}), TensorView(b, DType::kBF16, {64, 16}), s); }, "'experts'");
  // dgrad: dy's N must match the weights.
  expect_error_naming([&] { gg.dgrad(TensorView(b, DType::kBF16, {64, 24}), w, offs, TensorView(b, DType::kBF16, {64, 32}), s); }, "'w'");
  // wgrad: accumulation needs fp32; unsupported output dtype; x with other rows than dy.
  const ExpertMatrices dw16 = ExpertMatrices::grouped(TensorView(b, DType::kBF16, {E, 16, 32}), "dw");
  expect_error_naming([&] { gg.wgrad(TensorView(b, DType::kBF16, {64, 16}), TensorView(b, DType::kBF16, {64, 32}), offs, dw16, true, s); }, "'dw'");
  const ExpertMatrices dw8 = ExpertMatrices::grouped(TensorView(b, DType::kFP8E4M3, {E, 16, 32}), "dw");
  expect_error_naming([&] { gg.wgrad(TensorView(b, DType::kBF16, {64, 16}), TensorView(b, DType::kBF16, {64, 32}), offs, dw8, false, s); }, "'dw'");
  expect_error_naming([&] { gg.wgrad(TensorView(b, DType::kBF16, {64, 16}), TensorView(b, DType::kBF16, {32, 32}), offs, dw16, false, s); }, "'x'");
  // Per-expert tables check every tensor.
  expect_error_naming([&] { ExpertMatrices::per_expert({TensorView(b, DType::kBF16, {16, 32}), TensorView(b, DType::kBF16, {16, 24})}, "w"); }, "'w1'");
  expect_error_naming([&] { ExpertMatrices::per_expert({TensorView(b, DType::kBF16, {16, 32}), TensorView(b + 4, DType::kBF16, {16, 32})}, "w"); }, "'w1'");
  expect_error_naming([&] { gg.force_config(GemmOp::kFprop, "no_such_tile"); }, "no_such_tile");
  // The per-call workspace: missing, too small, misaligned.
  const TensorView x(b, DType::kBF16, {64, 32}), y(b, DType::kBF16, {64, 16});
  expect_error_naming([&] { gg.gg.fprop(x, w, offs, y, TensorView(), s); }, "'workspace'");
  expect_error_naming(
      [&] { gg.gg.fprop(x, w, offs, y, TensorView(gg.ws.get(), DType::kUInt8, {int64_t(gg.ws.size()) - 256}), s); },
      "'workspace'");
  expect_error_naming(
      [&] { gg.gg.fprop(x, w, offs, y, TensorView(gg.ws.get() + 16, DType::kUInt8, {int64_t(gg.ws.size()) - 16}), s); },
      "'workspace'");
}

// Offsets that had to be clamped (not 0-based, decreasing, past the rows) are reported through the
// optional error word; valid offsets raise nothing.
TEST(GroupedGemm, BadGroupOffsetsAreReported) {
  MOE_REQUIRE_GPU();
  const int E = 3;
  const int64_t N = 16, K = 32, R = 64;
  DeviceBuffer<Bits> x(R * K), w(E * N * K), y(R * N);
  x.fill_bytes(0);
  w.fill_bytes(0);
  TestGemm gg(E, R);
  ErrorWord ew;
  const ExpertMatrices wm = ExpertMatrices::grouped(TensorView(w.get(), DType::kBF16, {E, N, K}), "w");
  // The heuristic's CUTLASS kernel (the prep kernel reports) and the rows GEMM (its first CTA does).
  for (const char* config : {"", kRowsConfigs[0], kRowsConfigs[1], kRowsConfigs[2]})
  for (auto [offs, bad] : {std::pair<std::vector<int32_t>, bool>{{0, 10, 20, 64}, false},
                           {{0, 30, 20, 40}, true},
                           {{4, 10, 20, 30}, true},
                           {{0, 10, 20, 65}, true}}) {
    DeviceBuffer<int32_t> off(offs);
    GemmProblem p;
    p.op = GemmOp::kFprop;
    p.a = TensorView(x.get(), DType::kBF16, {R, K});
    p.w = wm;
    p.d = TensorView(y.get(), DType::kBF16, {R, N});
    p.group_offsets = TensorView(off.get(), DType::kInt32, {E + 1});
    p.error_word = ew.device_ptr();
    gg.force_config(GemmOp::kFprop, config);
    gg.gg.run(p, gg.workspace(), nullptr);
    EXPECT_EQ(ew.fetch_and_clear(nullptr) != 0, bad)
        << config << ": " << offs[0] << " " << offs[1] << " " << offs[2] << " " << offs[3];
  }
}

// One engine shared by two "layers" on two streams at once: each call brings its own workspace, so
// the launches cannot race on argument arrays or CUTLASS state (run under racecheck too).
TEST(GroupedGemm, TwoStreamsShareOneEngine) {
  MOE_REQUIRE_GPU();
  const int E = 5;
  const int64_t N = 136, K = 264, R = 1200;
  Problem pa(E, N, K, R, offsets_from_sizes({200, 0, 350, 101, 300}), 21);
  Problem pb(E, N, K, R, offsets_from_sizes({0, 512, 13, 400, 7}), 22);
  GroupedGemm gg(E, R);
  DeviceBuffer<uint8_t> wsa(gg.workspace_bytes()), wsb(gg.workspace_bytes());
  const TensorView va(wsa.get(), DType::kUInt8, {int64_t(wsa.size())}), vb(wsb.get(), DType::kUInt8, {int64_t(wsb.size())});
  cudaStream_t sa, sb;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&sa, cudaStreamNonBlocking));
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&sb, cudaStreamNonBlocking));
  DeviceBuffer<Bits> ya(R * N), yb(R * N), dxa(R * K), dxb(R * K), dwa(E * N * K), dwb(E * N * K);
  for (auto* b : {&ya, &yb, &dxa, &dxb, &dwa, &dwb}) b->fill_bytes(0xFF);
  for (int rep = 0; rep < 3; ++rep) {  // several rounds, enqueued interleaved on both streams
    gg.fprop(pa.x_view(), pa.w_grouped(), pa.off_view(), TensorView(ya.get(), DType::kBF16, {R, N}), va, sa);
    gg.fprop(pb.x_view(), pb.w_grouped(), pb.off_view(), TensorView(yb.get(), DType::kBF16, {R, N}), vb, sb);
    gg.dgrad(pa.dy_view(), pa.w_grouped(), pa.off_view(), TensorView(dxa.get(), DType::kBF16, {R, K}), va, sa);
    gg.dgrad(pb.dy_view(), pb.w_grouped(), pb.off_view(), TensorView(dxb.get(), DType::kBF16, {R, K}), vb, sb);
    gg.wgrad(pa.dy_view(), pa.x_view(), pa.off_view(),
             ExpertMatrices::grouped(TensorView(dwa.get(), DType::kBF16, {E, N, K}), "dw"), false, va, sa);
    gg.wgrad(pb.dy_view(), pb.x_view(), pb.off_view(),
             ExpertMatrices::grouped(TensorView(dwb.get(), DType::kBF16, {E, N, K}), "dw"), false, vb, sb);
  }
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  check_rows_bf16(ya.download(), expect_fprop(pa), pa.used_rows(), N, "stream a fprop");
  check_rows_bf16(yb.download(), expect_fprop(pb), pb.used_rows(), N, "stream b fprop");
  check_rows_bf16(dxa.download(), expect_dgrad(pa), pa.used_rows(), K, "stream a dgrad");
  check_rows_bf16(dxb.download(), expect_dgrad(pb), pb.used_rows(), K, "stream b dgrad");
  check_wgrad_bf16(dwa.download(), expect_wgrad(pa), "stream a wgrad");
  check_wgrad_bf16(dwb.download(), expect_wgrad(pb), "stream b wgrad");
  MOE_CUDA_CHECK(cudaStreamDestroy(sa));
  MOE_CUDA_CHECK(cudaStreamDestroy(sb));
}

}  // namespace
}  // namespace moe
