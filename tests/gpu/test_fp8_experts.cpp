// GroupedExperts with the FP8 block-scaling recipe (ExpertsConfig::fp8 = kBlock): forward and
// backward against the bf16 experts on the same data, both weight layouts bitwise equal, a CUDA
// graph replayed with new data bitwise equal to eager (both recipes), power-of-two scales
// (kBlockPow2: the weight copies bitwise the reference's, every scale a power of two), train /
// eval / train with weights changed between the steps equal to train / train (no stale quantized
// weights), the gathered forward and backward bitwise the permuted ones, an expert off the 128-row
// grid reported, bad configurations named.
//
// Tolerance against the bf16 experts: relative L2 error <= 0.15 for every output and gradient.
// Each quantized operand carries E4M3 rounding (at most 2^-4 relative per element, about 2.5% RMS
// for values spread over binades); an output passes through at most four quantized operands on its
// way (x, W1, act, W2 for Y; dY, W2, dh, W1 for dx), so its normwise error is expected below ~7%
// (printed), where a scale applied to the wrong block or a wrong copy gives errors of order 100%.
// The FP8 GEMMs' own accuracy against a dequantize-then-fp64 reference is in test_fp8_grouped_gemm.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe/checkpoint_fp8.h"
#include "moe/checkpoint_quant.h"
#include "moe/error.h"
#include "moe/grouped_experts.h"
#include "reference/quantize_ref.h"
#include "support/expect_error.h"
#include "support/gpu.h"
#include "support/layer_data.h"

