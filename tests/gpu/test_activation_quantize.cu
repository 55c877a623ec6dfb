// The fused activation + FP8 quantize (activation_forward_quantized) against the bitwise CPU
// quantize reference applied to the unfused activation kernel's output (which test_activation_ops
// checks against the CPU activation reference): every activation and GLU interleave, with and
// without probs, rows past the valid total, partial tiles, both copies or either one, power-of-two
// scales; graph capture + replay with new data; zero rows; argument errors. The same for the
// backward (activation_backward_quantized against the quantize reference on the unfused backward's
// dh), whose dprobs is checked against the fp64 activation reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "moe/activation_ops.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "moe/quantize.h"
#include "reference/activation_ref.h"
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

ActivationParams activation(Activation kind, int interleave) {
  ActivationParams p;
  p.kind = kind;
  p.glu_interleave = interleave;
  return p;
}

// The layer's configuration: row-major scales for the rowwise copy, MN-major for the columnwise one.
QuantConfig fp8_config(bool rowwise, bool columnwise, bool pow2) {
  QuantConfig c;
  c.rowwise = rowwise;
  c.columnwise = columnwise;
  c.columnwise_scale_layout = ScaleLayout::kMNMajor;
  c.pow2_scale = pow2;
  return c;
}

// Inputs of one call on the host and on the device.
struct Inputs {
  int64_t R, F, in_cols;
  std::vector<uint16_t> h;
  std::vector<float> probs;       // empty: absent
  std::vector<int32_t> offsets;   // empty: absent
  DeviceBuffer<uint16_t> dh;
  DeviceBuffer<float> dprobs;
  DeviceBuffer<int32_t> doffsets;

  Inputs(const ActivationParams& params, int64_t rows, int64_t f, bool with_probs, std::vector<int32_t> offs,
         uint64_t seed)
      : R(rows), F(f), in_cols(fc1_out_features(params.kind, f)), offsets(std::move(offs)) {
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.0f, 2.0f);
    std::uniform_real_distribution<float> up(0.0f, 1.0f);
    h.resize(R * in_cols);
    for (auto& b : h) b = float_to_bf16_bits(nd(rng));
    if (R > 0) h[0] = float_to_bf16_bits(40.0f);  // a large gate: one block's amax far above the rest
    if (with_probs) {
      probs.resize(R);
      for (auto& p : probs) p = up(rng);
      if (R > 3) probs[3] = 0.0f;  // a pad row: an all-zero block (amax 0)
    }
    dh = DeviceBuffer<uint16_t>(h);
    dprobs = DeviceBuffer<float>(probs);
    doffsets = DeviceBuffer<int32_t>(offsets);
  }
  TensorView h_view() const { return TensorView(dh.get(), DType::kBF16, {R, in_cols}); }
  TensorView probs_view() const { return probs.empty() ? TensorView() : TensorView(dprobs.get(), DType::kFP32, {R}); }
  TensorView offsets_view() const {
    return offsets.empty() ? TensorView()
                           : TensorView(doffsets.get(), DType::kInt32, {static_cast<int64_t>(offsets.size())});
  }
};

// act as the unfused kernel writes it, with the rows it leaves unwritten zero.
std::vector<uint16_t> unfused_act(const ActivationParams& params, const Inputs& in, cudaStream_t stream) {
  DeviceBuffer<uint16_t> act(in.R * in.F);
  act.fill_bytes(0);
  activation_forward(params, in.h_view(), in.probs_view(), in.offsets_view(),
                     TensorView(act.get(), DType::kBF16, {in.R, in.F}), stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return act.download();
}

// Every activation and the GLU interleaves 0, 1 and 32 (the backward adds 8).
struct Variant {
  const char* name;
  ActivationParams params;
};
const Variant kVariants[] = {{"swiglu", activation(Activation::kSwiGLU, 0)},
                             {"swiglu_il1", activation(Activation::kSwiGLU, 1)},
                             {"geglu_il32", activation(Activation::kGeGLU, 32)},
                             {"clamped_il1", activation(Activation::kClampedSwiGLU, 1)},
                             {"clamped", activation(Activation::kClampedSwiGLU, 0)},
                             {"squared_relu", activation(Activation::kSquaredReLU, 0)}};

// R x F with group offsets (none: every row valid).
struct Shape {
  int64_t R, F;
  std::vector<int32_t> offsets;
};

TEST(ActivationQuantize, MatchesTheReferenceOnTheUnfusedActivation) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  // 384 x 256: whole tiles; 300 x 224: partial tiles in both directions (R % 16 != 0: the columnwise
  // copy's row-by-row stores), valid rows 260 of 300; 256 x 128 with four groups, one empty.
  const Shape shapes[] = {{384, 256, {}}, {300, 224, {0, 100, 260}}, {256, 128, {0, 128, 128, 200, 256}}};
  uint64_t seed = 1;
  for (const Variant& v : kVariants) {
    for (const Shape& sh : shapes) {
      for (bool with_probs : {true, false}) {
        const Inputs in(v.params, sh.R, sh.F, with_probs, sh.offsets, seed++);
        const std::vector<uint16_t> act = unfused_act(v.params, in, stream);
        for (int copies = 0; copies < 3; ++copies) {
          const bool pow2 = seed % 2 == 0;
          const QuantConfig c = fp8_config(copies != 2, copies != 1, pow2);
          const std::string what = std::string(v.name) + " R=" + std::to_string(sh.R) + " F=" + std::to_string(sh.F) +
                                   (with_probs ? " probs" : "") + " copies=" + std::to_string(copies) +
                                   (pow2 ? " pow2" : "");
          const ref::Quantized want = ref::quantize(c, act, 1, sh.R, sh.F);
          const Copies got(c, want, sh.R, sh.F);
          activation_forward_quantized(v.params, in.h_view(), in.probs_view(), in.offsets_view(), c, got.q, stream);
          MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
          got.expect_equal(want, what);
        }
      }
    }
  }
  cudaStreamDestroy(stream);
}

