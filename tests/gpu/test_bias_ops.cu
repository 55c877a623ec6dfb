// GPU per-expert bias kernels: bias_add (bitwise against an fp32 emulation of its one fma), the
// bias gradients (against fp64 sums; written, accumulated into main_grad, or bf16) and the bias's
// share of dprobs, in both weight layouts (bitwise equal), with empty experts, pad rows, rows past
// group_offsets[E] untouched, graph capture + replay, and argument errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe/bias_ops.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "support/gpu.h"
#include "support/expect_error.h"

namespace moe {
namespace {

using testing::DeviceBuffer;

using ::moe::testing::expect_error_naming;

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Offsets of experts with `counts` rows each, padded to `align` (pad rows carry p = 0, dy = 0).
std::vector<int32_t> padded_offsets(const std::vector<int>& counts, int align) {
  std::vector<int32_t> off{0};
  for (int c : counts) off.push_back(off.back() + (align ? (c + align - 1) / align * align : c));
  return off;
}

// A grouped problem on the host: R rows of N columns, E experts, bf16 data as bits.
struct Problem {
  int64_t R = 0, N = 0;
  int E = 0;
  std::vector<int32_t> offsets;  // [E + 1]
  std::vector<int> counts;       // real rows per expert (the rest of its group is padding)
  std::vector<uint16_t> y;       // [R, N] (the GEMM output / dY)
  std::vector<uint16_t> bias;    // [E, N]
  std::vector<float> probs;      // [R], 0 on pad rows
  int64_t valid() const { return std::min<int64_t>(offsets.back(), R); }
  int expert_of(int64_t r) const {
    for (int e = 0; e < E; ++e)
      if (r >= offsets[e] && r < offsets[e + 1]) return e;
    return -1;
  }
  bool is_pad(int64_t r) const {
    int e = expert_of(r);
    return e < 0 || r >= offsets[e] + counts[e];
  }
};

Problem make_problem(std::vector<int> counts, int align, int64_t extra_rows, int64_t N, uint64_t seed) {
  Problem P;
  P.counts = counts;
  P.E = static_cast<int>(counts.size());
  P.offsets = padded_offsets(counts, align);
  P.R = P.offsets.back() + extra_rows;
  P.N = N;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f), up(0.05f, 1.0f);
  P.y.resize(P.R * N);
  P.probs.resize(P.R);
  for (int64_t r = 0; r < P.R; ++r) {
    const bool pad = r < P.offsets.back() && P.is_pad(r);
    P.probs[r] = pad ? 0.0f : up(rng);
    for (int64_t j = 0; j < N; ++j) P.y[r * N + j] = pad ? 0 : float_to_bf16_bits(u(rng));
  }
  // Rows past the valid total hold garbage (NaN) that must never be read.
  for (int64_t r = P.offsets.back(); r < P.R; ++r) {
    P.probs[r] = std::nanf("");
    for (int64_t j = 0; j < N; ++j) P.y[r * N + j] = 0x7FC0;
  }
  P.bias.resize(P.E * N);
  for (auto& b : P.bias) b = float_to_bf16_bits(u(rng));
  return P;
}

double bf(uint16_t b) { return bf16_bits_to_float(b); }

// The bias rows in both layouts on the device.
struct DeviceBias {
  DeviceBuffer<uint16_t> stacked;
  std::vector<DeviceBuffer<uint16_t>> rows;
  DeviceBuffer<void*> table;
  explicit DeviceBias(const Problem& P) : stacked(P.bias) {
    std::vector<void*> ptrs;
    for (int e = 0; e < P.E; ++e) {
      rows.emplace_back(std::vector<uint16_t>(P.bias.begin() + e * P.N, P.bias.begin() + (e + 1) * P.N));
      ptrs.push_back(rows.back().get());
    }
    table = DeviceBuffer<void*>(ptrs);
  }
  void upload(const Problem& P) {
    stacked.upload(P.bias);
    for (int e = 0; e < P.E; ++e)
      rows[e].upload(std::vector<uint16_t>(P.bias.begin() + e * P.N, P.bias.begin() + (e + 1) * P.N));
  }
  ExpertRows grouped(const Problem& P) const {
    return ExpertRows::single_grouped(TensorView(stacked.get(), DType::kBF16, {P.E, P.N}));
  }
  ExpertRows per_expert(const Problem& P) const { return ExpertRows::per_expert(table.get(), DType::kBF16, P.E, P.N); }
};

// Gradient rows in both layouts (fp32 or bf16).
template <typename T>
struct DeviceGrad {
  DeviceBuffer<T> stacked;
  std::vector<DeviceBuffer<T>> rows;
  DeviceBuffer<void*> table;
  int E;
  int64_t N;
  DeviceGrad(int E_, int64_t N_) : stacked(E_ * N_), E(E_), N(N_) {
    std::vector<void*> ptrs;
    for (int e = 0; e < E; ++e) {
      rows.emplace_back(N);
      ptrs.push_back(rows.back().get());
    }
    table = DeviceBuffer<void*>(ptrs);
  }
  DType dtype() const { return sizeof(T) == 4 ? DType::kFP32 : DType::kBF16; }
  ExpertRows grouped() const { return ExpertRows::single_grouped(TensorView(stacked.get(), dtype(), {E, N})); }
  ExpertRows per_expert() const { return ExpertRows::per_expert(table.get(), dtype(), E, N); }
  void set(const std::vector<T>& v) {
    stacked.upload(v);
    for (int e = 0; e < E; ++e) rows[e].upload(std::vector<T>(v.begin() + e * N, v.begin() + (e + 1) * N));
  }
  std::vector<T> get_stacked() const { return stacked.download(); }
  std::vector<T> get_rows() const {
    std::vector<T> out;
    for (int e = 0; e < E; ++e) {
      std::vector<T> r = rows[e].download();
      out.insert(out.end(), r.begin(), r.end());
    }
    return out;
  }
};

struct Views {
  TensorView y, probs, off;
};

const std::vector<std::vector<int>> kGroupings = {
    {0, 300, 7, 0, 140},  // empty experts, multi-chunk experts (300 = 128 + 128 + 44)
    {513},                // one expert takes every row
    {1, 1, 1},
};

TEST(BiasOps, AddMatchesFp32EmulationBothLayouts) {
  MOE_REQUIRE_GPU();
  for (const auto& counts : kGroupings) {
    for (int64_t N : {int64_t(40), int64_t(2056)}) {
      for (bool scaled : {true, false}) {
        SCOPED_TRACE("E=" + std::to_string(counts.size()) + " N=" + std::to_string(N) + (scaled ? " p*b" : " b"));
        Problem P = make_problem(counts, 16, 13, N, 7 + N);
        DeviceBias B(P);
        DeviceBuffer<int32_t> off(P.offsets);
        DeviceBuffer<float> probs(P.probs);
        TensorView voff(off.get(), DType::kInt32, {P.E + 1});
        TensorView vprobs = scaled ? TensorView(probs.get(), DType::kFP32, {P.R}) : TensorView();
        std::vector<std::vector<uint16_t>> results;
        for (int layout = 0; layout < 2; ++layout) {
          DeviceBuffer<uint16_t> y(P.y);
          bias_add(TensorView(y.get(), DType::kBF16, {P.R, P.N}), layout ? B.per_expert(P) : B.grouped(P), vprobs,
                   voff, nullptr);
          results.push_back(y.download());
        }
        EXPECT_EQ(results[0], results[1]) << "single-grouped and per-expert layouts differ";
        int bad = 0;
        for (int64_t r = 0; r < P.R && bad < 10; ++r) {
          const int e = P.expert_of(r);
          for (int64_t j = 0; j < N; ++j) {
            uint16_t want = P.y[r * N + j];  // rows past the total: untouched
            if (r < P.valid()) {
              // Exact: one correctly rounded fp32 fma, then one bf16 rounding (RNE), on both sides.
              const float p = scaled ? P.probs[r] : 1.0f;
              want = float_to_bf16_bits(std::fmaf(p, bf16_bits_to_float(P.bias[e * N + j]), bf16_bits_to_float(want)));
            }
            if (results[0][r * N + j] != want) {
              ++bad;
              ADD_FAILURE() << "y[" << r << "," << j << "] = 0x" << std::hex << results[0][r * N + j] << ", want 0x"
                            << want << std::dec;
            }
          }
        }
      }
    }
  }
}

// db_e against fp64 sums. fp32 sums of n terms: within a chunk each thread adds <= 128 / ry rows,
// then ry lanes, then the chunks: <= (128 + 32 + chunks) * 2^-24 * sum|terms| < 1e-5 * sum|terms|.
void check_grad(const Problem& P, bool scaled, const std::vector<float>& before, const std::vector<float>& got,
                bool accumulate, bool bf16_out, const std::vector<uint16_t>& got_bf16) {
  int bad = 0;
  for (int e = 0; e < P.E && bad < 10; ++e) {
    for (int64_t j = 0; j < P.N; ++j) {
      double sum = 0, mag = 0;
      for (int64_t r = P.offsets[e]; r < P.offsets[e + 1]; ++r) {
        double t = (scaled ? P.probs[r] : 1.0) * bf(P.y[r * P.N + j]);
        sum += t;
        mag += std::fabs(t);
      }
      const bool empty = P.offsets[e] == P.offsets[e + 1];
      double want = sum, g;
      if (bf16_out) {
        g = bf16_bits_to_float(got_bf16[e * P.N + j]);
        // bf16 rounding of the fp32 sum: 2^-8 relative (as in the activation tests).
        if (!(std::fabs(g - want) <= std::ldexp(std::fabs(want), -8) + 1e-5 * mag)) {
          ++bad;
          ADD_FAILURE() << "db[" << e << "," << j << "] = " << g << ", reference " << want;
        }
        continue;
      }
      g = got[e * P.N + j];
      if (accumulate) {
        if (empty) {  // untouched, bit for bit
          if (std::memcmp(&got[e * P.N + j], &before[e * P.N + j], 4) != 0) {
            ++bad;
            ADD_FAILURE() << "main_grad of empty expert " << e << " was modified";
          }
          continue;
        }
        want += before[e * P.N + j];
        mag += std::fabs(before[e * P.N + j]);
      } else if (empty && g != 0.0) {
        ++bad;
        ADD_FAILURE() << "db of empty expert " << e << " is " << g << ", expected 0";
        continue;
      }
      if (!(std::fabs(g - want) <= 1e-5 * mag + 1e-30)) {
        ++bad;
        ADD_FAILURE() << "db[" << e << "," << j << "] = " << g << ", reference " << want;
      }
    }
  }
}

TEST(BiasOps, GradWriteAccumulateBf16BothLayouts) {
  MOE_REQUIRE_GPU();
  // Plus a large problem: with ~20k rows the chunks are 128 rows long (small R gets shorter chunks).
  std::vector<std::vector<int>> groupings = kGroupings;
  groupings.push_back({9000, 0, 11000});
  for (const auto& counts : groupings) {
    for (int64_t N : {int64_t(40), int64_t(2056)}) {
      for (bool scaled : {true, false}) {
        SCOPED_TRACE("E=" + std::to_string(counts.size()) + " N=" + std::to_string(N) + (scaled ? " p*dy" : " dy"));
        Problem P = make_problem(counts, 16, 13, N, 11 + N);
        DeviceBuffer<uint16_t> dy(P.y);
        DeviceBuffer<int32_t> off(P.offsets);
        DeviceBuffer<float> probs(P.probs);
        DeviceBuffer<uint8_t> ws(bias_grad_workspace_bytes(P.R, P.E, P.N));
        ws.fill_bytes(0xFF);  // garbage workspace must not matter
        TensorView vdy(dy.get(), DType::kBF16, {P.R, P.N}), voff(off.get(), DType::kInt32, {P.E + 1});
        TensorView vprobs = scaled ? TensorView(probs.get(), DType::kFP32, {P.R}) : TensorView();
        TensorView vws(ws.get(), DType::kUInt8, {static_cast<int64_t>(ws.size())});

        // Written (fp32), twice per layout: bitwise reproducible and layout-independent.
        DeviceGrad<float> g(P.E, P.N);
        std::vector<float> poison(P.E * P.N, std::nanf(""));
        std::vector<std::vector<float>> runs;
        for (int rep = 0; rep < 2; ++rep) {
          g.set(poison);
          bias_grad(vdy, vprobs, voff, g.grouped(), false, vws, nullptr);
          bias_grad(vdy, vprobs, voff, g.per_expert(), false, vws, nullptr);
          runs.push_back(g.get_stacked());
          runs.push_back(g.get_rows());
        }
        for (size_t i = 1; i < runs.size(); ++i) EXPECT_TRUE(same_bits(runs[0], runs[i])) << "run " << i;
        check_grad(P, scaled, {}, runs[0], false, false, {});

        // Accumulated into main_grad: += db; empty experts untouched.
        std::mt19937_64 rng(3);
        std::uniform_real_distribution<float> u(-1.0f, 1.0f);
        std::vector<float> before(P.E * P.N);
        for (auto& v : before) v = u(rng);
        g.set(before);
        bias_grad(vdy, vprobs, voff, g.grouped(), true, vws, nullptr);
        bias_grad(vdy, vprobs, voff, g.per_expert(), true, vws, nullptr);
        std::vector<float> acc = g.get_stacked();
        EXPECT_TRUE(same_bits(acc, g.get_rows()));
        check_grad(P, scaled, before, acc, true, false, {});

        // Written as bf16.
        DeviceGrad<uint16_t> gb(P.E, P.N);
        bias_grad(vdy, vprobs, voff, gb.grouped(), false, vws, nullptr);
        bias_grad(vdy, vprobs, voff, gb.per_expert(), false, vws, nullptr);
        std::vector<uint16_t> b16 = gb.get_stacked();
        EXPECT_EQ(b16, gb.get_rows());
        check_grad(P, scaled, {}, {}, false, true, b16);
      }
    }
  }
}

TEST(BiasOps, DprobsWriteAndAccumulate) {
  MOE_REQUIRE_GPU();
  for (const auto& counts : kGroupings) {
    for (int64_t N : {int64_t(40), int64_t(2056)}) {
      SCOPED_TRACE("E=" + std::to_string(counts.size()) + " N=" + std::to_string(N));
      Problem P = make_problem(counts, 16, 13, N, 17 + N);
      DeviceBias B(P);
      DeviceBuffer<uint16_t> dy(P.y);
      DeviceBuffer<int32_t> off(P.offsets);
      TensorView vdy(dy.get(), DType::kBF16, {P.R, P.N}), voff(off.get(), DType::kInt32, {P.E + 1});
      std::vector<float> start(P.R);
      std::mt19937_64 rng(5);
      std::uniform_real_distribution<float> u(-1.0f, 1.0f);
      for (auto& v : start) v = u(rng);
      for (bool accumulate : {false, true}) {
        std::vector<std::vector<float>> results;
        for (int layout = 0; layout < 2; ++layout) {
          DeviceBuffer<float> dp(start);
          bias_dprobs(vdy, layout ? B.per_expert(P) : B.grouped(P), voff, TensorView(dp.get(), DType::kFP32, {P.R}),
                      accumulate, nullptr);
          results.push_back(dp.download());
        }
        EXPECT_TRUE(same_bits(results[0], results[1])) << "layouts differ";
        int bad = 0;
        for (int64_t r = 0; r < P.R && bad < 10; ++r) {
          const float got = results[0][r];
          if (r >= P.valid()) {  // untouched
            if (std::memcmp(&got, &start[r], 4) != 0) {
              ++bad;
              ADD_FAILURE() << "dprobs[" << r << "] past the valid rows was written";
            }
            continue;
          }
          const int e = P.expert_of(r);
          double dot = 0, mag = accumulate ? std::fabs(start[r]) : 0.0;
          for (int64_t j = 0; j < N; ++j) {
            double t = bf(P.y[r * N + j]) * bf(P.bias[e * N + j]);
            dot += t;
            mag += std::fabs(t);
          }
          if (accumulate) dot += start[r];
          // fp32 fma chain per lane (<= N / 256 * 8 terms) + a 5-level tree: < 1e-5 * sum|terms|.
          if (!(std::fabs(got - dot) <= 1e-5 * mag + 1e-30)) {
            ++bad;
            ADD_FAILURE() << "dprobs[" << r << "] = " << got << ", reference " << dot;
          }
        }
      }
    }
  }
}

// Every expert empty (a batch with no tokens): write mode gives zeros, accumulate leaves main_grad
// alone, bias_add and bias_dprobs touch nothing.
TEST(BiasOps, NoRowsAtAll) {
  MOE_REQUIRE_GPU();
  Problem P = make_problem({0, 0, 0}, 16, 20, 16, 1);
  DeviceBias B(P);
  DeviceBuffer<uint16_t> y(P.y);
  DeviceBuffer<int32_t> off(P.offsets);
  DeviceBuffer<float> probs(P.probs), dp(P.R);
  dp.fill_bytes(0x7F);
  DeviceBuffer<uint8_t> ws(bias_grad_workspace_bytes(P.R, P.E, P.N));
  TensorView vy(y.get(), DType::kBF16, {P.R, P.N}), voff(off.get(), DType::kInt32, {P.E + 1});
  TensorView vws(ws.get(), DType::kUInt8, {static_cast<int64_t>(ws.size())});
  bias_add(vy, B.grouped(P), TensorView(probs.get(), DType::kFP32, {P.R}), voff, nullptr);
  EXPECT_EQ(y.download(), P.y);
  std::vector<float> dp0 = dp.download();
  bias_dprobs(vy, B.grouped(P), voff, TensorView(dp.get(), DType::kFP32, {P.R}), false, nullptr);
  EXPECT_TRUE(same_bits(dp.download(), dp0));
  DeviceGrad<float> g(P.E, P.N);
  std::vector<float> ones(P.E * P.N, 1.0f);
  g.set(ones);
  bias_grad(vy, TensorView(), voff, g.grouped(), true, vws, nullptr);
  EXPECT_TRUE(same_bits(g.get_stacked(), ones));
  bias_grad(vy, TensorView(), voff, g.grouped(), false, vws, nullptr);
  EXPECT_TRUE(same_bits(g.get_stacked(), std::vector<float>(P.E * P.N, 0.0f)));
}

// Capture bias_add + bias_grad + bias_dprobs once; replay with different data and routing; the
// replay equals an eager run on the same inputs bit for bit.
TEST(BiasOps, GraphReplayEqualsEager) {
  MOE_REQUIRE_GPU();
  const int64_t N = 72, R = 700;
  Problem A = make_problem({100, 0, 200, 3}, 16, 0, N, 1);
  Problem Bp = make_problem({0, 400, 1, 150}, 32, 0, N, 2);
  A.R = Bp.R = R;  // same static bound; resize the data (rows past the totals are garbage)
  auto fit = [&](Problem& P) {
    P.y.resize(R * N, 0x7FC0);
    P.probs.resize(R, std::nanf(""));
  };
  fit(A);
  fit(Bp);
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  struct Dev {
    DeviceBuffer<uint16_t> y, dy;
    DeviceBuffer<int32_t> off;
    DeviceBuffer<float> probs, dp;
    DeviceBuffer<uint8_t> ws;
    DeviceBias bias;
    DeviceGrad<float> grad;
    Dev(const Problem& P)
        : y(P.y), dy(P.y), off(P.offsets), probs(P.probs), dp(P.R), ws(bias_grad_workspace_bytes(P.R, P.E, P.N)),
          bias(P), grad(P.E, P.N) {}
    void load(const Problem& P) {
      y.upload(P.y);
      dy.upload(P.y);
      off.upload(P.offsets);
      probs.upload(P.probs);
      bias.upload(P);
      dp.fill_bytes(0);
      grad.set(std::vector<float>(P.E * P.N, 0.5f));
    }
    void run(const Problem& P, cudaStream_t s) {
      TensorView voff(off.get(), DType::kInt32, {P.E + 1}), vp(probs.get(), DType::kFP32, {P.R});
      TensorView vdy(dy.get(), DType::kBF16, {P.R, P.N});
      bias_add(TensorView(y.get(), DType::kBF16, {P.R, P.N}), bias.per_expert(P), vp, voff, s);
      bias_grad(vdy, vp, voff, grad.grouped(), true, TensorView(ws.get(), DType::kUInt8, {int64_t(ws.size())}), s);
      bias_dprobs(vdy, bias.grouped(P), voff, TensorView(dp.get(), DType::kFP32, {P.R}), true, s);
    }
  };
  Dev D(A);
  D.load(A);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  D.run(A, stream);
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  D.load(Bp);
  MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<uint16_t> y_replay = D.y.download();
  std::vector<float> g_replay = D.grad.get_stacked(), dp_replay = D.dp.download();
  Dev E(Bp);
  E.load(Bp);
  E.run(Bp, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(y_replay, E.y.download());
  EXPECT_TRUE(same_bits(g_replay, E.grad.get_stacked()));
  EXPECT_TRUE(same_bits(dp_replay, E.dp.download()));
  // And the replay really used the new routing: expert 0 of B is empty, so its main_grad stayed 0.5.
  for (int64_t j = 0; j < N; ++j) EXPECT_EQ(g_replay[j], 0.5f);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// Argument errors are found on the host before anything is launched (no device needed).
TEST(BiasOps, BadArgumentsNameTheArgument) {
  void* fake = reinterpret_cast<void*>(uintptr_t(1) << 20);  // aligned, never dereferenced
  const int64_t R = 32, N = 16;
  const int E = 2;
  TensorView y(fake, DType::kBF16, {R, N}), off(fake, DType::kInt32, {E + 1}), probs(fake, DType::kFP32, {R});
  TensorView dp(fake, DType::kFP32, {R}), none;
  ExpertRows bias = ExpertRows::single_grouped(TensorView(fake, DType::kBF16, {E, N}));
  ExpertRows grad = ExpertRows::single_grouped(TensorView(fake, DType::kFP32, {E, N}));
  TensorView ws(fake, DType::kUInt8, {static_cast<int64_t>(bias_grad_workspace_bytes(R, E, N))});
  expect_error_naming([&] { bias_add(TensorView(fake, DType::kFP32, {R, N}), bias, probs, off, 0); }, "'y'");
  expect_error_naming([&] { bias_add(TensorView(fake, DType::kBF16, {R, 12}), bias, probs, off, 0); }, "'y'");
  expect_error_naming([&] { bias_add(y, bias, probs, none, 0); }, "'group_offsets'");
  expect_error_naming([&] { bias_add(y, bias, TensorView(fake, DType::kFP32, {R - 1}), off, 0); }, "'probs'");
  ExpertRows wrong_e = ExpertRows::single_grouped(TensorView(fake, DType::kBF16, {E + 1, N}));
  expect_error_naming([&] { bias_add(y, wrong_e, probs, off, 0); }, "'bias'");
  ExpertRows wrong_n = ExpertRows::single_grouped(TensorView(fake, DType::kBF16, {E, 2 * N}));
  expect_error_naming([&] { bias_dprobs(y, wrong_n, off, dp, false, 0); }, "'bias'");
  ExpertRows neither = bias;
  neither.stacked = nullptr;
  expect_error_naming([&] { bias_add(y, neither, probs, off, 0); }, "'bias'");
  expect_error_naming([&] { bias_dprobs(y, bias, off, none, false, 0); }, "'dprobs'");
  ExpertRows grad_bf16 = ExpertRows::single_grouped(TensorView(fake, DType::kBF16, {E, N}));
  expect_error_naming([&] { bias_grad(y, probs, off, grad_bf16, true, ws, 0); }, "'grad'");
  ExpertRows grad_i32 = ExpertRows::single_grouped(TensorView(fake, DType::kInt32, {E, N}));
  expect_error_naming([&] { bias_grad(y, probs, off, grad_i32, false, ws, 0); }, "'grad'");
  TensorView small(fake, DType::kUInt8, {16});
  expect_error_naming([&] { bias_grad(y, probs, off, grad, false, small, 0); }, "'workspace'");
}

}  // namespace
}  // namespace moe