namespace moe {
namespace {

using testing::DeviceBuffer;
using testing::expect_error_naming;
using namespace testing::layer_data;

constexpr double kNormwise = 0.15;

double relative_l2(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) num += (got[i] - want[i]) * (got[i] - want[i]), den += want[i] * want[i];
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

ExpertsConfig experts_config(Activation act, bool bias, ProbsPlacement probs, WgradMode wgrad, Fp8Recipe fp8,
                             WeightLayout layout) {
  ExpertsConfig c;
  c.hidden = 256;
  c.ffn = 384;
  c.experts = 4;
  c.max_rows = 768;
  c.activation.kind = act;
  c.bias = bias;
  c.probs = probs;
  c.layout = layout;
  c.wgrad = wgrad;
  c.wgrad_dtype = DType::kFP32;
  c.fp8 = fp8;
  return c;
}

// Inputs of one micro-batch: x_perm, probs_perm, dY in expert groups of 128-aligned rows.
struct Inputs {
  int64_t rows;
  std::vector<int32_t> off;
  DeviceBuffer<uint16_t> x, dY;
  DeviceBuffer<float> probs;
  DeviceBuffer<int32_t> g;
  Inputs(const ExpertsConfig& c, const std::vector<int>& sizes, uint64_t seed) {
    off = {0};
    for (int s : sizes) off.push_back(off.back() + s);
    rows = off.back();
    std::mt19937_64 rng(seed);
    x = DeviceBuffer<uint16_t>(to_bf16(random_bf16_values(rows * c.hidden, 1.0, rng)));
    dY = DeviceBuffer<uint16_t>(to_bf16(random_bf16_values(rows * c.hidden, 1.0, rng)));
    std::uniform_real_distribution<float> u(0.1f, 1.0f);
    std::vector<float> p(rows);
    for (float& v : p) v = u(rng);
    probs = DeviceBuffer<float>(p);
    g = DeviceBuffer<int32_t>(off);
  }
  // Copies another micro-batch's data into these buffers (same shapes), on the stream.
  void copy_from(const Inputs& o, cudaStream_t s) {
    MOE_CUDA_CHECK(cudaMemcpyAsync(x.get(), o.x.get(), x.size() * 2, cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(dY.get(), o.dY.get(), dY.size() * 2, cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(probs.get(), o.probs.get(), probs.size() * 4, cudaMemcpyDeviceToDevice, s));
    MOE_CUDA_CHECK(cudaMemcpyAsync(g.get(), o.g.get(), g.size() * 4, cudaMemcpyDeviceToDevice, s));
  }
};

// One GroupedExperts with its parameters, gradients, state and outputs at fixed addresses.
struct ExpertsRun {
  ExpertsConfig c;
  GroupedExperts ex;
  DeviceParam W1, W2, B1, B2, G1, G2, GB1, GB2;
  SavedState state, eval_state;
  DeviceBuffer<uint16_t> y, dx;
  DeviceBuffer<float> dprobs;

  ExpertsRun(const ExpertsConfig& cfg, uint64_t seed) : c(cfg), ex(cfg) {
    const int E = c.experts;
    const int64_t H = c.hidden, F = c.ffn, F1 = c.fc1_out();
    std::mt19937_64 rng(seed);
    // FP8 primary weights bind fp32 master weights (here with bf16 values unless a test changes them).
    const DType wt = c.fp8_weight_refresh == Fp8WeightRefresh::kFromMaster ? DType::kFP32 : DType::kBF16;
    W1 = make_param(random_bf16_values(E * F1 * H, 0.1, rng), E, {F1, H}, wt, c.layout);
    W2 = make_param(random_bf16_values(E * H * F, 0.1, rng), E, {H, F}, wt, c.layout);
    B1 = make_param(random_bf16_values(E * F1, 0.5, rng), E, {F1}, DType::kBF16, c.layout);
    B2 = make_param(random_bf16_values(E * H, 0.5, rng), E, {H}, DType::kBF16, c.layout);
    G1 = make_param(std::vector<double>(E * F1 * H, 0.5), E, {F1, H}, DType::kFP32, c.layout);
    G2 = make_param(std::vector<double>(E * H * F, 0.5), E, {H, F}, DType::kFP32, c.layout);
    GB1 = make_param(std::vector<double>(E * F1, 0.5), E, {F1}, DType::kFP32, c.layout);
    GB2 = make_param(std::vector<double>(E * H, 0.5), E, {H}, DType::kFP32, c.layout);
    const bool b = c.bias;
    ex.set_weights({W1.views, b ? B1.views : std::vector<TensorView>{}, W2.views, b ? B2.views : std::vector<TensorView>{}});
    ex.set_grads({G1.views, b ? GB1.views : std::vector<TensorView>{}, G2.views, b ? GB2.views : std::vector<TensorView>{}});
    state = ex.new_state();
    eval_state = ex.new_state();
    y = DeviceBuffer<uint16_t>(c.max_rows * H);
    dx = DeviceBuffer<uint16_t>(c.max_rows * H);
    dprobs = DeviceBuffer<float>(c.max_rows);
  }
  // Both weight matrices' bytes to zero (the biases stay): an op whose own weights cannot be the
  // ones it computes with.
  void zero_weights() {
    for (DeviceParam* w : {&W1, &W2})
      for (auto& b : w->bufs) b.fill_bytes(0);
  }
  bool probs_in_act() const { return c.probs == ProbsPlacement::kInActivation; }
  TensorView rows_view(const DeviceBuffer<uint16_t>& b, int64_t rows) const {
    return TensorView(b.get(), DType::kBF16, {rows, c.hidden});
  }
  TensorView pp(const Inputs& in) const {
    return probs_in_act() ? TensorView(in.probs.get(), DType::kFP32, {in.rows}) : TensorView();
  }
  TensorView g(const Inputs& in) const { return TensorView(in.g.get(), DType::kInt32, {int64_t(c.experts) + 1}); }
  void forward(const Inputs& in, cudaStream_t s) {
    ex.forward(rows_view(in.x, in.rows), g(in), pp(in), rows_view(y, in.rows), state, s);
  }
  void eval_forward(const Inputs& in, cudaStream_t s) {
    ex.forward(rows_view(in.x, in.rows), g(in), pp(in), rows_view(y, in.rows), eval_state, s);
  }
  void backward(const Inputs& in, cudaStream_t s) {
    ex.backward(rows_view(in.dY, in.rows), rows_view(dx, in.rows),
                probs_in_act() ? TensorView(dprobs.get(), DType::kFP32, {in.rows}) : TensorView(), state, s);
  }
  // A training step of one micro-batch: forward, then backward.
  void train_step(const Inputs& in, cudaStream_t s) {
    forward(in, s);
    backward(in, s);
  }
  // Every output and gradient, as doubles: y, dx, dprobs, dW1, dW2, db1, db2.
  std::vector<std::vector<double>> results(const Inputs& in) const {
    std::vector<std::vector<double>> r;
    const size_t n = size_t(in.rows * c.hidden);
    std::vector<double> yy = from_bf16(y.download()), xx = from_bf16(dx.download());
    yy.resize(n), xx.resize(n);
    r.push_back(yy);
    r.push_back(xx);
    std::vector<float> dp = dprobs.download();
    r.push_back(probs_in_act() ? std::vector<double>(dp.begin(), dp.begin() + in.rows) : std::vector<double>{});
    r.push_back(download_param(G1, DType::kFP32));
    r.push_back(download_param(G2, DType::kFP32));
    if (c.bias) r.push_back(download_param(GB1, DType::kFP32)), r.push_back(download_param(GB2, DType::kFP32));
    return r;
  }
};

const char* const kNames[] = {"y", "dx_perm", "dprobs", "fc1.weight grad", "fc2.weight grad", "fc1.bias grad",
                              "fc2.bias grad"};

class Fp8Experts : public testing::StreamTest {};

TEST_F(Fp8Experts, CloseToTheBf16ExpertsAndBothLayoutsBitwiseEqual) {
  struct Case {
    Activation act;
    bool bias;
    ProbsPlacement probs;
    WgradMode wgrad;
  };
  // Without the fc1 bias dh is quantized as the activation backward computes it (SwiGLU, F = 384:
  // paired tiles, dprobs per tile; squared-relu), with it by the two kernels apart.
  const Case cases[] = {{Activation::kSwiGLU, true, ProbsPlacement::kInActivation, WgradMode::kWrite},
                        {Activation::kSwiGLU, false, ProbsPlacement::kInActivation, WgradMode::kWrite},
                        {Activation::kSquaredReLU, false, ProbsPlacement::kAtCombine, WgradMode::kAccumulate},
                        {Activation::kGeGLU, true, ProbsPlacement::kInActivation, WgradMode::kAccumulate}};
  for (const Case& k : cases) {
    const ExpertsConfig bf16 = experts_config(k.act, k.bias, k.probs, k.wgrad, Fp8Recipe::kNone, WeightLayout::kSingleGrouped);
    const ExpertsConfig fp8 = experts_config(k.act, k.bias, k.probs, k.wgrad, Fp8Recipe::kBlock, WeightLayout::kSingleGrouped);
    const ExpertsConfig fp8_pe = experts_config(k.act, k.bias, k.probs, k.wgrad, Fp8Recipe::kBlock, WeightLayout::kPerExpert);
    const Inputs in(bf16, {256, 0, 128, 384}, 5);
    ExpertsRun ref(bf16, 9), q(fp8, 9), qp(fp8_pe, 9);  // the same parameter values
    for (ExpertsRun* r : {&ref, &q, &qp}) r->train_step(in, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_NO_THROW(q.ex.check_errors(stream));
    const auto want = ref.results(in), got = q.results(in), got_pe = qp.results(in);
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i].empty()) continue;
      const double e = relative_l2(got[i], want[i]);
      std::printf("%s bias=%d: %s relative L2 error vs bf16 = %.4f\n", activation_name(k.act), k.bias, kNames[i], e);
      EXPECT_LE(e, kNormwise) << kNames[i];
      EXPECT_EQ(got[i], got_pe[i]) << kNames[i] << ": the weight layouts differ";
    }
  }
}

TEST_F(Fp8Experts, GraphReplayWithNewDataIsBitwiseEager) {
  for (Fp8Recipe recipe : {Fp8Recipe::kBlock, Fp8Recipe::kBlockPow2}) {
    for (bool bias : {true, false}) {  // dh quantized apart / as the activation backward computes it
      const ExpertsConfig c = experts_config(Activation::kSwiGLU, bias, ProbsPlacement::kInActivation,
                                             WgradMode::kWrite, recipe, WeightLayout::kSingleGrouped);
      Inputs a(c, {128, 256, 0, 384}, 1), b(c, {0, 512, 128, 128}, 2);
      ExpertsRun eager(c, 3), graphed(c, 3);
      eager.train_step(b, stream);

      const testing::CapturedGraph graph(stream, [&] { graphed.train_step(a, stream); });
      a.copy_from(b, stream);
      graph.launch();
      EXPECT_EQ(graphed.results(b), eager.results(b)) << "bias=" << bias << " pow2=" << (recipe == Fp8Recipe::kBlockPow2);
    }
  }
}

std::vector<uint8_t> device_bytes(const TensorView& t) {
  std::vector<uint8_t> h(t.nbytes());
  MOE_CUDA_CHECK(cudaMemcpy(h.data(), t.data, h.size(), cudaMemcpyDeviceToHost));
  return h;
}

TEST_F(Fp8Experts, PowerOfTwoScalesAsTransformerEngineComputesThem) {
  // kBlockPow2 (Float8BlockScaling's default): each weight copy is bitwise the reference's
  // quantization with pow2_scale, every scale a power of two; the results stay within the FP8
  // tolerance of the bf16 experts, both layouts bitwise equal, and differ from kBlock's (the
  // tokens' scales are rounded too: with weights whose 128x128 blocks have amax 448 x 2^-j, both
  // recipes make the same weight copies, so only the tokens' quantization tells them apart).
  const ExpertsConfig bf16 = experts_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation, WgradMode::kWrite,
                                            Fp8Recipe::kNone, WeightLayout::kSingleGrouped);
  ExpertsConfig pow2 = bf16, pow2_pe = bf16, block = bf16;
  pow2.fp8 = pow2_pe.fp8 = Fp8Recipe::kBlockPow2;
  pow2_pe.layout = WeightLayout::kPerExpert;
  block.fp8 = Fp8Recipe::kBlock;
  const Inputs in(bf16, {256, 0, 128, 384}, 81);
  ExpertsRun ref(bf16, 82), q(pow2, 82), qp(pow2_pe, 82), b(block, 82);
  // Every 128x128 block of both weights gets one element 448 x 2^-5 = 14, far above the block's
  // random others (of scale 0.1): the block's amax, so its scale is 2^5 in either recipe.
  for (ExpertsRun* r : {&ref, &q, &qp, &b}) {
    for (DeviceParam* w : {&r->W1, &r->W2}) {
      const int64_t rows = w == &r->W1 ? r->c.fc1_out() : r->c.hidden, cols = w == &r->W1 ? r->c.hidden : r->c.ffn;
      std::vector<double> v = download_param(*w, DType::kBF16);
      for (int e = 0; e < r->c.experts; ++e)
        for (int64_t i = 0; i < rows; i += 128)
          for (int64_t j = 0; j < cols; j += 128) v[(e * rows + i) * cols + j] = 448.0 / 32;
      *w = make_param(v, r->c.experts, {rows, cols}, DType::kBF16, r->c.layout);
    }
    const bool bias = r->c.bias;
    r->ex.set_weights({r->W1.views, bias ? r->B1.views : std::vector<TensorView>{}, r->W2.views,
                       bias ? r->B2.views : std::vector<TensorView>{}});
  }
  for (ExpertsRun* r : {&ref, &q, &qp, &b}) r->train_step(in, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_NO_THROW(q.ex.check_errors(stream));
  EXPECT_TRUE(q.ex.fp8_weights_format().pow2_scale);
  EXPECT_FALSE(b.ex.fp8_weights_format().pow2_scale);

  for (Param p : {Param::kFc1Weight, Param::kFc2Weight}) {
    const bool fc1 = p == Param::kFc1Weight;
    const int64_t rows = fc1 ? pow2.fc1_out() : pow2.hidden, cols = fc1 ? pow2.hidden : pow2.ffn;
    const std::vector<double> w = download_param(fc1 ? q.W1 : q.W2, DType::kBF16);
    const QuantConfig qc = q.ex.fp8_weights_format();
    const ref::Quantized want = ref::quantize_fp32(qc, std::vector<float>(w.begin(), w.end()), pow2.experts, rows, cols);
    const QuantizedTensor got = q.ex.fp8_weights(p), other = b.ex.fp8_weights(p);
    EXPECT_EQ(device_bytes(got.rowwise_data), want.rowwise_data) << param_name(p);
    EXPECT_EQ(device_bytes(got.rowwise_scale), want.rowwise_scale) << param_name(p);
    EXPECT_EQ(device_bytes(got.columnwise_data), want.columnwise_data) << param_name(p);
    EXPECT_EQ(device_bytes(got.columnwise_scale), want.columnwise_scale) << param_name(p);
    for (const TensorView& s : {got.rowwise_scale, got.columnwise_scale}) {
      const std::vector<uint8_t> bytes = device_bytes(s);
      for (size_t i = 0; i < bytes.size(); i += 4) {
        uint32_t bits;
        std::memcpy(&bits, bytes.data() + i, 4);
        ASSERT_EQ(bits & 0x007FFFFFu, 0u) << param_name(p) << ": scale " << i / 4 << " is not a power of two";
      }
    }
    EXPECT_EQ(device_bytes(got.rowwise_data), device_bytes(other.rowwise_data)) << param_name(p) << ": the weights' "
        "blocks were built to quantize alike in both recipes";
    EXPECT_EQ(device_bytes(got.rowwise_scale), device_bytes(other.rowwise_scale)) << param_name(p);
  }
  const auto want = ref.results(in), got = q.results(in), got_pe = qp.results(in), exact = b.results(in);
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i].empty()) continue;
    const double e = relative_l2(got[i], want[i]);
    std::printf("pow2 scales: %s relative L2 error vs bf16 = %.4f (fp32 scales %.4f)\n", kNames[i], e,
                relative_l2(exact[i], want[i]));
    EXPECT_LE(e, kNormwise) << kNames[i];
    EXPECT_EQ(got[i], got_pe[i]) << kNames[i] << ": the weight layouts differ";
  }
  EXPECT_NE(got[0], exact[0]) << "y: the tokens' scales were not rounded to powers of two";
}

