// GPU activation x prob kernels against the fp64 CPU reference (src/reference/activation_ref.h):
// every activation with and without probs and GLU interleave, valid rows from group_offsets (rows
// past the total untouched), zero-row experts, pad rows, graph capture + replay, argument errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe/activation_ops.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "reference/activation_ref.h"
#include "support/gpu.h"
#include "support/expect_error.h"

namespace moe {
namespace {

using testing::DeviceBuffer;

constexpr uint16_t kPoisonBf16 = 0xFFFF;  // a NaN: memset(0xFF) of a bf16 buffer
constexpr uint32_t kPoisonF32 = 0xFFFFFFFFu;

using ::moe::testing::expect_error_naming;

uint32_t f32_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

struct Variant {
  std::string name;
  ActivationParams params;
  double range;  // inputs uniform in [-range, range]
};

std::vector<Variant> variants() {
  auto make = [](Activation k, int s) {
    ActivationParams p;
    p.kind = k;
    p.glu_interleave = s;
    return p;
  };
  ActivationParams clamped = make(Activation::kClampedSwiGLU, 0);  // GPT-OSS: alpha 1.702, L 7, off 1
  ActivationParams clamped_il = make(Activation::kClampedSwiGLU, 8);
  // DeepSeek-V4 / GLM-5-Next / Hunyuan v4: silu(min(g, L)) * clamp(l, -L, L), L = 10.
  ActivationParams clamped_silu = make(Activation::kClampedSwiGLU, 0);
  clamped_silu.alpha = 1.0f;
  clamped_silu.limit = 10.0f;
  clamped_silu.offset = 0.0f;
  return {{"swiglu", make(Activation::kSwiGLU, 0), 3.0},      {"swiglu_il32", make(Activation::kSwiGLU, 32), 3.0},
          {"geglu", make(Activation::kGeGLU, 0), 3.0},        {"geglu_il8", make(Activation::kGeGLU, 8), 3.0},
          {"clamped", clamped, 9.0},                          {"clamped_il8", clamped_il, 9.0},
          {"swiglu_il1", make(Activation::kSwiGLU, 1), 3.0},  {"clamped_il1", make(Activation::kClampedSwiGLU, 1), 9.0},
          {"squared_relu", make(Activation::kSquaredReLU, 0), 3.0}, {"clamped_silu", clamped_silu, 13.0}};
}

// One problem on the host: bf16 inputs (as bits and as the exact doubles the reference takes).
struct Problem {
  ActivationParams params;
  int64_t R = 0, F = 0, in_cols = 0;
  std::vector<uint16_t> h, d_out;  // bf16 bits
  std::vector<float> probs;        // empty: absent
  std::vector<int32_t> offsets;    // empty: absent
  int64_t valid() const {
    if (offsets.empty()) return R;
    int64_t v = offsets.back();
    return v < 0 ? 0 : std::min<int64_t>(v, R);
  }
};

Problem make_problem(const Variant& v, int64_t R, int64_t F, bool with_probs, std::vector<int32_t> offsets,
                     uint64_t seed) {
  Problem P;
  P.params = v.params;
  P.R = R;
  P.F = F;
  P.in_cols = fc1_out_features(v.params.kind, F);
  P.offsets = std::move(offsets);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-v.range, v.range), u1(-1.0f, 1.0f), up(0.0f, 1.0f);
  P.h.resize(R * P.in_cols);
  for (auto& b : P.h) b = float_to_bf16_bits(u(rng));
  // Exactly at the clamp (+-L are bf16-representable): GPU and reference must take the same side.
  if (v.params.kind == Activation::kClampedSwiGLU && R > 0) {
    const float L = v.params.limit;
    const int s = v.params.glu_interleave;
    for (int64_t j = 0; j < std::min<int64_t>(F, 3); ++j) {
      P.h[gate_column(j, F, s)] = float_to_bf16_bits(j == 2 ? -L : L);
      P.h[linear_column(j, F, s)] = float_to_bf16_bits(j % 2 ? -L : L);
    }
  }
  P.d_out.resize(R * F);
  for (auto& b : P.d_out) b = float_to_bf16_bits(u1(rng));
  if (with_probs) {
    P.probs.resize(R);
    for (auto& p : P.probs) p = up(rng);
    if (R > 3) P.probs[3] = 0.0f;  // a pad row
  }
  return P;
}

std::vector<double> to_double(const std::vector<uint16_t>& bits) {
  std::vector<double> d(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) d[i] = bf16_bits_to_float(bits[i]);
  return d;
}

// Device copies of a problem and its outputs, with views for the ops.
struct DeviceProblem {
  ActivationParams params;
  DeviceBuffer<uint16_t> h, d_out, out, dh;
  DeviceBuffer<float> probs, dprobs;
  DeviceBuffer<int32_t> offsets;
  TensorView vh, vprobs, voff, vout, vdout, vdh, vdprobs;