TEST(ActivationQuantize, GraphReplayWithNewData) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const ActivationParams params = activation(Activation::kSwiGLU, 0);
  const int64_t R = 256, F = 256;
  Inputs in(params, R, F, true, {0, 64, 192, 256}, 11);
  const QuantConfig c = fp8_config(true, true, false);
  const ref::Quantized first = ref::quantize(c, unfused_act(params, in, stream), 1, R, F);
  const Copies got(c, first, R, F);
  const CapturedGraph graph(stream, [&] {
    activation_forward_quantized(params, in.h_view(), in.probs_view(), in.offsets_view(), c, got.q, stream);
  });
  graph.launch();
  got.expect_equal(first, "first replay");
  // New h, probs and group offsets in the same buffers: the replay reads them all on the device.
  const Inputs next(params, R, F, true, {0, 32, 32, 160}, 12);
  in.dh.upload(next.h);
  in.dprobs.upload(next.probs);
  in.doffsets.upload(next.offsets);
  in.h = next.h;
  in.probs = next.probs;
  in.offsets = next.offsets;
  const ref::Quantized second = ref::quantize(c, unfused_act(params, in, stream), 1, R, F);
  graph.launch();
  got.expect_equal(second, "second replay");
  cudaStreamDestroy(stream);
}

TEST(ActivationQuantize, ZeroRowsAreValid) {
  MOE_REQUIRE_GPU();
  const ActivationParams params = activation(Activation::kSwiGLU, 0);
  DeviceBuffer<uint16_t> h(16);
  DeviceBuffer<float> probs(4);
  const QuantConfig c = fp8_config(true, true, false);
  const ref::Quantized want = ref::quantize(c, {}, 1, 0, 128);
  const Copies got(c, want, 0, 128);
  activation_forward_quantized(params, TensorView(h.get(), DType::kBF16, {0, 256}),
                               TensorView(probs.get(), DType::kFP32, {0}), TensorView(), c, got.q, nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  got.expect_equal(want, "zero rows");
}

TEST(ActivationQuantize, BadInputNamesTheArgument) {
  MOE_REQUIRE_GPU();
  const ActivationParams params = activation(Activation::kSwiGLU, 0);
  const int64_t R = 128, F = 128;
  const Inputs in(params, R, F, true, {}, 5);
  const QuantConfig c = fp8_config(true, true, false);
  const ref::Quantized shape = ref::quantize(c, std::vector<uint16_t>(R * F, 0), 1, R, F);
  const Copies out(c, shape, R, F);
  auto run = [&](const ActivationParams& p, const TensorView& h, const TensorView& probs, const QuantConfig& cfg,
                 const QuantizedTensor& q) {
    activation_forward_quantized(p, h, probs, TensorView(), cfg, q, nullptr);
  };
  QuantConfig mx = c;
  mx.format = QuantFormat::kMXFP8;
  expect_error_naming([&] { run(params, in.h_view(), in.probs_view(), mx, out.q); }, "'config'");
  QuantConfig two_d = c;
  two_d.blocking = QuantBlocking::k2D;
  expect_error_naming([&] { run(params, in.h_view(), in.probs_view(), two_d, out.q); }, "'config'");
  expect_error_naming([&] { run(params, TensorView(in.dh.get(), DType::kBF16, {R * 2 * F}), in.probs_view(), c, out.q); },
                      "'h'");
  expect_error_naming(
      [&] { run(params, TensorView(in.dh.get(), DType::kFP32, {R, 2 * F}), in.probs_view(), c, out.q); }, "'h'");
  expect_error_naming([&] { run(params, in.h_view(), TensorView(in.dprobs.get(), DType::kFP32, {R - 1}), c, out.q); },
                      "'probs'");
  const int64_t too_many = 65535 * 128 + 1;  // the view is only checked, never read
  expect_error_naming(
      [&] { run(params, TensorView(in.dh.get(), DType::kBF16, {too_many, 2 * F}), TensorView(), c, out.q); }, "'h'");
  QuantizedTensor bad = out.q;
  bad.rowwise_data = TensorView(out.rd.get(), DType::kFP8E4M3, {R, F + 16});
  expect_error_naming([&] { run(params, in.h_view(), in.probs_view(), c, bad); }, "'out.rowwise_data'");
  bad = out.q;
  bad.columnwise_scale = TensorView();
  expect_error_naming([&] { run(params, in.h_view(), in.probs_view(), c, bad); }, "'out.columnwise_scale'");
}

// ---- backward ----------------------------------------------------------------------------------

constexpr uint32_t kPoisonF32 = 0xFFFFFFFFu;

uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// d_out [R, F] beside the forward's inputs.
struct GradInputs : Inputs {
  std::vector<uint16_t> d_out;
  DeviceBuffer<uint16_t> dd_out;
  GradInputs(const ActivationParams& params, int64_t rows, int64_t f, bool with_probs, std::vector<int32_t> offs,
             uint64_t seed)
      : Inputs(params, rows, f, with_probs, std::move(offs), seed) {
    std::mt19937_64 rng(seed + 1000);
    std::normal_distribution<float> nd(0.0f, 1.0f);
    d_out.resize(R * F);
    for (auto& b : d_out) b = float_to_bf16_bits(nd(rng));
    if (R > 1) d_out[F] = float_to_bf16_bits(-30.0f);  // one large gradient in row 1
    dd_out = DeviceBuffer<uint16_t>(d_out);
  }
  TensorView d_out_view() const { return TensorView(dd_out.get(), DType::kBF16, {R, F}); }
  int64_t valid() const {
    return offsets.empty() ? R : std::min<int64_t>(std::max<int32_t>(offsets.back(), 0), R);
  }
};

// dh as the unfused kernel writes it (out of place), with the rows it leaves unwritten zero.
std::vector<uint16_t> unfused_dh(const ActivationParams& params, const GradInputs& in, cudaStream_t stream) {
  DeviceBuffer<uint16_t> dh(in.R * in.in_cols);
  dh.fill_bytes(0);
  activation_backward(params, in.h_view(), in.probs_view(), in.d_out_view(), in.offsets_view(),
                      TensorView(dh.get(), DType::kBF16, {in.R, in.in_cols}), TensorView(), stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return dh.download();
}

// dprobs of the valid rows against the fp64 reference: an fp32 sum of F terms (per chunk of at most
// 8 in order, a 4-level tree over a tile row's 16 chunks, then the tiles in order), each product
// off by a few ulp: (8 + 4 + F / 64 + 4) * 2^-24 * sum|terms| < 1e-5 * sum|terms| here. Rows past
// them keep the poison.
void expect_dprobs(const ActivationParams& params, const GradInputs& in, const std::vector<float>& got,
                   const std::string& what) {
  const int64_t V = in.valid(), F = in.F;
  std::vector<double> h(in.h.size()), d_out(in.d_out.size()), p(in.probs.begin(), in.probs.end());
  for (size_t i = 0; i < h.size(); ++i) h[i] = bf16_bits_to_float(in.h[i]);
  for (size_t i = 0; i < d_out.size(); ++i) d_out[i] = bf16_bits_to_float(in.d_out[i]);
  const double* pp = in.probs.empty() ? nullptr : p.data();
  std::vector<double> act(V * F), dh(V * in.in_cols), dp(V);
  if (V > 0) {
    ref::activation_forward(params, h.data(), nullptr, V, F, act.data());
    ref::activation_backward(params, h.data(), pp, d_out.data(), V, F, dh.data(), dp.data());
  }
  int bad = 0;
  for (int64_t r = 0; r < in.R && bad < 10; ++r) {
    if (r >= V) {
      if (f32_bits(got[r]) != kPoisonF32) {
        ++bad;
        ADD_FAILURE() << what << ": dprobs row " << r << " past the valid rows was written";
      }
      continue;
    }
    double mag = 0;
    for (int64_t j = 0; j < F; ++j) mag += std::fabs(d_out[r * F + j] * act[r * F + j]);
    if (!(std::fabs(got[r] - dp[r]) <= 1e-5 * mag + 1e-30)) {
      ++bad;
      ADD_FAILURE() << what << ": dprobs[" << r << "] = " << got[r] << ", reference " << dp[r];
    }
  }
}

TEST(ActivationBackwardQuantize, MatchesTheReferenceOnTheUnfusedBackward) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  std::vector<Variant> variants(std::begin(kVariants), std::end(kVariants));
  variants.push_back({"swiglu_il8", activation(Activation::kSwiGLU, 8)});
  // 384 x 256: whole tiles; 300 x 224: partial tiles both ways (fc1_out 448: with interleave 0 a
  // tile holds gate and linear columns, each chunk computed on its own), valid rows 260 of 300;
  // 256 x 128 with four groups, one empty; 128 x 640: ten column tiles of dh. With interleave 0 and
  // F a multiple of 128 a CTA makes gate tile i and linear tile i + F / 128 (paired tiles).
  const Shape shapes[] = {{384, 256, {}},
                          {300, 224, {0, 100, 260}},
                          {256, 128, {0, 128, 128, 200, 256}},
                          {128, 640, {0, 64, 128}}};
  uint64_t seed = 101;
  for (const Variant& v : variants) {
    for (const Shape& sh : shapes) {
      for (bool with_probs : {true, false}) {
        const GradInputs in(v.params, sh.R, sh.F, with_probs, sh.offsets, seed++);
        const std::vector<uint16_t> dh = unfused_dh(v.params, in, stream);
        const int64_t C = in.in_cols;
        DeviceBuffer<float> dprobs(sh.R), ws(activation_backward_quantized_workspace(v.params, sh.R, sh.F));
        for (int copies = 0; copies < 3; ++copies) {
          const bool pow2 = seed % 2 == 0;
          const bool with_dprobs = copies != 1;
          const QuantConfig c = fp8_config(copies != 2, copies != 1, pow2);
          const std::string what = std::string(v.name) + " R=" + std::to_string(sh.R) + " F=" + std::to_string(sh.F) +
                                   (with_probs ? " probs" : "") + " copies=" + std::to_string(copies) +
                                   (pow2 ? " pow2" : "");
          const ref::Quantized want = ref::quantize(c, dh, 1, sh.R, C);
          const Copies got(c, want, sh.R, C);
          dprobs.fill_bytes(0xFF);
          ws.fill_bytes(0xFF);  // every entry the sum reads is written by the tile kernel
          activation_backward_quantized(v.params, in.h_view(), in.probs_view(), in.d_out_view(), in.offsets_view(), c,
                                        got.q, with_dprobs ? TensorView(dprobs.get(), DType::kFP32, {sh.R}) : TensorView(),
                                        TensorView(ws.get(), DType::kFP32, {static_cast<int64_t>(ws.size())}), stream);
          MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
          got.expect_equal(want, what);
          if (with_dprobs) expect_dprobs(v.params, in, dprobs.download(), what);
        }
      }
    }
  }
  cudaStreamDestroy(stream);
}

TEST(ActivationBackwardQuantize, GraphReplayWithNewDataAndBitwiseStableDprobs) {
  MOE_REQUIRE_GPU();
  cudaStream_t stream;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const ActivationParams params = activation(Activation::kSwiGLU, 0);
  const int64_t R = 256, F = 384;
  GradInputs in(params, R, F, true, {0, 64, 192, 256}, 21);
  const QuantConfig c = fp8_config(true, true, false);
  const int64_t C = in.in_cols;
  const ref::Quantized first = ref::quantize(c, unfused_dh(params, in, stream), 1, R, C);
  const Copies got(c, first, R, C);
  DeviceBuffer<float> dprobs(R), ws(activation_backward_quantized_workspace(params, R, F));
  dprobs.fill_bytes(0xFF);
  auto call = [&] {
    activation_backward_quantized(params, in.h_view(), in.probs_view(), in.d_out_view(), in.offsets_view(), c, got.q,
                                  TensorView(dprobs.get(), DType::kFP32, {R}),
                                  TensorView(ws.get(), DType::kFP32, {static_cast<int64_t>(ws.size())}), stream);
  };
  call();  // eager
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const std::vector<float> eager_dp = dprobs.download();
  got.expect_equal(first, "eager");
  const CapturedGraph graph(stream, call);
  dprobs.fill_bytes(0xFF);
  graph.launch();
  got.expect_equal(first, "first replay");
  EXPECT_EQ(dprobs.download(), eager_dp) << "dprobs of the replay against the eager call";
  // New h, d_out, probs and group offsets in the same buffers: the replay reads them all on the device.
  const GradInputs next(params, R, F, true, {0, 32, 32, 160}, 22);
  in.dh.upload(next.h);
  in.dd_out.upload(next.d_out);
  in.dprobs.upload(next.probs);
  in.doffsets.upload(next.offsets);
  in.h = next.h;
  in.d_out = next.d_out;
  in.probs = next.probs;
  in.offsets = next.offsets;
  const ref::Quantized second = ref::quantize(c, unfused_dh(params, in, stream), 1, R, C);
  dprobs.fill_bytes(0xFF);
  graph.launch();
  got.expect_equal(second, "second replay");
  expect_dprobs(params, in, dprobs.download(), "second replay");
  cudaStreamDestroy(stream);
}

TEST(ActivationBackwardQuantize, ZeroRowsAndBadInput) {
  MOE_REQUIRE_GPU();
  const ActivationParams params = activation(Activation::kSwiGLU, 0);
  {
    DeviceBuffer<uint16_t> h(16);
    DeviceBuffer<float> probs(4);
    const QuantConfig c = fp8_config(true, true, false);
    const ref::Quantized want = ref::quantize(c, {}, 1, 0, 256);
    const Copies got(c, want, 0, 256);
    activation_backward_quantized(params, TensorView(h.get(), DType::kBF16, {0, 256}),
                                  TensorView(probs.get(), DType::kFP32, {0}),
                                  TensorView(h.get(), DType::kBF16, {0, 128}), TensorView(), c, got.q,
                                  TensorView(probs.get(), DType::kFP32, {0}), TensorView(probs.get(), DType::kFP32, {0}),
                                  nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    got.expect_equal(want, "zero rows");
  }
  const int64_t R = 128, F = 128;
  const GradInputs in(params, R, F, true, {}, 5);
  const QuantConfig c = fp8_config(true, true, false);
  const ref::Quantized shape = ref::quantize(c, std::vector<uint16_t>(R * 2 * F, 0), 1, R, 2 * F);
  const Copies out(c, shape, R, 2 * F);
  DeviceBuffer<float> dprobs(R), ws(activation_backward_quantized_workspace(params, R, F));
  const TensorView vdp(dprobs.get(), DType::kFP32, {R}), vws(ws.get(), DType::kFP32, {static_cast<int64_t>(ws.size())});
  auto run = [&](const TensorView& d_out, const QuantConfig& cfg, const QuantizedTensor& q, const TensorView& dp,
                 const TensorView& w) {
    activation_backward_quantized(params, in.h_view(), in.probs_view(), d_out, TensorView(), cfg, q, dp, w, nullptr);
  };
  QuantConfig mx = c;
  mx.format = QuantFormat::kMXFP8;
  expect_error_naming([&] { run(in.d_out_view(), mx, out.q, vdp, vws); }, "'config'");
  expect_error_naming([&] { run(TensorView(in.dd_out.get(), DType::kFP32, {R, F / 2}), c, out.q, vdp, vws); },
                      "'d_out'");
  expect_error_naming([&] { run(TensorView(in.dd_out.get(), DType::kBF16, {R, F - 8}), c, out.q, vdp, vws); },
                      "'h'");  // F is taken from d_out, so h [R, 2F] is what no longer fits
  expect_error_naming([&] { run(in.d_out_view(), c, out.q, TensorView(dprobs.get(), DType::kFP32, {R - 1}), vws); },
                      "'dprobs'");
  expect_error_naming(
      [&] { run(in.d_out_view(), c, out.q, vdp, TensorView(ws.get(), DType::kFP32, {static_cast<int64_t>(ws.size()) - 1})); },
      "'dprobs_workspace'");
  expect_error_naming([&] { run(in.d_out_view(), c, out.q, vdp, TensorView()); }, "'dprobs_workspace'");
  std::vector<float> host_ws(ws.size());
  expect_error_naming([&] {
    run(in.d_out_view(), c, out.q, vdp,
        TensorView(host_ws.data(), DType::kFP32, {static_cast<int64_t>(host_ws.size())}, Device::kCPU));
  }, "'dprobs_workspace'");
  QuantizedTensor bad = out.q;
  bad.rowwise_data = TensorView(out.rd.get(), DType::kFP8E4M3, {R, F});
  expect_error_naming([&] { run(in.d_out_view(), c, bad, vdp, vws); }, "'out.rowwise_data'");
}

}  // namespace
}  // namespace moe