TEST_F(Fp8Experts, TrainEvalTrainEqualsTrainTrain) {
  // Between the two steps the weights change in place (an optimizer step): an eval forward in
  // between must not leave quantized weights that the second step would use.
  const ExpertsConfig c = experts_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation, WgradMode::kWrite,
                                         Fp8Recipe::kBlock, WeightLayout::kSingleGrouped);
  const Inputs step1(c, {128, 128, 256, 256}, 11), eval(c, {384, 0, 0, 384}, 12), step2(c, {256, 256, 0, 256}, 13);
  std::mt19937_64 rng(99);
  const std::vector<uint16_t> w1_new = to_bf16(random_bf16_values(size_t(c.experts * c.fc1_out() * c.hidden), 0.1, rng));
  ExpertsRun with_eval(c, 21), without(c, 21), fresh(c, 21);
  for (ExpertsRun* r : {&with_eval, &without}) r->train_step(step1, stream);
  for (ExpertsRun* r : {&with_eval, &without, &fresh}) {
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    MOE_CUDA_CHECK(cudaMemcpy(r->W1.bufs[0].get(), w1_new.data(), w1_new.size() * 2, cudaMemcpyHostToDevice));
  }
  with_eval.eval_forward(eval, stream);
  for (ExpertsRun* r : {&with_eval, &without, &fresh}) r->train_step(step2, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  const auto a = with_eval.results(step2), b = without.results(step2), f = fresh.results(step2);
  // Gradients written (not accumulated): the second step's own values.
  EXPECT_EQ(a, b);
  EXPECT_EQ(a, f) << "the second step must use the new weights";
}