  explicit DeviceProblem(const Problem& P)
      : params(P.params),
        h(P.h), d_out(P.d_out), out(P.R * P.F), dh(P.R * P.in_cols), probs(P.probs), dprobs(P.R), offsets(P.offsets) {
    vh = TensorView(h.get(), DType::kBF16, {P.R, P.in_cols});
    vout = TensorView(out.get(), DType::kBF16, {P.R, P.F});
    vdout = TensorView(d_out.get(), DType::kBF16, {P.R, P.F});
    vdh = TensorView(dh.get(), DType::kBF16, {P.R, P.in_cols});
    vdprobs = TensorView(dprobs.get(), DType::kFP32, {P.R});
    if (!P.probs.empty()) vprobs = TensorView(probs.get(), DType::kFP32, {P.R});
    if (!P.offsets.empty()) voff = TensorView(offsets.get(), DType::kInt32, {static_cast<int64_t>(P.offsets.size())});
  }
  void upload(const Problem& P) {
    h.upload(P.h);
    d_out.upload(P.d_out);
    if (!P.probs.empty()) probs.upload(P.probs);
    if (!P.offsets.empty()) offsets.upload(P.offsets);
  }
  void poison() {
    out.fill_bytes(0xFF);
    dh.fill_bytes(0xFF);
    dprobs.fill_bytes(0xFF);
  }
  void forward(cudaStream_t s) { activation_forward(params, vh, vprobs, voff, vout, s); }
  void backward(cudaStream_t s) { activation_backward(params, vh, vprobs, vdout, voff, vdh, vdprobs, s); }
};

// Checks the GPU outputs against the fp64 reference on the valid rows and the poison past them.
void check_against_reference(const Problem& P, const std::vector<uint16_t>& out, const std::vector<uint16_t>& dh,
                             const std::vector<float>& dprobs) {
  const int64_t V = P.valid(), F = P.F, C = P.in_cols;
  std::vector<double> h = to_double(P.h), d_out = to_double(P.d_out), p(P.probs.begin(), P.probs.end());
  const double* pp = P.probs.empty() ? nullptr : p.data();
  std::vector<double> ref_out(V * F), ref_act(V * F), ref_dh(V * C), ref_dp(V);
  if (V > 0) {
    ref::activation_forward(P.params, h.data(), pp, V, F, ref_out.data());
    ref::activation_forward(P.params, h.data(), nullptr, V, F, ref_act.data());
    ref::activation_backward(P.params, h.data(), pp, d_out.data(), V, F, ref_dh.data(), ref_dp.data());
  }
  int bad = 0;
  for (int64_t r = 0; r < P.R && bad < 10; ++r) {
    for (int64_t j = 0; j < F; ++j) {
      const uint16_t bits = out[r * F + j];
      if (r >= V) {
        if (bits != kPoisonBf16) {
          ++bad;
          ADD_FAILURE() << "out row " << r << " past the valid rows was written";
        }
        continue;
      }
      // bf16 output of an fp32 computation: rounding <= 2^-9 relative (RNE) and fp32 noise of a few
      // ulp may flip it to the next bf16 value: <= 2^-8 relative in all; 1e-6 absolute covers the
      // cancellation in 1 + tanh(u) of gelu for negative inputs (~ulp(1) * |g| * |l| / 2).
      const double ref = ref_out[r * F + j], got = bf16_bits_to_float(bits);
      if (!(std::fabs(got - ref) <= std::ldexp(std::fabs(ref), -8) + 1e-6)) {
        ++bad;
        ADD_FAILURE() << "out[" << r << "," << j << "] = " << got << ", reference " << ref;
      }
    }
    for (int64_t c = 0; c < C; ++c) {
      const uint16_t bits = dh[r * C + c];
      if (r >= V) {
        if (bits != kPoisonBf16) {
          ++bad;
          ADD_FAILURE() << "dh row " << r << " past the valid rows was written";
        }
        continue;
      }
      // As above, plus the fp32 evaluation of the derivative: a few ulp of its largest intermediate
      // (<= ~30 for clamped-swiglu on [-9, 9]): 30 * 2^-23 * 4 ~ 1.4e-5 absolute.
      const double ref = ref_dh[r * C + c], got = bf16_bits_to_float(bits);
      if (!(std::fabs(got - ref) <= std::ldexp(std::fabs(ref), -8) + 2e-5)) {
        ++bad;
        ADD_FAILURE() << "dh[" << r << "," << c << "] = " << got << ", reference " << ref;
      }
    }
    if (r >= V) {
      if (f32_bits(dprobs[r]) != kPoisonF32) {
        ++bad;
        ADD_FAILURE() << "dprobs row " << r << " past the valid rows";
      }
      continue;
    }
    // fp32 sum of F terms (per lane in order, then a 5-level tree) of fp32 products each off by a few
    // ulp: (F / 32 + 5 + 4) * 2^-24 * sum|terms| < 1e-5 * sum|terms| for the F used here.
    double mag = 0;
    for (int64_t j = 0; j < F; ++j) mag += std::fabs(d_out[r * F + j] * ref_act[r * F + j]);
    if (!(std::fabs(dprobs[r] - ref_dp[r]) <= 1e-5 * mag + 1e-30)) {
      ++bad;
      ADD_FAILURE() << "dprobs[" << r << "] = " << dprobs[r] << ", reference " << ref_dp[r];
    }
  }
}

struct Outputs {
  std::vector<uint16_t> out, dh;
  std::vector<float> dprobs;
};

Outputs run_eager(const Problem& P, cudaStream_t stream = nullptr) {
  DeviceProblem D(P);
  D.poison();
  D.forward(stream);
  D.backward(stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return {D.out.download(), D.dh.download(), D.dprobs.download()};
}

TEST(ActivationOps, MatchesReferenceAllVariants) {
  MOE_REQUIRE_GPU();
  // R = 37 rows; 3 experts with an empty one; rows [29, 37) past the valid total stay untouched.
  // F = 264: 33 16-byte vectors per row, so lane 0 takes two (the loop over a row is exercised).
  for (const Variant& v : variants()) {
    for (bool with_probs : {true, false}) {
      for (int64_t F : {int64_t(264), int64_t(64)}) {
        if (v.params.glu_interleave && F % v.params.glu_interleave) continue;
        SCOPED_TRACE(v.name + (with_probs ? " probs" : " no-probs") + " F=" + std::to_string(F));
        Problem P = make_problem(v, 37, F, with_probs, {0, 11, 11, 29}, 1234 + F);
        Outputs g = run_eager(P);
        check_against_reference(P, g.out, g.dh, g.dprobs);
      }
    }
  }
}

// The backward written over h itself (as the expert layer runs it) gives the bits of the
// out-of-place call, for every activation and GLU interleave; rows past the valid total keep h.
TEST(ActivationOps, BackwardInPlaceEqualsOutOfPlace) {
  MOE_REQUIRE_GPU();
  for (const Variant& v : variants()) {
    if (v.params.glu_interleave && 264 % v.params.glu_interleave) continue;
    SCOPED_TRACE(v.name);
    Problem P = make_problem(v, 37, 264, true, {0, 11, 11, 29}, 4321);
    DeviceProblem d(P);
    d.poison();
    d.backward(nullptr);
    const std::vector<uint16_t> want = d.dh.download();
    const std::vector<float> want_dp = d.dprobs.download();
    d.dprobs.fill_bytes(0xFF);
    activation_backward(d.params, d.vh, d.vprobs, d.vdout, d.voff, d.vh, d.vdprobs, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    const std::vector<uint16_t> got = d.h.download();
    const int64_t valid = P.valid() * P.in_cols;
    EXPECT_TRUE(std::equal(got.begin(), got.begin() + valid, want.begin())) << "dh written over h";
    EXPECT_TRUE(std::equal(got.begin() + valid, got.end(), P.h.begin() + valid)) << "rows past the valid total";
    const std::vector<float> dp = d.dprobs.download();
    EXPECT_EQ(0, std::memcmp(dp.data(), want_dp.data(), P.valid() * sizeof(float))) << "dprobs";
  }
}

TEST(ActivationOps, AllRowsWithoutGroupOffsets) {
  MOE_REQUIRE_GPU();
  for (const Variant& v : variants()) {
    SCOPED_TRACE(v.name);
    Problem P = make_problem(v, 21, 32, true, {}, 99);
    Outputs g = run_eager(P);
    check_against_reference(P, g.out, g.dh, g.dprobs);
  }
}

// Offsets past R are clamped to R, negative ones to 0, a zero total writes nothing.
TEST(ActivationOps, ValidRowsClampedAndEmpty) {
  MOE_REQUIRE_GPU();
  const Variant v = variants()[0];
  for (std::vector<int32_t> off : {std::vector<int32_t>{0, 50, 1000}, std::vector<int32_t>{0, 0, 0},
                                   std::vector<int32_t>{0, -5}, std::vector<int32_t>{0}}) {
    SCOPED_TRACE("total " + std::to_string(off.back()));
    Problem P = make_problem(v, 24, 16, true, off, 5);
    Outputs g = run_eager(P);
    check_against_reference(P, g.out, g.dh, g.dprobs);
  }
  // R = 0: nothing to do, no launch, no error.
  Problem P = make_problem(v, 0, 16, true, {0, 0}, 5);
  Outputs g = run_eager(P);
  EXPECT_TRUE(g.out.empty());
}

// Capture forward + backward once; replay with different data and a different valid total; the
// replay equals an eager run on the same inputs bit for bit (untouched rows included).
TEST(ActivationOps, GraphReplayEqualsEager) {
  MOE_REQUIRE_GPU();
  for (const Variant& v : {variants()[1], variants()[4]}) {
    SCOPED_TRACE(v.name);
    const int64_t R = 300, F = 128;
    Problem A = make_problem(v, R, F, true, {0, 100, 100, 250}, 1);
    Problem B = make_problem(v, R, F, true, {0, 7, 180, 281}, 2);
    cudaStream_t stream;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    DeviceProblem D(A);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    D.forward(stream);
    D.backward(stream);
    MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    D.upload(B);
    D.poison();
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    Outputs replay{D.out.download(), D.dh.download(), D.dprobs.download()};
    Outputs eager = run_eager(B, stream);
    EXPECT_EQ(replay.out, eager.out);
    EXPECT_EQ(replay.dh, eager.dh);
    ASSERT_EQ(replay.dprobs.size(), eager.dprobs.size());
    EXPECT_EQ(0, std::memcmp(replay.dprobs.data(), eager.dprobs.data(), eager.dprobs.size() * 4));
    check_against_reference(B, replay.out, replay.dh, replay.dprobs);
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
  }
}

// Argument errors are found on the host before anything is launched (no device needed).
TEST(ActivationOps, BadArgumentsNameTheArgument) {
  void* fake = reinterpret_cast<void*>(uintptr_t(1) << 20);  // aligned, never dereferenced
  const int64_t R = 4, F = 16;
  ActivationParams sw;
  TensorView h(fake, DType::kBF16, {R, 2 * F}), out(fake, DType::kBF16, {R, F}), dh(fake, DType::kBF16, {R, 2 * F});
  TensorView probs(fake, DType::kFP32, {R}), off(fake, DType::kInt32, {3}), none;
  expect_error_naming([&] { activation_forward(sw, TensorView(fake, DType::kFP32, {R, 2 * F}), probs, off, out, 0); },
                      "'h'");
  expect_error_naming([&] { activation_forward(sw, TensorView(fake, DType::kBF16, {R, F}), probs, off, out, 0); },
                      "'h'");
  expect_error_naming([&] { activation_forward(sw, h, probs, off, TensorView(fake, DType::kBF16, {R, 12}), 0); },
                      "'out'");
  TensorView mis(static_cast<char*>(fake) + 2, DType::kBF16, {R, F});
  expect_error_naming([&] { activation_forward(sw, h, probs, off, mis, 0); }, "'out'");
  TensorView host_out = out;
  host_out.device = Device::kCPU;
  expect_error_naming([&] { activation_forward(sw, h, probs, off, host_out, 0); }, "'out'");
  expect_error_naming([&] { activation_forward(sw, h, TensorView(fake, DType::kFP32, {R + 1}), off, out, 0); },
                      "'probs'");
  expect_error_naming([&] { activation_forward(sw, h, probs, TensorView(fake, DType::kInt64, {3}), out, 0); },
                      "'group_offsets'");
  ActivationParams il;
  il.glu_interleave = 12;
  expect_error_naming([&] { activation_forward(il, h, probs, off, out, 0); }, "'glu_interleave'");
  ActivationParams c;
  c.kind = Activation::kClampedSwiGLU;
  c.limit = -1.0f;
  expect_error_naming([&] { activation_forward(c, h, probs, off, out, 0); }, "'limit'");
  ActivationParams sq;
  sq.kind = Activation::kSquaredReLU;
  expect_error_naming([&] { activation_forward(sq, h, probs, off, out, 0); }, "'h'");  // needs [R, F]
  expect_error_naming(
      [&] { activation_backward(sw, h, probs, out, off, TensorView(fake, DType::kBF16, {R, F}), none, 0); }, "'dh'");
  expect_error_naming(
      [&] { activation_backward(sw, h, probs, out, off, dh, TensorView(fake, DType::kBF16, {R}), 0); }, "'dprobs'");
  expect_error_naming(
      [&] { activation_backward(sw, h, probs, TensorView(fake, DType::kBF16, {R + 1, F}), off, dh, none, 0); }, "'h'");
}

}  // namespace
}  // namespace moe