TEST_F(Fp8Experts, WeightsRefreshedOnRequest) {
  // kOnRequest: the copies are made by refresh_fp8_weights only. Refreshed after each change of
  // the weights, the results are bitwise those of kEveryForward; a forward without a refresh since
  // set_weights is refused.
  ExpertsConfig every = experts_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation, WgradMode::kWrite,
                                       Fp8Recipe::kBlock, WeightLayout::kPerExpert);
  ExpertsConfig on_request = every;
  on_request.fp8_weight_refresh = Fp8WeightRefresh::kOnRequest;
  const Inputs step1(every, {128, 128, 256, 256}, 31), step2(every, {0, 256, 256, 256}, 32);
  ExpertsRun a(every, 41), b(on_request, 41);
  expect_error_naming([&] { b.forward(step1, stream); }, "refresh_fp8_weights");
  b.ex.refresh_fp8_weights(stream);
  for (ExpertsRun* r : {&a, &b}) r->train_step(step1, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(a.results(step1), b.results(step1));
  // An optimizer step changes expert 2's fc2 weight in place; b refreshes, as its contract asks.
  std::mt19937_64 rng(7);
  const std::vector<uint16_t> w2 = to_bf16(random_bf16_values(size_t(every.hidden * every.ffn), 0.1, rng));
  for (ExpertsRun* r : {&a, &b})
    MOE_CUDA_CHECK(cudaMemcpy(r->W2.bufs[2].get(), w2.data(), w2.size() * 2, cudaMemcpyHostToDevice));
  b.ex.refresh_fp8_weights(stream);
  for (ExpertsRun* r : {&a, &b}) r->train_step(step2, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(a.results(step2), b.results(step2));
  // Rebinding the weights asks for a refresh again.
  b.ex.set_weights({b.W1.views, b.B1.views, b.W2.views, b.B2.views});
  expect_error_naming([&] { b.forward(step2, stream); }, "refresh_fp8_weights");
}

TEST_F(Fp8Experts, PrimaryWeightsFromFp32Master) {
  // kFromMaster: fp32 master weights bound, the FP8 copies the only weights computed with.
  ExpertsConfig on_request = experts_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation,
                                            WgradMode::kWrite, Fp8Recipe::kBlock, WeightLayout::kPerExpert);
  on_request.fp8_weight_refresh = Fp8WeightRefresh::kOnRequest;
  ExpertsConfig master = on_request, master_grouped = on_request;
  master.fp8_weight_refresh = master_grouped.fp8_weight_refresh = Fp8WeightRefresh::kFromMaster;
  master_grouped.layout = WeightLayout::kSingleGrouped;
  const Inputs step(on_request, {128, 256, 0, 384}, 51);
  ExpertsRun bf16(on_request, 61), a(master, 61), b(master_grouped, 61);
  expect_error_naming([&] { a.forward(step, stream); }, "refresh_fp8_weights");
  // Master values that bf16 holds exactly quantize to the bf16 weights' copies: bitwise the same
  // results as the bf16-bound run, in both layouts.
  for (ExpertsRun* r : {&bf16, &a, &b}) {
    r->ex.refresh_fp8_weights(stream);
    r->train_step(step, stream);
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(a.results(step), bf16.results(step));
  EXPECT_EQ(b.results(step), bf16.results(step));

  // An optimizer step writes master values bf16 cannot hold; a captured refresh quantizes them
  // straight from fp32: the copies are bitwise the reference's quantization of the fp32 values
  // (not of their bf16 rounding), the same in both layouts.
  const int E = master.experts;
  const int64_t H = master.hidden, F1 = master.fc1_out();
  std::mt19937_64 rng(71);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  std::vector<float> w1(size_t(E * F1 * H));
  for (float& v : w1) v = nd(rng);
  const testing::CapturedGraph refresh(stream, [&] { a.ex.refresh_fp8_weights(stream); });
  for (int e = 0; e < E; ++e)
    MOE_CUDA_CHECK(cudaMemcpy(a.W1.bufs[e].get(), w1.data() + e * F1 * H, F1 * H * 4, cudaMemcpyHostToDevice));
  MOE_CUDA_CHECK(cudaMemcpy(b.W1.bufs[0].get(), w1.data(), w1.size() * 4, cudaMemcpyHostToDevice));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());  // pageable copies may still be in flight on return
  refresh.launch();
  b.ex.refresh_fp8_weights(stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  QuantConfig qc;
  qc.format = QuantFormat::kFP8Block;
  qc.blocking = QuantBlocking::k2D;
  qc.columnwise = true;
  const ref::Quantized want = ref::quantize_fp32(qc, w1, E, F1, H);
  for (ExpertsRun* r : {&a, &b}) {
    const QuantizedTensor q = r->ex.fp8_weights(Param::kFc1Weight);
    auto bytes = [](const TensorView& t) {
      std::vector<uint8_t> h(t.nbytes());
      MOE_CUDA_CHECK(cudaMemcpy(h.data(), t.data, h.size(), cudaMemcpyDeviceToHost));
      return h;
    };
    EXPECT_EQ(bytes(q.rowwise_data), want.rowwise_data);
    EXPECT_EQ(bytes(q.rowwise_scale), want.rowwise_scale);
    EXPECT_EQ(bytes(q.columnwise_data), want.columnwise_data);
    EXPECT_EQ(bytes(q.columnwise_scale), want.columnwise_scale);
  }
  for (ExpertsRun* r : {&a, &b}) r->train_step(step, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(a.results(step), b.results(step));
  // bf16 weights are not master weights.
  expect_error_naming([&] { a.ex.set_weights({bf16.W1.views, bf16.B1.views, bf16.W2.views, bf16.B2.views}); },
                      "fc1.weight");
  expect_error_naming([&] { bf16.ex.fp8_weights(Param::kFc1Bias); }, "param");
}

// A checkpoint of expert weights written to a safetensors file and read back, with its keys as
// saved (single grouped) and split into per-expert keys.
struct ReadBack {
  StateDict loaded, split;
  Metadata md;
};
ReadBack through_safetensors(const StateDict& sd, const Metadata& md, const std::string& file,
                             const std::string& prefix, int experts) {
  const std::string path = ::testing::TempDir() + file;
  save_safetensors(path, sd, md);
  ReadBack r;
  r.loaded = load_safetensors(path, &r.md);
  r.split = r.loaded;
  normalize_expert_keys(r.split, prefix, experts, WeightLayout::kPerExpert);
  return r;
}

TEST_F(Fp8Experts, WeightsThroughACheckpointInEitherLayout) {
  // The FP8 copies saved to safetensors (grouped keys), converted to per-expert keys, and loaded
  // into ops whose own weights are zero (same biases): the loaded copies are the ones computed
  // with, bitwise.
  ExpertsConfig c = experts_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation, WgradMode::kWrite,
                                   Fp8Recipe::kBlock, WeightLayout::kSingleGrouped);
  c.fp8_weight_refresh = Fp8WeightRefresh::kOnRequest;
  ExpertsConfig master = c;
  master.fp8_weight_refresh = Fp8WeightRefresh::kFromMaster;
  master.layout = WeightLayout::kPerExpert;
  const Inputs step(c, {256, 128, 128, 256}, 81);
  ExpertsRun src(c, 91), grouped(c, 91), per_expert(master, 91);
  for (ExpertsRun* r : {&grouped, &per_expert}) r->zero_weights();
  src.ex.refresh_fp8_weights(stream);
  StateDict sd;
  Metadata md;
  save_fp8_expert_weights(src.ex, "layers.3.experts.", sd, md, stream);
  const std::vector<QuantizedParamDecl> decls = quantized_params(md);
  ASSERT_EQ(decls.size(), 2u);
  EXPECT_EQ(decls[0].key, "layers.3.experts.fc1.weight");
  EXPECT_EQ(format_quant_metadata(decls[0].config),
            "fp8_block;block=128x128;scale=f32;layout=row_major;copies=rowwise,columnwise");
  EXPECT_EQ(sd.at("layers.3.experts.fc2.weight_columnwise_scale_inv").shape(),
            (std::vector<int64_t>{c.experts, (c.ffn + 127) / 128, (c.hidden + 127) / 128}));
  const ReadBack back = through_safetensors(sd, md, "fp8_experts.safetensors", "layers.3.experts.", c.experts);
  const StateDict& loaded = back.loaded;
  const StateDict& split = back.split;
  const Metadata& md2 = back.md;
  ASSERT_TRUE(split.count("layers.3.experts.fc1.weight2_columnwise_scale_inv"));
  // A save before any copies exist is refused.
  expect_error_naming([&] { save_fp8_expert_weights(grouped.ex, "x.", sd, md, stream); }, "refresh_fp8_weights");
  // A missing part (or metadata entry) is named before anything moves: the copies keep their bytes.
  grouped.ex.refresh_fp8_weights(stream);
  auto copy_bytes = [&](const GroupedExperts& ex) {
    StateDict s;
    Metadata m;
    save_fp8_expert_weights(ex, "", s, m, stream);
    return s;
  };
  const StateDict before = copy_bytes(grouped.ex);
  StateDict broken = split;
  broken.erase("layers.3.experts.fc2.weight1_scale_inv");
  expect_error_naming([&] { load_fp8_expert_weights(grouped.ex, broken, md2, "layers.3.experts.", stream); },
                      "layers.3.experts.fc2.weight1_scale_inv");
  expect_error_naming([&] { load_fp8_expert_weights(grouped.ex, loaded, Metadata{}, "layers.3.experts.", stream); },
                      "moe.quant.layers.3.experts.fc1.weight");
  const StateDict after = copy_bytes(grouped.ex);
  for (const auto& [k, t] : before) EXPECT_TRUE(t.equals(after.at(k))) << k << " changed by a refused load";
  // pow2_scale in the metadata only says how the scales were made: accepted.
  Metadata md_pow2 = md2;
  QuantConfig pow2 = decls[1].config;
  pow2.pow2_scale = true;
  set_quant_metadata(md_pow2, "layers.3.experts.fc2.weight", pow2);
  load_fp8_expert_weights(grouped.ex, loaded, md_pow2, "layers.3.experts.", stream);
  load_fp8_expert_weights(per_expert.ex, split, md2, "layers.3.experts.", stream);
  for (ExpertsRun* r : {&src, &grouped, &per_expert}) r->train_step(step, stream);
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  EXPECT_EQ(grouped.results(step), src.results(step));
  EXPECT_EQ(per_expert.results(step), src.results(step));
  // Loading into an op that quantizes every forward is refused.
  ExpertsConfig every = c;
  every.fp8_weight_refresh = Fp8WeightRefresh::kEveryForward;
  ExpertsRun e(every, 94);
  expect_error_naming([&] { load_fp8_expert_weights(e.ex, loaded, md2, "layers.3.experts.", stream); },
                      "every forward");
}

TEST_F(Fp8Experts, EmulatedWeightsThroughACheckpointInEitherLayout) {
  // The emulated MXFP8 / NVFP4 experts' weight codes saved (grouped keys, NVFP4 with its global
  // amax), through a safetensors file, split into per-expert keys and loaded into ops whose own
  // weights are zero: the loaded codes (dequantized on load) are the ones computed with, bitwise.
  for (EmulatedQuant q : {EmulatedQuant::kMXFP8, EmulatedQuant::kNVFP4}) {
    SCOPED_TRACE(emulated_quant_name(q));
    ExpertsConfig c = experts_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation, WgradMode::kWrite,
                                     Fp8Recipe::kNone, WeightLayout::kSingleGrouped);
    c.emulated = q;
    c.fp8_weight_refresh = Fp8WeightRefresh::kOnRequest;
    ExpertsConfig per = c;
    per.layout = WeightLayout::kPerExpert;
    const Inputs step(c, {256, 96, 160, 256}, 83);
    ExpertsRun src(c, 95), grouped(c, 95), per_expert(per, 95);
    for (ExpertsRun* r : {&grouped, &per_expert}) r->zero_weights();
    src.ex.refresh_fp8_weights(stream);
    StateDict sd;
    Metadata md;
    save_fp8_expert_weights(src.ex, "layers.1.experts.", sd, md, stream);
    const std::vector<QuantizedParamDecl> decls = quantized_params(md);
    ASSERT_EQ(decls.size(), 2u);
    EXPECT_EQ(format_quant_metadata(decls[1].config),
              q == EmulatedQuant::kMXFP8 ? "mxfp8;block=1x32;scale=e8m0;layout=row_major;copies=rowwise,columnwise"
                                         : "nvfp4;block=16x16;scale=e4m3;layout=row_major;copies=rowwise,columnwise");
    EXPECT_EQ(sd.count("layers.1.experts.fc2.weight_amax"), q == EmulatedQuant::kNVFP4 ? 1u : 0u);
    const HostTensor& data = sd.at("layers.1.experts.fc2.weight");
    EXPECT_EQ(data.shape(), (std::vector<int64_t>{c.experts, c.hidden,
                                                  q == EmulatedQuant::kNVFP4 ? c.ffn / 2 : c.ffn}));
    const ReadBack back = through_safetensors(sd, md, "emulated_experts.safetensors", "layers.1.experts.", c.experts);
    const StateDict& loaded = back.loaded;
    const StateDict& split = back.split;
    const Metadata& md2 = back.md;
    load_fp8_expert_weights(grouped.ex, loaded, md2, "layers.1.experts.", stream);
    load_fp8_expert_weights(per_expert.ex, split, md2, "layers.1.experts.", stream);
    for (ExpertsRun* r : {&src, &grouped, &per_expert}) r->train_step(step, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_EQ(grouped.results(step), src.results(step));
    EXPECT_EQ(per_expert.results(step), src.results(step));
    // The other format's metadata is refused, naming the entry.
    Metadata wrong = md2;
    QuantConfig other = decls[0].config;
    other.format = q == EmulatedQuant::kMXFP8 ? QuantFormat::kNVFP4 : QuantFormat::kMXFP8;
    other.blocking = QuantBlocking::k1D;
    set_quant_metadata(wrong, "layers.1.experts.fc1.weight", other);
    expect_error_naming([&] { load_fp8_expert_weights(grouped.ex, loaded, wrong, "layers.1.experts.", stream); },
                        "moe.quant.layers.1.experts.fc1.weight");
  }
}

// The layer's calls: forward_gathered / backward_gathered quantize the rows of token matrices x and
// dy gathered through a row map (tokens twice and never, pad rows) -- bitwise forward / backward
// on the permuted rows, in both weight-gradient modes. No bf16 x_perm or dY rows are written:
// x_perm_out and dY_out are refused.
TEST_F(Fp8Experts, GatheredRowsGiveTheBitsOfThePermutedRows) {
  for (WgradMode w : {WgradMode::kWrite, WgradMode::kAccumulate}) {
    const ExpertsConfig c = experts_config(Activation::kSwiGLU, false, ProbsPlacement::kInActivation, w,
                                           Fp8Recipe::kBlock, WeightLayout::kSingleGrouped);
    const int64_t T = 300, H = c.hidden;
    const int slots = 2;
    Inputs in(c, {256, 0, 128, 384}, 7);
    std::mt19937_64 rng(8);
    const std::vector<uint16_t> x = to_bf16(random_bf16_values(T * H, 1.0, rng));
    const std::vector<uint16_t> dy = to_bf16(random_bf16_values(T * H, 1.0, rng));
    std::vector<int32_t> map(in.rows, -1);
    std::uniform_int_distribution<int32_t> slot(0, static_cast<int32_t>(T * slots - 1));
    for (size_t e = 0; e + 1 < in.off.size(); ++e)
      for (int32_t r = in.off[e]; r < in.off[e + 1] - 16; ++r) map[r] = slot(rng);  // 16 pad rows per group
    auto gather = [&](const std::vector<uint16_t>& src) {
      std::vector<uint16_t> g(in.rows * H, 0);
      for (int64_t r = 0; r < in.rows; ++r)
        if (map[r] >= 0) std::copy_n(src.begin() + (map[r] / slots) * H, H, g.begin() + r * H);
      return g;
    };
    in.x.upload(gather(x));
    in.dY.upload(gather(dy));
    const DeviceBuffer<uint16_t> x_tokens(x), dy_tokens(dy);
    const DeviceBuffer<int32_t> dmap(map);
    const TensorView xt(x_tokens.get(), DType::kBF16, {T, H}), dyt(dy_tokens.get(), DType::kBF16, {T, H});
    const TensorView mv(dmap.get(), DType::kInt32, {in.rows});

    ExpertsRun permuted(c, 9), gathered(c, 9);  // the same parameter values
    permuted.train_step(in, stream);
    GroupedExperts& ex = gathered.ex;
    const TensorView y = gathered.rows_view(gathered.y, in.rows), dx = gathered.rows_view(gathered.dx, in.rows);
    const TensorView dprobs(gathered.dprobs.get(), DType::kFP32, {in.rows});
    expect_error_naming([&] {
      ex.forward_gathered(xt, mv, slots, gathered.g(in), gathered.pp(in), y, gathered.rows_view(in.x, in.rows),
                          gathered.state, stream);
    }, "'x_perm_out'");
    ex.forward_gathered(xt, mv, slots, gathered.g(in), gathered.pp(in), y, TensorView(), gathered.state, stream);
    expect_error_naming([&] {
      ex.backward_gathered(dyt, mv, slots, gathered.rows_view(in.dY, in.rows), dx, dprobs, gathered.state, stream);
    }, "'dY_out'");
    ex.backward_gathered(dyt, mv, slots, TensorView(), dx, dprobs, gathered.state, stream);
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    EXPECT_NO_THROW(ex.check_errors(stream));
    const auto want = permuted.results(in), got = gathered.results(in);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], want[i]) << kNames[i];
  }
}

TEST_F(Fp8Experts, ExpertOffTheRowGridIsReported) {
  const ExpertsConfig c = experts_config(Activation::kSwiGLU, false, ProbsPlacement::kInActivation, WgradMode::kWrite,
                                         Fp8Recipe::kBlock, WeightLayout::kSingleGrouped);
  const Inputs in(c, {64, 192, 0, 0}, 4);  // expert 1 starts at row 64
  ExpertsRun r(c, 5);
  r.train_step(in, stream);
  expect_error_naming([&] { r.ex.check_errors(stream); }, "128-token block");
  EXPECT_NO_THROW(r.ex.check_errors(stream)) << "check_errors clears the word";
}

TEST_F(Fp8Experts, BadConfigurationsNameTheField) {
  ExpertsConfig c = experts_config(Activation::kSwiGLU, false, ProbsPlacement::kInActivation, WgradMode::kWrite,
                                   Fp8Recipe::kBlock, WeightLayout::kSingleGrouped);
  ExpertsConfig bad = c;
  bad.fuse_fc1 = true;
  expect_error_naming([&] { bad.validate(); }, "'fp8'");
  bad = c;
  bad.max_rows = 760;
  expect_error_naming([&] { bad.validate(); }, "'max_rows'");
  bad = c;
  bad.ffn = 200;  // a multiple of 8, not of 16
  expect_error_naming([&] { bad.validate(); }, "'fp8'");
  bad = c;
  bad.fp8 = static_cast<Fp8Recipe>(7);
  expect_error_naming([&] { bad.validate(); }, "'fp8'");
  // Rows of a call: multiples of 16.
  ExpertsRun r(c, 1);
  const Inputs in(c, {128, 0, 0, 0}, 2);
  expect_error_naming([&] {
    r.ex.forward(TensorView(in.x.get(), DType::kBF16, {120, c.hidden}), r.g(in),
                 TensorView(in.probs.get(), DType::kFP32, {120}), TensorView(r.y.get(), DType::kBF16, {120, c.hidden}),
                 r.state, stream);
  }, "'x_perm'");
}

}  // namespace
}  // namespace moe
