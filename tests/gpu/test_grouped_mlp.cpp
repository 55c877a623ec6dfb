// The expert layer GroupedMlp on the GPU against the CPU reference GroupedMlpRef: every variant,
// both layouts, main_grad, delayed wgrad, recompute, edge cases, graph replay, saved-state misuse
// and bad input -- each for the unfused path, for the fused fc1 (fuse_fc1) and for the fused fc2
// dgrad (fuse_fc2_dgrad), which must also match the unfused path within the same bound.
//
// Tolerances: the reference runs in fp64 on the same bf16 inputs and rounds every intermediate the
// layer stores in bf16 (emulate_bf16), so what remains is fp32 accumulation order and 1-ulp
// rounding flips of bf16 intermediates (~1e-3 relative). Each tensor must be within a relative L2
// error of 1e-2 and a max error of 5e-2 * max|ref| -- loose enough for rounding, far too tight for
// a wrong index, a missing prob or a missing bias (each of which is O(1) relative).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "moe/error.h"
#include "moe/float_convert.h"
#include "moe/grouped_experts.h"
#include "moe/grouped_mlp.h"
#include "moe/saved_state.h"
#include "reference/grouped_mlp_ref.h"
#include "reference/routing_gen.h"
#include "support/expect_error.h"
#include "support/gpu.h"
#include "support/layer_data.h"

namespace moe {
namespace {

using testing::DeviceBuffer;
using namespace testing::layer_data;

// Pointer table of a host [E, per] block for the reference.
std::vector<double*> table(std::vector<double>& v, int E) {
  std::vector<double*> t;
  if (v.empty()) return t;
  const size_t per = v.size() / E;
  for (int e = 0; e < E; ++e) t.push_back(v.data() + e * per);
  return t;
}

// Everything of one test case: config, data, both implementations, results.
struct Case {
  GroupedMlpConfig cfg;
  int64_t T = 0;
  uint64_t seed = 1;
  double skew = 0.0;
  // Between the forward and the backward, the same weights in new buffers bound with rebind_weights
  // and the old ones overwritten with NaN (parameters gathered again, as FSDP does).
  bool rebind_before_backward = false;
  // Frozen experts: the backward computes dx and dprobs only; with bind_grads false set_grads is never called.
  WeightGrads weight_grads = WeightGrads::kCompute;
  bool bind_grads = true;
};

struct Outputs {
  std::vector<double> y, dx, dprobs, dw1, db1, dw2, db2;
  std::vector<int> hook_order;
};

struct Runner {
  Case c;
  std::mt19937_64 rng;
  ref::Routing routing;
  std::vector<double> x, dy, w1, b1, w2, b2, g1, gb1, g2, gb2;  // g*: initial main_grad (accumulate)
  DType gtype;

  explicit Runner(const Case& cs) : c(cs), rng(cs.seed) {
    const auto& k = c.cfg;
    const int E = k.experts;
    const int64_t H = k.hidden, F = k.ffn, F1 = k.fc1_out();
    routing = k.routing_form == RoutingForm::kTopK ? ref::make_topk_routing(c.T, E, k.topk, c.seed, c.skew)
                                                   : ref::make_map_routing(c.T, E, k.topk, c.seed);
    x = random_bf16_values(c.T * H, 1.0, rng);
    dy = random_bf16_values(c.T * H, 1.0, rng);
    w1 = random_bf16_values(size_t(E) * F1 * H, 1.0 / std::sqrt(double(H)), rng);
    w2 = random_bf16_values(size_t(E) * H * F, 1.0 / std::sqrt(double(F)), rng);
    if (k.bias) {
      b1 = random_bf16_values(size_t(E) * F1, 0.5, rng);
      b2 = random_bf16_values(size_t(E) * H, 0.5, rng);
    }
    gtype = k.wgrad == WgradMode::kAccumulate ? DType::kFP32 : k.wgrad_dtype;
    auto init = [&](size_t n) {
      return k.wgrad == WgradMode::kAccumulate ? random_bf16_values(n, 1.0, rng) : std::vector<double>(n, 0.0);
    };
    g1 = init(size_t(E) * F1 * H);
    g2 = init(size_t(E) * H * F);
    if (k.bias) {
      gb1 = init(size_t(E) * F1);
      gb2 = init(size_t(E) * H);
    }
  }

  // quant: the reference with quantized GEMM operands (the FP8 recipe's), or plain.
  Outputs run_reference(const ref::OperandQuant* quant = nullptr) {
    const auto& k = c.cfg;
    Outputs o;
    ref::GroupedMlpRef layer(k, /*emulate_bf16=*/true);
    if (quant) layer.set_operand_quant(*quant);
    ref::ExpertParams w{table(w1, k.experts), table(b1, k.experts), table(w2, k.experts), table(b2, k.experts)};
    o.dw1 = g1;
    o.dw2 = g2;
    o.db1 = gb1;
    o.db2 = gb2;
    ref::ExpertParams g{table(o.dw1, k.experts), table(o.db1, k.experts), table(o.dw2, k.experts),
                        table(o.db2, k.experts)};
    layer.set_weights(w);
    layer.set_grads(g);
    o.y.resize(c.T * k.hidden);
    o.dx.resize(c.T * k.hidden);
    o.dprobs.resize(c.T * routing.slots());
    layer.forward(routing, x.data(), o.y.data());
    layer.backward(dy.data(), o.dx.data(), o.dprobs.data());
    if (k.delay_wgrad) layer.backward_dw();
    return o;
  }

  Outputs run_gpu(WeightLayout layout) {
    GroupedMlpConfig k = c.cfg;
    k.layout = layout;
    const int E = k.experts;
    const int64_t H = k.hidden, F = k.ffn, F1 = k.fc1_out();
    Outputs o;
    GroupedMlp layer(k);
    // transposed_weights: every expert matrix (weights and their gradients) stored [cols, rows].
    const bool tw = k.transposed_weights;
    auto weight = [&](const std::vector<double>& v, int64_t rows, int64_t cols, DType t) {
      return tw ? make_param(transpose_experts(v, E, rows, cols), E, {cols, rows}, t, layout)
                : make_param(v, E, {rows, cols}, t, layout);
    };
    auto W1 = weight(w1, F1, H, DType::kBF16);
    auto W2 = weight(w2, H, F, DType::kBF16);
    auto G1 = weight(g1, F1, H, gtype);
    auto G2 = weight(g2, H, F, gtype);
    DeviceParam B1, B2, GB1, GB2;
    if (k.bias) {
      B1 = make_param(b1, E, {F1}, DType::kBF16, layout);
      B2 = make_param(b2, E, {H}, DType::kBF16, layout);
      GB1 = make_param(gb1, E, {F1}, gtype, layout);
      GB2 = make_param(gb2, E, {H}, gtype, layout);
    }
    layer.set_weights({W1.views, B1.views, W2.views, B2.views});
    if (c.bind_grads) layer.set_grads({G1.views, GB1.views, G2.views, GB2.views});
    for (Param p : {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias})
      layer.register_hook(p, [&o](Param q) { o.hook_order.push_back(static_cast<int>(q)); });

    const int slots = routing.slots();
    DeviceBuffer<uint16_t> dx_(c.T * H), y_(c.T * H), x_(to_bf16(x)), dy_(to_bf16(dy));
    DeviceBuffer<float> probs_(std::vector<float>(routing.probs.begin(), routing.probs.end())), dprobs_(c.T * slots);
    DeviceBuffer<int32_t> idx_(routing.form == RoutingForm::kTopK ? routing.indices : std::vector<int32_t>());
    DeviceBuffer<uint8_t> map_(routing.form == RoutingForm::kMap ? routing.map : std::vector<uint8_t>());
    RoutingView rv;
    rv.form = routing.form;
    if (routing.form == RoutingForm::kTopK)
      rv.indices = TensorView(idx_.get(), DType::kInt32, {c.T, slots});
    else
      rv.map = TensorView(map_.get(), DType::kUInt8, {c.T, E});
    rv.probs = TensorView(probs_.get(), DType::kFP32, {c.T, slots});
    y_.fill_bytes(0xFF);  // poison: every output element must be written
    dx_.fill_bytes(0xFF);
    dprobs_.fill_bytes(0xFF);
    cudaStream_t s = nullptr;
    const SavedState st = layer.new_state();
    layer.forward(TensorView(x_.get(), DType::kBF16, {c.T, H}), rv, TensorView(y_.get(), DType::kBF16, {c.T, H}), st,
                  s);
    DeviceParam W1b, W2b, B1b, B2b;
    if (c.rebind_before_backward) {
      W1b = weight(w1, F1, H, DType::kBF16);
      W2b = weight(w2, H, F, DType::kBF16);
      if (k.bias) {
        B1b = make_param(b1, E, {F1}, DType::kBF16, layout);
        B2b = make_param(b2, E, {H}, DType::kBF16, layout);
      }
      layer.rebind_weights({W1b.views, B1b.views, W2b.views, B2b.views});
      for (DeviceParam* old : {&W1, &W2, &B1, &B2})
        for (auto& b : old->bufs) b.fill_bytes(0xFF);
    }
    layer.backward(TensorView(dy_.get(), DType::kBF16, {c.T, H}), TensorView(dx_.get(), DType::kBF16, {c.T, H}),
                   TensorView(dprobs_.get(), DType::kFP32, {c.T, slots}), st, s, nullptr, c.weight_grads);
    if (k.delay_wgrad) {
      EXPECT_TRUE(o.hook_order.empty()) << "delayed mode: no hook may fire before backward_dw";
      layer.backward_dw(st, s);
    }
    layer.check_errors(s);
    o.y = from_bf16(y_.download());
    o.dx = from_bf16(dx_.download());
    auto dp = dprobs_.download();
    o.dprobs.assign(dp.begin(), dp.end());
    o.dw1 = download_param(G1, gtype);
    o.dw2 = download_param(G2, gtype);
    if (tw) {  // back to the [E, rows, cols] order of the reference
      o.dw1 = transpose_experts(o.dw1, E, H, F1);
      o.dw2 = transpose_experts(o.dw2, E, F, H);
    }
    if (k.bias) {
      o.db1 = download_param(GB1, gtype);
      o.db2 = download_param(GB2, gtype);
    }
    return o;
  }
};

void compare(const Outputs& got, const Outputs& want, bool bias) {
  expect_close(got.y, want.y, "y");
  expect_close(got.dx, want.dx, "dx");
  expect_close(got.dprobs, want.dprobs, "dprobs");
  expect_close(got.dw1, want.dw1, "fc1.weight grad");
  expect_close(got.dw2, want.dw2, "fc2.weight grad");
  if (bias) {
    expect_close(got.db1, want.db1, "fc1.bias grad");
    expect_close(got.db2, want.db2, "fc2.bias grad");
  }
}

void expect_bitwise(const Outputs& a, const Outputs& b) {
  EXPECT_EQ(a.y, b.y);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dprobs, b.dprobs);
  EXPECT_EQ(a.dw1, b.dw1);
  EXPECT_EQ(a.dw2, b.dw2);
  EXPECT_EQ(a.db1, b.db1);
  EXPECT_EQ(a.db2, b.db2);
}

// The same case on the unfused path (x_perm kept, no fused kernel): the GPU reference the fused
// kernels are held to, same data.
Outputs run_unfused(const Case& c) {
  Case u = c;
  u.cfg.fuse_fc1 = false;
  u.cfg.save_x_perm = true;
  u.cfg.fuse_fc2_dgrad = false;
  return Runner(u).run_gpu(WeightLayout::kSingleGrouped);
}

GroupedMlpConfig small_config() {
  GroupedMlpConfig c;
  c.hidden = 128;
  c.ffn = 64;
  c.experts = 6;
  c.topk = 2;
  c.max_tokens = 64;
  return c;
}

struct Variant {
  Activation act;
  bool bias;
  ProbsPlacement probs;
  int interleave;
  int align;
  bool fused = false;
  bool recompute = false;
  bool gathered = false;  // fused without x_perm (save_x_perm = false)
  bool dgrad = false;     // fused fc2 dgrad + activation backward (fuse_fc2_dgrad)
};

std::string variant_name(const Variant& v) {
  std::string name = activation_name(v.act);
  name += v.bias ? "_bias" : "_nobias";
  name += v.probs == ProbsPlacement::kInActivation ? "_probsInAct" : "_probsAtCombine";
  name += "_il" + std::to_string(v.interleave) + "_A" + std::to_string(v.align);
  if (v.recompute) name += "_recompute";
  if (v.gathered) name += "_noXPerm";
  if (v.dgrad) name += "_fusedDgrad";
  for (char& ch : name)
    if (ch == '-') ch = '_';
  return name;
}

class LayerVariants : public ::testing::TestWithParam<Variant> {};

TEST_P(LayerVariants, MatchesReferenceInBothLayoutsBitwiseEqual) {
  MOE_REQUIRE_GPU();
  const Variant v = GetParam();
  Case c;
  c.cfg = small_config();
  c.cfg.activation.kind = v.act;
  c.cfg.activation.glu_interleave = v.interleave;
  c.cfg.bias = v.bias;
  c.cfg.probs = v.probs;
  c.cfg.dispatch.align = v.align;
  c.cfg.fuse_fc1 = v.fused;
  c.cfg.recompute = v.recompute;
  c.cfg.save_x_perm = !v.gathered;
  c.cfg.fuse_fc2_dgrad = v.dgrad;
  c.T = 53;
  Runner r(c);
  Outputs want = r.run_reference();
  Outputs grouped = r.run_gpu(WeightLayout::kSingleGrouped);
  compare(grouped, want, v.bias);
  if (v.fused || v.dgrad) {
    // The fused kernels against the unfused path they replace (the GPU reference), same data.
    compare(grouped, run_unfused(c), v.bias);
  }
  Outputs per_expert = r.run_gpu(WeightLayout::kPerExpert);
  expect_bitwise(grouped, per_expert);
  // Hooks fire once each at the end of backward, fc2 before fc1.
  std::vector<int> expected;
  for (Param p : {Param::kFc2Weight, Param::kFc2Bias, Param::kFc1Weight, Param::kFc1Bias})
    if (v.bias || (p != Param::kFc2Bias && p != Param::kFc1Bias)) expected.push_back(static_cast<int>(p));
  EXPECT_EQ(grouped.hook_order, expected);
}

INSTANTIATE_TEST_SUITE_P(
    Activations, LayerVariants,
    ::testing::Values(Variant{Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 0, 0},
                      Variant{Activation::kSwiGLU, true, ProbsPlacement::kInActivation, 32, 16},
                      Variant{Activation::kSwiGLU, true, ProbsPlacement::kAtCombine, 0, 0},
                      Variant{Activation::kGeGLU, true, ProbsPlacement::kInActivation, 16, 0},
                      Variant{Activation::kGeGLU, false, ProbsPlacement::kAtCombine, 0, 32},
                      Variant{Activation::kClampedSwiGLU, true, ProbsPlacement::kInActivation, 32, 0},
                      Variant{Activation::kClampedSwiGLU, false, ProbsPlacement::kAtCombine, 8, 16},
                      Variant{Activation::kClampedSwiGLU, true, ProbsPlacement::kInActivation, 1, 0},
                      Variant{Activation::kSwiGLU, false, ProbsPlacement::kAtCombine, 1, 16},
                      Variant{Activation::kSquaredReLU, true, ProbsPlacement::kInActivation, 0, 0},
                      Variant{Activation::kSquaredReLU, false, ProbsPlacement::kAtCombine, 0, 128}),
    [](const ::testing::TestParamInfo<Variant>& info) { return variant_name(info.param); });

// The fused fc1: every activation, GLU interleave 0 / 1 / 32 (and 8, 16), bias on and off, probs in
// the activation or at the combine, padding A in {0, 16, 128}, with and without recompute.
INSTANTIATE_TEST_SUITE_P(
    FusedFc1, LayerVariants,
    ::testing::Values(Variant{Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 0, 0, true},
                      Variant{Activation::kSwiGLU, true, ProbsPlacement::kInActivation, 32, 128, true},
                      Variant{Activation::kSwiGLU, true, ProbsPlacement::kAtCombine, 0, 0, true},
                      Variant{Activation::kSwiGLU, false, ProbsPlacement::kAtCombine, 1, 128, true},
                      Variant{Activation::kGeGLU, true, ProbsPlacement::kInActivation, 16, 0, true},
                      Variant{Activation::kGeGLU, false, ProbsPlacement::kAtCombine, 0, 128, true},
                      Variant{Activation::kClampedSwiGLU, true, ProbsPlacement::kInActivation, 1, 0, true},
                      Variant{Activation::kClampedSwiGLU, false, ProbsPlacement::kAtCombine, 8, 16, true},
                      Variant{Activation::kClampedSwiGLU, true, ProbsPlacement::kInActivation, 32, 128, true},
                      Variant{Activation::kSquaredReLU, true, ProbsPlacement::kInActivation, 0, 0, true},
                      Variant{Activation::kSquaredReLU, false, ProbsPlacement::kAtCombine, 0, 128, true},
                      Variant{Activation::kSwiGLU, true, ProbsPlacement::kInActivation, 0, 16, true, true},
                      Variant{Activation::kSquaredReLU, true, ProbsPlacement::kAtCombine, 0, 0, true, true},
                      // No x_perm: the fc1 weight gradient gathers the rows of x.
                      Variant{Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 0, 0, true, false, true},
                      Variant{Activation::kSwiGLU, true, ProbsPlacement::kAtCombine, 1, 128, true, false, true},
                      Variant{Activation::kGeGLU, true, ProbsPlacement::kInActivation, 16, 0, true, false, true},
                      Variant{Activation::kClampedSwiGLU, true, ProbsPlacement::kInActivation, 32, 128, true, false,
                              true},
                      Variant{Activation::kSquaredReLU, false, ProbsPlacement::kAtCombine, 0, 16, true, false, true}),
    [](const ::testing::TestParamInfo<Variant>& info) { return variant_name(info.param); });

// The fused fc2 dgrad + activation backward: every activation, GLU interleave 0 / 1 / 8 / 32, bias
// on and off (bias: dY_perm is written on the way for its gradients), probs in the activation (dy
// gathered inside the kernel) or at the combine (dY_perm from the combine's backward), A in
// {0, 16, 128}, alone, with the fused fc1, without x_perm (no dY_perm either: the fc2 weight
// gradient gathers dy), with recompute. With A = 128 every tile has all its 64 rows; with A = 0 or 16
// most tiles of these small groups are partial.
INSTANTIATE_TEST_SUITE_P(
    FusedDgrad, LayerVariants,
    ::testing::Values(
        Variant{Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 0, 0, false, false, false, true},
        Variant{Activation::kSwiGLU, true, ProbsPlacement::kAtCombine, 1, 16, false, false, false, true},
        Variant{Activation::kGeGLU, true, ProbsPlacement::kInActivation, 32, 128, true, false, false, true},
        Variant{Activation::kClampedSwiGLU, true, ProbsPlacement::kInActivation, 1, 0, true, false, false, true},
        Variant{Activation::kClampedSwiGLU, false, ProbsPlacement::kAtCombine, 8, 128, true, false, false, true},
        Variant{Activation::kSquaredReLU, true, ProbsPlacement::kInActivation, 0, 16, true, false, false, true},
        Variant{Activation::kSwiGLU, true, ProbsPlacement::kInActivation, 0, 16, true, true, false, true},
        Variant{Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 0, 0, true, false, true, true},
        Variant{Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 1, 128, true, false, true, true},
        Variant{Activation::kGeGLU, false, ProbsPlacement::kInActivation, 32, 16, true, false, true, true},
        Variant{Activation::kClampedSwiGLU, true, ProbsPlacement::kInActivation, 8, 0, true, false, true, true},
        Variant{Activation::kSquaredReLU, false, ProbsPlacement::kInActivation, 0, 128, true, false, true, true},
        Variant{Activation::kSquaredReLU, false, ProbsPlacement::kAtCombine, 0, 0, true, false, true, true},
        Variant{Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 0, 128, true, false, true, true},
        Variant{Activation::kGeGLU, true, ProbsPlacement::kInActivation, 0, 128, false, false, false, true},
        Variant{Activation::kClampedSwiGLU, false, ProbsPlacement::kAtCombine, 0, 128, true, false, true, true},
        Variant{Activation::kSwiGLU, true, ProbsPlacement::kInActivation, 0, 128, true, true, false, true}),
    [](const ::testing::TestParamInfo<Variant>& info) { return variant_name(info.param); });


// Weights and gradients stored transposed per expert (Hugging Face's GPT-OSS orientation): the
// same results as the standard orientation, in both weight layouts, with GPT-OSS's activation
// (clamped swiglu, gate and linear alternating) and biases, fp32 main_grad accumulation and delayed
// weight gradients.
TEST(GroupedMlp, TransposedWeightsMatchTheReferenceAndTheStandardOrientation) {
  MOE_REQUIRE_GPU();
  for (int variant = 0; variant < 3; ++variant) {
    SCOPED_TRACE("variant " + std::to_string(variant));
    Case c;
    c.cfg = small_config();
    c.cfg.activation.kind = Activation::kClampedSwiGLU;
    c.cfg.activation.glu_interleave = 1;
    c.cfg.bias = true;
    c.cfg.wgrad = variant == 1 ? WgradMode::kAccumulate : WgradMode::kWrite;
    c.cfg.delay_wgrad = variant == 2;
    c.T = 57;
    c.seed = 31 + variant;
    Runner r(c);
    const Outputs want = r.run_reference();
    const Outputs standard = r.run_gpu(WeightLayout::kSingleGrouped);
    r.c.cfg.transposed_weights = true;
    for (WeightLayout layout : {WeightLayout::kSingleGrouped, WeightLayout::kPerExpert}) {
      const Outputs got = r.run_gpu(layout);
      compare(got, want, true);
      expect_bitwise(got, standard);
    }
  }
}

TEST(GroupedMlp, AccumulateIntoMainGradAndFp32Grads) {
  MOE_REQUIRE_GPU();
  for (WgradMode mode : {WgradMode::kAccumulate, WgradMode::kWrite}) {
    Case c;
    c.cfg = small_config();
    c.cfg.bias = true;
    c.cfg.wgrad = mode;
    c.cfg.wgrad_dtype = DType::kFP32;
    c.T = 40;
    c.seed = 7;
    Runner r(c);
    compare(r.run_gpu(WeightLayout::kSingleGrouped), r.run_reference(), true);
  }
}

TEST(GroupedMlp, DelayedWgradEqualsImmediateAndHooksFireInOrder) {
  MOE_REQUIRE_GPU();
  // 3, 4: as 1, 2 with the fused fc2 dgrad (dY_perm written on the way: backward_dw reads it). The
  // immediate backward then takes act recomputed by the fused kernel (the state keeps none), the
  // delayed one the forward's act: fc2's weight gradient is bitwise equal only if they are, so each
  // activation is run.
  for (int mode : {0, 1, 2, 3, 4}) {
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kClampedSwiGLU,
                         Activation::kSquaredReLU}) {
  if (mode < 3 && act != Activation::kSwiGLU) continue;
  SCOPED_TRACE(::testing::Message() << "mode " << mode << " " << activation_name(act));
  Case c;
  c.cfg = small_config();
  c.cfg.activation.kind = act;
  c.cfg.bias = true;
  c.cfg.fuse_fc1 = mode > 0;
  c.cfg.save_x_perm = mode != 2 && mode != 4;
  c.cfg.fuse_fc2_dgrad = mode >= 3;
  c.T = 45;
  Runner immediate(c);
  Outputs a = immediate.run_gpu(WeightLayout::kSingleGrouped);
  c.cfg.delay_wgrad = true;
  Runner delayed(c);
  Outputs b = delayed.run_gpu(WeightLayout::kSingleGrouped);
  expect_bitwise(a, b);
  EXPECT_EQ(b.hook_order, (std::vector<int>{static_cast<int>(Param::kFc2Weight), static_cast<int>(Param::kFc2Bias),
                                            static_cast<int>(Param::kFc1Weight), static_cast<int>(Param::kFc1Bias)}));
  compare(b, delayed.run_reference(), true);
  }
  }
}

// max_sms bounds the persistent kernels' grids (SMs left to work beside the layer): the same tiles
// with the same accumulation order, so bitwise the same results; 3 SMs (odd: a cluster of 2 CTAs
// takes 2) makes every CTA loop over many tiles. Mode 2 has more k blocks (H = 640: 10) than the
// fused kernels have pipeline stages, so each CTA's stage ring wraps within a tile and across its
// many tiles, and is checked against the reference too.
TEST(GroupedMlp, MaxSmsGivesBitwiseTheSameResults) {
  MOE_REQUIRE_GPU();
  for (int mode : {0, 1, 2}) {  // unfused; fused fc1 + fused fc2 dgrad without x_perm; the same, H = 640
    SCOPED_TRACE(::testing::Message() << "mode " << mode);
    Case c;
    c.cfg = small_config();
    c.cfg.bias = mode == 0;
    c.cfg.fuse_fc1 = mode >= 1;
    c.cfg.save_x_perm = mode == 0;
    c.cfg.fuse_fc2_dgrad = mode >= 1;
    if (mode == 2) {
      c.cfg.hidden = 640;
      c.cfg.max_tokens = 300;
    }
    c.T = mode == 2 ? 300 : 61;
    c.skew = 1.0;
    Runner r(c);
    const Outputs all = r.run_gpu(WeightLayout::kSingleGrouped);
    c.cfg.max_sms = 3;
    const Outputs few = Runner(c).run_gpu(WeightLayout::kSingleGrouped);
    expect_bitwise(all, few);
    if (mode == 2) compare(few, r.run_reference(), false);
  }
}

// With the fused fc2 dgrad (not delayed) a micro-batch in flight keeps no act: the state is R x F x 2
// bytes smaller than the unfused path's.
TEST(GroupedMlp, FusedDgradStateKeepsNoAct) {
  MOE_REQUIRE_GPU();
  for (bool x_perm : {true, false}) {
    GroupedMlpConfig cfg = small_config();
    cfg.fuse_fc1 = true;
    cfg.save_x_perm = x_perm;
    const size_t act_bytes = static_cast<size_t>(cfg.row_bound() * cfg.ffn * 2);
    GroupedMlp unfused(cfg);
    cfg.fuse_fc2_dgrad = true;
    GroupedMlp fused(cfg);
    EXPECT_EQ(unfused.state_bytes() - fused.state_bytes(), act_bytes) << "x_perm " << x_perm;
  }
}

// A shape with several k blocks (H = 320: a partial one), feature blocks (F = 200: a partial one;
// F = 520: three 256-feature blocks of the fused fc2 dgrad, whose dprobs partials are summed, the
// last one partial; F = 384: two) and 128-row blocks per expert (odd numbers of them: split tiles),
// balanced and skewed routing: fused against the reference and against the unfused path.
TEST(GroupedMlp, FusedFc1LargerShapes) {
  MOE_REQUIRE_GPU();
  for (double skew : {0.0, 3.0}) {
    for (Activation act : {Activation::kSwiGLU, Activation::kSquaredReLU}) {
    // x_perm, no x_perm, both + fused fc2 dgrad (bias off in 3), and 2 at F = 384: two feature
    // blocks of the fused fc2 dgrad, so both CTAs of a split odd row block have features.
    for (int mode : {0, 1, 2, 3, 4}) {
      const bool gathered = mode == 1 || mode == 3;
      SCOPED_TRACE(::testing::Message() << "skew " << skew << " " << activation_name(act) << " mode " << mode);
      Case c;
      c.cfg.hidden = 320;
      c.cfg.ffn = mode == 4 ? 384 : mode >= 2 ? 520 : 200;
      c.cfg.experts = 5;
      c.cfg.topk = 2;
      c.cfg.max_tokens = 700;
      c.cfg.bias = mode != 3;
      c.cfg.activation.kind = act;
      c.cfg.fuse_fc1 = true;
      c.cfg.save_x_perm = !gathered;
      c.cfg.fuse_fc2_dgrad = mode >= 2;
      c.T = 650;
      c.skew = skew;
      c.seed = 5;
      Runner r(c);
      Outputs fused = r.run_gpu(WeightLayout::kSingleGrouped);
      compare(fused, r.run_reference(), c.cfg.bias);
      compare(fused, run_unfused(c), c.cfg.bias);
    }
    }
  }
}

// H = 4096: the fused fc2 dgrad's automatic choice takes its cooperative schedule there
// (fused/fc2_dgrad_activation.h), which the other layer tests (H < 4096) never run. Fused (no x_perm,
// the gathered dY rows) against the reference and the unfused path, with one 256-feature block
// (F = 256) and three (F = 640, dprobs summed from partials), skewed routing (uneven groups, odd
// numbers of 128-row blocks).
TEST(GroupedMlp, FusedDgradCooperativeScheduleAtLargeHidden) {
  MOE_REQUIRE_GPU();
  for (int ffn : {256, 640}) {
    SCOPED_TRACE(::testing::Message() << "F " << ffn);
    Case c;
    c.cfg.hidden = 4096;
    c.cfg.ffn = ffn;
    c.cfg.experts = 3;
    c.cfg.topk = 2;
    c.cfg.max_tokens = 260;
    c.cfg.fuse_fc1 = true;
    c.cfg.save_x_perm = false;
    c.cfg.fuse_fc2_dgrad = true;
    c.T = 260;
    c.skew = 1.0;
    c.seed = 17;
    Runner r(c);
    const Outputs fused = r.run_gpu(WeightLayout::kSingleGrouped);
    compare(fused, r.run_reference(), false);
    compare(fused, run_unfused(c), false);
  }
}

// rebind_weights between a forward and its backward: the backward (unfused and fused dgrad, both
// layouts, with biases) reads the weights at their new addresses -- the old ones hold NaN -- and
// gives the results of a run without it, bitwise. Rebinding before any set_weights is refused.
TEST(GroupedMlp, RebindWeightsBetweenForwardAndBackward) {
  MOE_REQUIRE_GPU();
  for (bool fused : {false, true}) {
    SCOPED_TRACE(::testing::Message() << (fused ? "fused" : "unfused"));
    Case c;
    c.cfg = small_config();
    c.cfg.bias = !fused;
    c.cfg.fuse_fc1 = fused;
    c.cfg.save_x_perm = !fused;
    c.cfg.fuse_fc2_dgrad = fused;
    c.T = 61;
    c.seed = 13;
    for (WeightLayout layout : {WeightLayout::kSingleGrouped, WeightLayout::kPerExpert}) {
      const Outputs plain = Runner(c).run_gpu(layout);
      Case moved = c;
      moved.rebind_before_backward = true;
      expect_bitwise(Runner(moved).run_gpu(layout), plain);
    }
  }
  GroupedMlp layer(small_config());
  testing::expect_error_naming([&] { layer.rebind_weights({}); }, "no weights bound");
}

// 500 experts (a tile prefix of 501 entries in the fused kernels' shared memory), A = 128 (every
// tile whole), skewed routing that leaves many experts empty: the fused fc1 and fc2 dgrad against the
// reference and the unfused path, both weight layouts bitwise equal.
TEST(GroupedMlp, FusedDgradWithManyExperts) {
  MOE_REQUIRE_GPU();
  Case c;
  c.cfg = small_config();
  c.cfg.experts = 500;
  c.cfg.max_tokens = 600;
  c.cfg.dispatch.align = 128;
  c.cfg.fuse_fc1 = true;
  c.cfg.save_x_perm = false;
  c.cfg.fuse_fc2_dgrad = true;
  c.T = 600;
  c.skew = 1.0;
  c.seed = 11;
  Runner r(c);
  const Outputs fused = r.run_gpu(WeightLayout::kSingleGrouped);
  compare(fused, r.run_reference(), false);
  compare(fused, run_unfused(c), false);
  expect_bitwise(fused, r.run_gpu(WeightLayout::kPerExpert));
}

// config.dprobs_partials_in_dx_perm: the fused fc2 dgrad's dprobs partial sums (F = 520: three
// 256-feature blocks, the last partial) kept in dx_perm's memory instead of the op's workspace --
// R x 3 floats less workspace, bitwise the same Y, dx_perm (rows of the groups), d_probs_perm and
// weight gradients, through backward and backward_gathered; dx_perm overlapping the gradient the
// kernel reads (or dY_out) is refused by name.
TEST(GroupedExperts, DprobsPartialsInDxPermAreBitwiseTheSame) {
  MOE_REQUIRE_GPU();
  ExpertsConfig own_cfg;
  own_cfg.hidden = 320;
  own_cfg.ffn = 520;
  own_cfg.experts = 3;
  own_cfg.max_rows = 384;
  own_cfg.fuse_fc2_dgrad = true;
  ExpertsConfig lent_cfg = own_cfg;
  lent_cfg.dprobs_partials_in_dx_perm = true;
  const int E = own_cfg.experts;
  const int64_t H = own_cfg.hidden, F = own_cfg.ffn, F1 = own_cfg.fc1_out(), R = own_cfg.max_rows;
  const std::vector<int32_t> offsets = {0, 100, 100, 350};  // an empty expert; rows 350.. in no group
  const int64_t used = offsets.back();
  std::mt19937_64 rng(7);
  const std::vector<double> w1 = random_bf16_values(size_t(E) * F1 * H, 1.0 / std::sqrt(double(H)), rng);
  const std::vector<double> w2 = random_bf16_values(size_t(E) * H * F, 1.0 / std::sqrt(double(F)), rng);
  DeviceBuffer<uint16_t> x_perm(to_bf16(random_bf16_values(R * H, 1.0, rng)));
  DeviceBuffer<uint16_t> dY(to_bf16(random_bf16_values(R * H, 1.0, rng)));
  std::vector<float> probs(R);
  for (float& p : probs) p = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
  DeviceBuffer<float> pp(probs);
  DeviceBuffer<int32_t> offs(offsets);
  // The gathered form: dy [T, H] with T = R, row r of the groups reads token r (one slot per token).
  std::vector<int32_t> slots(R);
  for (int64_t r = 0; r < R; ++r) slots[r] = r < used ? static_cast<int32_t>(r) : -1;
  DeviceBuffer<int32_t> row_slots(slots);
  const auto rows = [&](const DeviceBuffer<uint16_t>& b) { return TensorView(b.get(), DType::kBF16, {R, H}); };
  const TensorView g(offs.get(), DType::kInt32, {E + 1}), p(pp.get(), DType::kFP32, {R});
  const TensorView rs(row_slots.get(), DType::kInt32, {R});

  struct Result {
    std::vector<uint16_t> y, dx;
    std::vector<float> dpp;
    std::vector<double> dw1, dw2;
  };
  const auto run = [&](const ExpertsConfig& cfg, bool gathered) {
    GroupedExperts ex(cfg);
    DeviceParam W1 = make_param(w1, E, {F1, H}, DType::kBF16, cfg.layout);
    DeviceParam W2 = make_param(w2, E, {H, F}, DType::kBF16, cfg.layout);
    DeviceParam G1 = make_param(std::vector<double>(w1.size()), E, {F1, H}, DType::kBF16, cfg.layout);
    DeviceParam G2 = make_param(std::vector<double>(w2.size()), E, {H, F}, DType::kBF16, cfg.layout);
    ex.set_weights({W1.views, {}, W2.views, {}});
    ex.set_grads({G1.views, {}, G2.views, {}});
    const SavedState st = ex.new_state();
    DeviceBuffer<uint16_t> Y(R * H), dx(R * H);
    DeviceBuffer<float> dpp(R);
    ex.forward(rows(x_perm), g, p, rows(Y), st, nullptr);
    const TensorView dppv(dpp.get(), DType::kFP32, {R});
    if (cfg.dprobs_partials_in_dx_perm) {
      // dx_perm over dY_out (gathered) or over the dY the kernel reads: refused before anything runs.
      if (gathered)
        testing::expect_error_naming(
            [&] { ex.backward_gathered(rows(dY), rs, 1, rows(dx), rows(dx), dppv, st, nullptr); }, "dx_perm");
      else
        testing::expect_error_naming([&] { ex.backward(rows(dY), rows(dY), dppv, st, nullptr); }, "dx_perm");
    }
    if (gathered)
      ex.backward_gathered(rows(dY), rs, 1, TensorView(), rows(dx), dppv, st, nullptr);
    else
      ex.backward(rows(dY), rows(dx), dppv, st, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    Result r;
    r.y = Y.download();
    r.dx = dx.download();
    r.dx.resize(used * H);  // rows in no group: unspecified with the partials in dx_perm
    r.dpp = dpp.download();
    r.dpp.resize(used);
    r.dw1 = download_param(G1, DType::kBF16);
    r.dw2 = download_param(G2, DType::kBF16);
    return std::make_pair(r, ex.workspace_bytes());
  };
  for (bool gathered : {false, true}) {
    SCOPED_TRACE(gathered ? "backward_gathered" : "backward");
    const auto [own, own_bytes] = run(own_cfg, gathered);
    const auto [lent, lent_bytes] = run(lent_cfg, gathered);
    EXPECT_EQ(own_bytes - lent_bytes, static_cast<size_t>(R) * 3 * sizeof(float));
    EXPECT_EQ(own.y, lent.y);
    EXPECT_EQ(own.dx, lent.dx);
    EXPECT_EQ(0, std::memcmp(own.dpp.data(), lent.dpp.data(), own.dpp.size() * sizeof(float)));
    EXPECT_EQ(own.dw1, lent.dw1);
    EXPECT_EQ(own.dw2, lent.dw2);
    double dpp_abs = 0;
    for (float v : own.dpp) dpp_abs += std::fabs(v);
    EXPECT_GT(dpp_abs, 0.0);  // the comparison is not between zeros
  }
}

TEST(GroupedMlp, EdgeCases) {
  MOE_REQUIRE_GPU();
  struct Edge {
    int E, k;
    int64_t T;
    double skew;
    RoutingForm form;
  };
  for (Edge e : {Edge{8, 1, 3, 0.0, RoutingForm::kTopK},      // most experts get no token
                 Edge{6, 2, 0, 0.0, RoutingForm::kTopK},      // no token at all
                 Edge{4, 1, 33, 50.0, RoutingForm::kTopK},    // one expert takes every token
                 Edge{5, 5, 17, 0.0, RoutingForm::kTopK},     // k = E
                 Edge{1, 1, 9, 0.0, RoutingForm::kTopK},      // a single expert
                 Edge{6, 6, 21, 0.0, RoutingForm::kMap}}) {   // map form, 0..E experts per token
    SCOPED_TRACE(::testing::Message() << "E=" << e.E << " k=" << e.k << " T=" << e.T);
    Case c;
    c.cfg = small_config();
    c.cfg.experts = e.E;
    c.cfg.topk = e.k;
    c.cfg.routing_form = e.form;
    if (e.form == RoutingForm::kMap) c.cfg.dispatch.row_bound = c.cfg.max_tokens * e.E;
    c.T = e.T;
    c.skew = e.skew;
    Runner r(c);
    const Outputs want = r.run_reference();
    compare(r.run_gpu(WeightLayout::kSingleGrouped), want, false);
    c.cfg.fuse_fc1 = true;
    compare(Runner(c).run_gpu(WeightLayout::kSingleGrouped), want, false);
    c.cfg.save_x_perm = false;
    compare(Runner(c).run_gpu(WeightLayout::kSingleGrouped), want, false);
    c.cfg.fuse_fc2_dgrad = true;
    compare(Runner(c).run_gpu(WeightLayout::kSingleGrouped), want, false);
    c.cfg.save_x_perm = true;
    compare(Runner(c).run_gpu(WeightLayout::kSingleGrouped), want, false);
  }
}

class GraphReplay : public ::testing::TestWithParam<int> {};

TEST_P(GraphReplay, WithNewDataEqualsEager) {
  MOE_REQUIRE_GPU();
  GroupedMlpConfig k = small_config();
  const bool fp8 = GetParam() == 5;
  k.dispatch.align = fp8 ? 128 : 16;
  k.fuse_fc1 = GetParam() > 0 && !fp8;
  k.save_x_perm = GetParam() != 2 && GetParam() != 4;
  k.fuse_fc2_dgrad = GetParam() >= 3 && !fp8;
  // Without bias and x_perm no dY_perm exists: fc2's wgrad gathers dy; with fp8, dY's quantize does.
  k.bias = GetParam() != 4 && GetParam() != 6 && !fp8;
  if (GetParam() == 6) {  // token chunks: 2 without x_perm, fc2 and the fc1 dgrad in three pieces
    k.save_x_perm = false;
    k.token_chunks = 3;
  }
  // Frozen experts: 4's path with the weight gradients skipped (the gradients stay zero).
  const WeightGrads wg = GetParam() == 7 ? WeightGrads::kSkip : WeightGrads::kCompute;
  if (GetParam() == 7) {
    k.fuse_fc1 = k.fuse_fc2_dgrad = true;
    k.save_x_perm = k.bias = false;
  }
  k.fp8 = fp8 ? Fp8Recipe::kBlock : Fp8Recipe::kNone;
  const DType gt = fp8 ? DType::kFP32 : DType::kBF16;  // the FP8 weight gradients write fp32
  k.wgrad_dtype = gt;
  const int E = k.experts, K = k.topk;
  const int64_t T = 50, H = k.hidden, F = k.ffn, F1 = k.fc1_out();
  std::mt19937_64 rng(3);
  auto W1 = make_param(random_bf16_values(E * F1 * H, 0.1, rng), E, {F1, H}, DType::kBF16, k.layout);
  auto W2 = make_param(random_bf16_values(E * H * F, 0.1, rng), E, {H, F}, DType::kBF16, k.layout);
  auto B1 = make_param(random_bf16_values(E * F1, 0.5, rng), E, {F1}, DType::kBF16, k.layout);
  auto B2 = make_param(random_bf16_values(E * H, 0.5, rng), E, {H}, DType::kBF16, k.layout);
  auto G1 = make_param(std::vector<double>(E * F1 * H), E, {F1, H}, gt, k.layout);
  auto G2 = make_param(std::vector<double>(E * H * F), E, {H, F}, gt, k.layout);
  auto GB1 = make_param(std::vector<double>(E * F1), E, {F1}, gt, k.layout);
  auto GB2 = make_param(std::vector<double>(E * H), E, {H}, gt, k.layout);
  DeviceBuffer<uint16_t> x(T * H), dy(T * H), y(T * H), dx(T * H);
  DeviceBuffer<int32_t> idx(T * K);
  DeviceBuffer<float> probs(T * K), dprobs(T * K);
  RoutingView rv;
  rv.indices = TensorView(idx.get(), DType::kInt32, {T, K});
  rv.probs = TensorView(probs.get(), DType::kFP32, {T, K});
  TensorView xv(x.get(), DType::kBF16, {T, H}), yv(y.get(), DType::kBF16, {T, H});
  TensorView dyv(dy.get(), DType::kBF16, {T, H}), dxv(dx.get(), DType::kBF16, {T, H});
  TensorView dpv(dprobs.get(), DType::kFP32, {T, K});

  GroupedMlp layer(k);
  const std::vector<TensorView> none;
  layer.set_weights({W1.views, k.bias ? B1.views : none, W2.views, k.bias ? B2.views : none});
  layer.set_grads({G1.views, k.bias ? GB1.views : none, G2.views, k.bias ? GB2.views : none});
  cudaStream_t s;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto load = [&](uint64_t seed, double skew) {
    std::mt19937_64 g(seed);
    auto rt = ref::make_topk_routing(T, E, K, seed, skew);
    x.upload(to_bf16(random_bf16_values(T * H, 1.0, g)));
    dy.upload(to_bf16(random_bf16_values(T * H, 1.0, g)));
    idx.upload(rt.indices);
    probs.upload(std::vector<float>(rt.probs.begin(), rt.probs.end()));
  };
  const SavedState st = layer.new_state();
  auto step = [&] {
    layer.forward(xv, rv, yv, st, s);
    layer.backward(dyv, dxv, dpv, st, s, nullptr, wg);
  };
  auto results = [&] {
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    std::vector<std::vector<double>> r;
    r.push_back(from_bf16(y.download()));
    r.push_back(from_bf16(dx.download()));
    auto dp = dprobs.download();
    r.emplace_back(dp.begin(), dp.end());
    for (auto* p : {&G1, &G2, &GB1, &GB2}) r.push_back(download_param(*p, gt));
    return r;
  };

  load(11, 0.0);
  MOE_CUDA_CHECK(cudaStreamSynchronize(s));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  step();
  MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  // Replays with different routing (balanced, skewed) and data, each compared with an eager run.
  for (auto [seed, skew] : {std::pair<uint64_t, double>{21, 0.0}, {22, 2.0}, {23, 0.5}}) {
    load(seed, skew);
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
    auto replayed = results();
    step();
    auto eager = results();
    ASSERT_EQ(replayed.size(), eager.size());
    for (size_t i = 0; i < eager.size(); ++i) EXPECT_EQ(replayed[i], eager[i]) << "output " << i << " seed " << seed;
    if (wg == WeightGrads::kSkip)  // the gradient tensors (outputs 3..6) never written: still zero
      for (size_t i = 3; i < replayed.size(); ++i)
        EXPECT_EQ(replayed[i], std::vector<double>(replayed[i].size(), 0.0)) << "output " << i;
  }
  layer.check_errors(s);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(s);
}

// 0: unfused, 1: fused fc1, 2: fused fc1 without x_perm, 3 / 4: 1 / 2 with the fused fc2 dgrad,
// 5: FP8 (x and dy quantized from their gathered rows), 6: 4 in three token chunks, 7: 4 with frozen experts.
std::string graph_replay_name(const ::testing::TestParamInfo<int>& info) {
  static const char* const kNames[] = {"Unfused", "Fused",       "FusedNoXPerm", "FusedDgrad", "FusedDgradNoXPerm",
                                       "Fp8",     "TokenChunks", "FrozenExperts"};
  return kNames[info.param];
}
INSTANTIATE_TEST_SUITE_P(GroupedMlp, GraphReplay, ::testing::Values(0, 1, 2, 3, 4, 5, 6, 7), graph_replay_name);

// Token chunks (config.token_chunks): fc2 and the combine, the fc1 dgrad and the sum of each
// token's rows, one piece of consecutive tokens at a time -- bitwise the results of the whole batch
// at once, for piece counts that divide T and that do not, more pieces than tokens, no token,
// skewed routing (experts with no row in some pieces), padding A = 16 and 128, two feature blocks
// of the fused fc2 dgrad (its dprobs partial sums in the pieces' scratch), delayed weight gradients
// and recompute. And the layer's workspace shrinks by about a piece's share of R x H x 2 bytes.
TEST(GroupedMlp, TokenChunksAreBitwiseTheWholeBatch) {
  MOE_REQUIRE_GPU();
  struct Mode {
    int64_t T, F;
    int align;
    double skew;
    bool delay, recompute;
  };
  for (const Mode m : {Mode{61, 64, 0, 0.0, false, false}, Mode{64, 64, 128, 2.0, false, false},
                       Mode{50, 384, 16, 1.0, false, false}, Mode{47, 64, 0, 1.0, true, false},
                       Mode{37, 384, 0, 0.0, false, true}, Mode{3, 64, 0, 0.0, false, false},
                       Mode{0, 64, 0, 0.0, false, false}}) {
    SCOPED_TRACE(::testing::Message() << "T=" << m.T << " F=" << m.F << " A=" << m.align << " skew=" << m.skew
                                      << " delay=" << m.delay << " recompute=" << m.recompute);
    Case c;
    c.cfg = small_config();
    c.cfg.ffn = m.F;
    c.cfg.dispatch.align = m.align;
    c.cfg.fuse_fc1 = true;
    c.cfg.save_x_perm = false;
    c.cfg.fuse_fc2_dgrad = true;
    c.cfg.delay_wgrad = m.delay;
    c.cfg.recompute = m.recompute;
    c.T = m.T;
    c.skew = m.skew;
    const Outputs whole = Runner(c).run_gpu(WeightLayout::kSingleGrouped);
    if (m.T == 61) compare(whole, Runner(c).run_reference(), false);
    const size_t whole_ws = GroupedMlp(c.cfg).workspace_bytes();
    for (int n : {2, 3, 7}) {
      SCOPED_TRACE(::testing::Message() << "token_chunks=" << n);
      c.cfg.token_chunks = n;
      const Outputs chunked = Runner(c).run_gpu(WeightLayout::kSingleGrouped);
      expect_bitwise(chunked, whole);
      EXPECT_EQ(chunked.hook_order, whole.hook_order);  // every hook once, after the last piece
      if (m.F == 64 && m.align == 0)  // R x H x 2 bytes shrink to a piece's rows (plus its windows)
        EXPECT_LT(GroupedMlp(c.cfg).workspace_bytes(), whole_ws);
    }
  }
}

// The FP8 layer against the reference computing the same recipe (quantized operands, the layer's
// bf16 roundings), on data whose FP8 quantization and fc1 / fc2-dgrad products are exact: x, dy and
// both weights are multiples of unit / 2 in [-3.5, 3.5] unit, so every FP8 block holds a +-3.5 unit
// (with probability 1 - (13/15)^128), its scale 448 / amax is a power of two and the products are
// integers below 2^14 times a power of two. h and dact then agree bitwise, and what remains comes
// from the products on act and dh, whose quantization is inexact: the FP8 tensor cores'
// partial-sum precision and fp32 accumulation order, seen through bf16 roundings (measured ~3e-3
// against the same recipe in PyTorch). Bound 5e-3 relative L2 (dprobs 1e-4: fp32 sums of bitwise
// equal factors); a scale on the wrong block or a wrong copy gives 1e-2 and more.
// The quantized-operand tests' layer: H = 256, F = 384, E = 4, k = 2, 384 tokens, biases.
Case quantized_case() {
  Case cs;
  cs.cfg.hidden = 256;
  cs.cfg.ffn = 384;
  cs.cfg.experts = 4;
  cs.cfg.topk = 2;
  cs.cfg.max_tokens = 384;
  cs.cfg.bias = true;
  cs.T = 384;
  return cs;
}

// The quantized-operand tests' data: x, dy and both weights on coarse grids (multiples of unit / 2
// in [-3.5, 3.5] unit), whose products and their sums stay exact in fp32 and whose block
// quantization is exact or nearly so.
void put_on_grid(Runner& r, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> level(-7, 7);
  auto grid = [&](std::vector<double>& v, double unit) {
    for (double& e : v) e = level(rng) * unit / 2;
  };
  grid(r.x, 1.0);
  grid(r.dy, 0.125);
  grid(r.w1, 1.0 / 64);
  grid(r.w2, 1.0 / 64);
}

double rel_l2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num / std::max(den, 1e-300));
}

// With bias the FP8 backward quantizes dY_perm; without it the rows of dy gathered through the
// plan's row map (the forward always quantizes the gathered rows of x).
TEST(GroupedMlp, Fp8MatchesTheReferenceWithQuantizedOperands) {
  MOE_REQUIRE_GPU();
  for (bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    Case cs = quantized_case();
    cs.cfg.bias = bias;
    cs.cfg.dispatch.align = 128;
    cs.cfg.fp8 = Fp8Recipe::kBlock;
    cs.cfg.wgrad = WgradMode::kWrite;
    cs.cfg.wgrad_dtype = DType::kFP32;
    cs.seed = 7;
    Runner r(cs);
    put_on_grid(r, 8);
    ref::OperandQuant q;
    q.tokens.format = q.weights.format = QuantFormat::kFP8Block;
    q.weights.blocking = QuantBlocking::k2D;
    const Outputs want = r.run_reference(&q);
    const Outputs grouped = r.run_gpu(WeightLayout::kSingleGrouped), per_expert = r.run_gpu(WeightLayout::kPerExpert);
    expect_bitwise(grouped, per_expert);
    // Delayed weight gradients (backward_dw from the FP8 copies of dY and dh the state keeps; without
    // bias the layer keeps no dY): bitwise the immediate run, with power-of-two scales too.
    for (Fp8Recipe recipe : {Fp8Recipe::kBlock, Fp8Recipe::kBlockPow2}) {
      SCOPED_TRACE(recipe == Fp8Recipe::kBlock ? "delayed" : "delayed, pow2 scales");
      Case dc = cs;
      dc.cfg.fp8 = recipe;
      auto run = [&](bool delay) {
        dc.cfg.delay_wgrad = delay;
        Runner rr(dc);
        put_on_grid(rr, 8);
        return rr.run_gpu(WeightLayout::kSingleGrouped);
      };
      const Outputs immediate = recipe == Fp8Recipe::kBlock ? grouped : run(false);
      expect_bitwise(run(true), immediate);
    }
    const struct {
      const char* name;
      const std::vector<double>*got, *want;
      double bound;
    } checks[] = {{"y", &grouped.y, &want.y, 5e-3},
                  {"dx", &grouped.dx, &want.dx, 5e-3},
                  {"dprobs", &grouped.dprobs, &want.dprobs, 1e-4},
                  {"fc1.weight grad", &grouped.dw1, &want.dw1, 5e-3},
                  {"fc2.weight grad", &grouped.dw2, &want.dw2, 5e-3},
                  {"fc1.bias grad", &grouped.db1, &want.db1, 5e-3},
                  {"fc2.bias grad", &grouped.db2, &want.db2, 5e-3}};
    for (const auto& ch : checks) {
      const double err = rel_l2(*ch.got, *ch.want);
      std::printf("FP8 layer%s vs the quantized-operand reference: %s relative L2 %.2e\n", bias ? "" : " (no bias)",
                  ch.name, err);
      EXPECT_LE(err, ch.bound) << ch.name;
    }
  }
}

// The emulated MXFP8 / NVFP4 layer against the reference with the same quantized operands
// (bf16_operands: the dequantized values rounded to bf16, as the bf16 GEMMs read them). Data on a
// coarse grid keep most GEMM sums exact, so what remains is fp32 accumulation order and rounding
// flips of bf16 intermediates that the next quantization may turn into one code step: measured
// <= 8e-5 (H100), bound 1e-3. A = 16 (MXFP8) and A = 0 give experts partial last blocks. The same outputs against the unquantized reference differ
// by the format's quantization error, many times more: the comparison tells the recipe apart.
TEST(GroupedMlp, EmulatedFormatsMatchTheReferenceWithQuantizedOperands) {
  MOE_REQUIRE_GPU();
  const struct {
    EmulatedQuant q;
    int align;
    bool main_grad;  // accumulate into fp32 main_grad, else write fp32 gradients
    double bound;
  } variants[] = {{EmulatedQuant::kMXFP8, 32, false, 1e-3}, {EmulatedQuant::kNVFP4, 16, false, 1e-3},
                  {EmulatedQuant::kMXFP8, 16, true, 1e-3}, {EmulatedQuant::kNVFP4, 0, true, 1e-3}};
  for (const auto& var : variants) {
    Case cs = quantized_case();
    cs.cfg.dispatch.align = var.align;
    cs.cfg.emulated = var.q;
    cs.cfg.wgrad = var.main_grad ? WgradMode::kAccumulate : WgradMode::kWrite;
    cs.cfg.wgrad_dtype = DType::kFP32;
    cs.seed = 11;
    cs.skew = 1.0;
    Runner r(cs);
    put_on_grid(r, 12);
    ref::OperandQuant q;
    q.tokens.format = q.weights.format = var.q == EmulatedQuant::kMXFP8 ? QuantFormat::kMXFP8 : QuantFormat::kNVFP4;
    q.weights.blocking = var.q == EmulatedQuant::kNVFP4 ? QuantBlocking::k2D : QuantBlocking::k1D;
    q.bf16_operands = true;
    const Outputs want = r.run_reference(&q), plain = r.run_reference();
    const Outputs grouped = r.run_gpu(WeightLayout::kSingleGrouped), per_expert = r.run_gpu(WeightLayout::kPerExpert);
    expect_bitwise(grouped, per_expert);
    const struct {
      const char* name;
      const std::vector<double>*got, *want, *plain;
    } checks[] = {{"y", &grouped.y, &want.y, &plain.y},
                  {"dx", &grouped.dx, &want.dx, &plain.dx},
                  {"dprobs", &grouped.dprobs, &want.dprobs, &plain.dprobs},
                  {"fc1.weight grad", &grouped.dw1, &want.dw1, &plain.dw1},
                  {"fc2.weight grad", &grouped.dw2, &want.dw2, &plain.dw2},
                  {"fc1.bias grad", &grouped.db1, &want.db1, &plain.db1},
                  {"fc2.bias grad", &grouped.db2, &want.db2, &plain.db2}};
    for (const auto& ch : checks) {
      const double err = rel_l2(*ch.got, *ch.want), off = rel_l2(*ch.got, *ch.plain);
      std::printf("emulated %s (A = %d) vs the quantized-operand reference: %s relative L2 %.2e (vs unquantized "
                  "%.2e)\n", emulated_quant_name(var.q), var.align, ch.name, err, off);
      EXPECT_LE(err, var.bound) << emulated_quant_name(var.q) << " A = " << var.align << " " << ch.name;
    }
    // The quantization is visible where the products are: y, dx and the weight gradients move by
    // the format's error against the unquantized reference (main_grad's initial values would hide
    // the weight gradients' part).
    EXPECT_GT(rel_l2(grouped.y, plain.y), 4 * rel_l2(grouped.y, want.y)) << emulated_quant_name(var.q);
    EXPECT_GT(rel_l2(grouped.dx, plain.dx), 4 * rel_l2(grouped.dx, want.dx)) << emulated_quant_name(var.q);
    if (!var.main_grad)
      EXPECT_GT(rel_l2(grouped.dw1, plain.dw1), 4 * rel_l2(grouped.dw1, want.dw1)) << emulated_quant_name(var.q);
  }
}

// Frozen experts (backward with WeightGrads::kSkip): y, dx and dprobs bitwise those of the full
// backward on every path that computes them differently -- unfused, fused fc1 with and without
// x_perm, the fused fc2 dgrad (which then does not recompute act), probs at the combine, recompute,
// token chunks, biases, FP8 with the quantize of dY_perm (bias) or of the gathered rows of dy --
// with the gradient tensors left exactly as they were (main_grad accumulation, so a weight gradient
// run by mistake would change them), no hook, and the same results when set_grads was never called.
TEST(GroupedMlp, FrozenExpertsComputeTheInputGradientsOnly) {
  MOE_REQUIRE_GPU();
  struct Path {
    const char* name;
    bool fuse_fc1, save_x_perm, fuse_fc2_dgrad, bias, probs_at_combine, recompute, fp8;
    int token_chunks;
  };
  const Path paths[] = {
      {"unfused", false, true, false, true, false, false, false, 1},
      {"fused fc1", true, true, false, true, false, false, false, 1},
      {"fused fc1 without x_perm, fused dgrad", true, false, true, false, false, false, false, 1},
      {"fused dgrad with bias", true, false, true, true, false, false, false, 1},
      {"probs at combine", false, true, false, false, true, false, false, 1},
      {"recompute", true, true, true, false, false, true, false, 1},
      {"token chunks", true, false, true, false, false, false, false, 3},
      {"fp8 with bias", false, true, false, true, false, false, true, 1},
      {"fp8 without bias", false, true, false, false, false, false, true, 1},
  };
  for (const Path& p : paths) {
    SCOPED_TRACE(p.name);
    Case c = p.fp8 ? quantized_case() : Case{};
    if (!p.fp8) {
      c.cfg = small_config();
      c.T = 61;
      c.skew = 1.0;
    }
    c.cfg.fuse_fc1 = p.fuse_fc1;
    c.cfg.save_x_perm = p.save_x_perm;
    c.cfg.fuse_fc2_dgrad = p.fuse_fc2_dgrad;
    c.cfg.bias = p.bias;
    c.cfg.probs = p.probs_at_combine ? ProbsPlacement::kAtCombine : ProbsPlacement::kInActivation;
    c.cfg.recompute = p.recompute;
    c.cfg.token_chunks = p.token_chunks;
    if (p.fp8) {
      c.cfg.fp8 = Fp8Recipe::kBlock;
      c.cfg.dispatch.align = 128;
    }
    c.cfg.wgrad = WgradMode::kAccumulate;  // random initial main_grad: any weight gradient would change it
    const Outputs full = Runner(c).run_gpu(WeightLayout::kSingleGrouped);
    Case frozen_case = c;
    frozen_case.weight_grads = WeightGrads::kSkip;
    Runner frozen_runner(frozen_case);
    const Outputs frozen = frozen_runner.run_gpu(WeightLayout::kSingleGrouped);
    EXPECT_EQ(frozen.y, full.y);
    EXPECT_EQ(frozen.dx, full.dx);
    EXPECT_EQ(frozen.dprobs, full.dprobs);
    EXPECT_TRUE(frozen.hook_order.empty());
    EXPECT_FALSE(full.hook_order.empty());
    // The initial main_grad, through the same fp32 round trip the downloads take.
    EXPECT_EQ(frozen.dw1, frozen_runner.g1);
    EXPECT_EQ(frozen.dw2, frozen_runner.g2);
    EXPECT_EQ(frozen.db1, frozen_runner.gb1);
    EXPECT_EQ(frozen.db2, frozen_runner.gb2);
    EXPECT_NE(full.dw1, frozen_runner.g1);
    frozen_case.bind_grads = false;
    const Outputs unbound = Runner(frozen_case).run_gpu(WeightLayout::kSingleGrouped);
    EXPECT_EQ(unbound.dx, full.dx);
    EXPECT_EQ(unbound.dprobs, full.dprobs);
  }
  // Skipping is refused where backward_dw owes the weight gradients; the refused call changes nothing.
  GroupedMlpConfig k = small_config();
  k.delay_wgrad = true;
  GroupedMlp layer(k);
  Case c;
  c.cfg = k;
  c.T = 8;
  Runner r(c);
  const int64_t H = k.hidden, F1 = k.fc1_out(), F = k.ffn, E = k.experts;
  auto W1 = make_param(r.w1, E, {F1, H}, DType::kBF16, k.layout);
  auto W2 = make_param(r.w2, E, {H, F}, DType::kBF16, k.layout);
  layer.set_weights({W1.views, {}, W2.views, {}});
  DeviceBuffer<uint16_t> x(to_bf16(r.x)), dy(to_bf16(r.dy)), y(c.T * H), dx(c.T * H);
  DeviceBuffer<int32_t> idx(r.routing.indices);
  DeviceBuffer<float> probs(std::vector<float>(r.routing.probs.begin(), r.routing.probs.end())), dprobs(c.T * k.topk);
  RoutingView rv;
  rv.indices = TensorView(idx.get(), DType::kInt32, {c.T, k.topk});
  rv.probs = TensorView(probs.get(), DType::kFP32, {c.T, k.topk});
  const SavedState st = layer.new_state();
  layer.forward(TensorView(x.get(), DType::kBF16, {c.T, H}), rv, TensorView(y.get(), DType::kBF16, {c.T, H}), st,
                nullptr);
  testing::expect_error_naming(
      [&] {
        layer.backward(TensorView(dy.get(), DType::kBF16, {c.T, H}), TensorView(dx.get(), DType::kBF16, {c.T, H}),
                       TensorView(dprobs.get(), DType::kFP32, {c.T, k.topk}), st, nullptr, nullptr, WeightGrads::kSkip);
      },
      "weight_grads");
  // The state is still filled: the full backward runs.
  layer.backward(TensorView(dy.get(), DType::kBF16, {c.T, H}), TensorView(dx.get(), DType::kBF16, {c.T, H}),
                 TensorView(dprobs.get(), DType::kFP32, {c.T, k.topk}), st, nullptr);
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
}

// Outputs over inputs the backward reads again are refused before anything runs: the experts'
// forward writing Y over the x_perm its state keeps for the fc1 weight gradient (Y overlapping it by
// one row too), and the layer's backward in token chunks writing dx over the x whose rows the fc1
// weight gradient gathers after the last chunk (as with delay_wgrad).
TEST(GroupedMlp, OutputsOverInputsTheBackwardReadsAreRefused) {
  MOE_REQUIRE_GPU();
  {
    ExpertsConfig cfg;
    cfg.hidden = 128;
    cfg.ffn = 64;
    cfg.experts = 2;
    cfg.max_rows = 64;
    const int E = cfg.experts;
    const int64_t H = cfg.hidden, R = cfg.max_rows;
    std::mt19937_64 rng(3);
    GroupedExperts ex(cfg);
    DeviceParam W1 = make_param(random_bf16_values(size_t(E) * cfg.fc1_out() * H, 0.1, rng), E, {cfg.fc1_out(), H},
                                DType::kBF16, cfg.layout);
    DeviceParam W2 = make_param(random_bf16_values(size_t(E) * H * cfg.ffn, 0.1, rng), E, {H, cfg.ffn}, DType::kBF16,
                                cfg.layout);
    ex.set_weights({W1.views, {}, W2.views, {}});
    DeviceBuffer<uint16_t> buf(2 * R * H);
    DeviceBuffer<int32_t> offs(std::vector<int32_t>{0, 30, 60});
    DeviceBuffer<float> pp(std::vector<float>(R, 0.5f));
    const TensorView x_perm(buf.get(), DType::kBF16, {R, H});
    const TensorView g(offs.get(), DType::kInt32, {E + 1}), p(pp.get(), DType::kFP32, {R});
    const SavedState st = ex.new_state();
    testing::expect_error_naming([&] { ex.forward(x_perm, g, p, x_perm, st, nullptr); }, "'Y'");
    const TensorView shifted(buf.get() + (R - 1) * H, DType::kBF16, {R, H});  // overlaps its last row
    testing::expect_error_naming([&] { ex.forward(x_perm, g, p, shifted, st, nullptr); }, "'Y'");
    EXPECT_EQ(st.status(), StateStatus::kEmpty);
    const TensorView apart(buf.get() + R * H, DType::kBF16, {R, H});
    ex.forward(x_perm, g, p, apart, st, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  {
    GroupedMlpConfig k = small_config();
    k.fuse_fc1 = true;
    k.save_x_perm = false;
    k.fuse_fc2_dgrad = true;
    k.token_chunks = 2;
    k.validate();
    GroupedMlp layer(k);
    const int64_t H = k.hidden, T = 8;
    std::mt19937_64 rng(4);
    auto W1 = make_param(random_bf16_values(k.experts * k.fc1_out() * H, 0.1, rng), k.experts, {k.fc1_out(), H},
                         DType::kBF16, k.layout);
    auto W2 = make_param(random_bf16_values(k.experts * H * k.ffn, 0.1, rng), k.experts, {H, k.ffn}, DType::kBF16,
                         k.layout);
    DeviceBuffer<uint16_t> gw1(k.experts * k.fc1_out() * H), gw2(k.experts * H * k.ffn);
    layer.set_weights({W1.views, {}, W2.views, {}});
    layer.set_grads({{TensorView(gw1.get(), DType::kBF16, {k.experts, k.fc1_out(), H})}, {},
                     {TensorView(gw2.get(), DType::kBF16, {k.experts, H, k.ffn})}, {}});
    DeviceBuffer<uint16_t> x(to_bf16(random_bf16_values(T * H, 1.0, rng))), y(T * H), dx(T * H);
    DeviceBuffer<int32_t> idx(std::vector<int32_t>{0, 1, 2, 3, 4, 5, 0, 2, 1, 3, 5, 4, 2, 0, 3, 1});
    DeviceBuffer<float> probs(std::vector<float>(T * k.topk, 0.5f)), dprobs(T * k.topk);
    RoutingView rv;
    rv.indices = TensorView(idx.get(), DType::kInt32, {T, k.topk});
    rv.probs = TensorView(probs.get(), DType::kFP32, {T, k.topk});
    const TensorView xv(x.get(), DType::kBF16, {T, H}), yv(y.get(), DType::kBF16, {T, H});
    const TensorView dxv(dx.get(), DType::kBF16, {T, H}), dpv(dprobs.get(), DType::kFP32, {T, k.topk});
    const SavedState st = layer.new_state();
    layer.forward(xv, rv, yv, st, nullptr);
    testing::expect_error_naming([&] { layer.backward(yv, xv, dpv, st, nullptr); }, "'dx'");
    EXPECT_EQ(st.status(), StateStatus::kFilled);
    layer.backward(yv, dxv, dpv, st, nullptr);
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

TEST(GroupedMlp, GradientsOverWeightsAreRefused) {
  // The unfused backward writes dW2 before its fc2 dgrad reads W2: a gradient bound over a weight
  // would have given a silently wrong dx. Refused when the gradients are bound, by name. (Weights bound
  // later over gradient memory are not refused: that memory may have been freed since the gradients
  // were bound, as PyTorch's per-backward gradient buffers are.)
  MOE_REQUIRE_GPU();
  GroupedMlpConfig k = small_config();
  GroupedMlp layer(k);
  const int64_t H = k.hidden;
  std::mt19937_64 rng(6);
  auto W1 = make_param(random_bf16_values(k.experts * k.fc1_out() * H, 0.1, rng), k.experts, {k.fc1_out(), H},
                       DType::kBF16, k.layout);
  auto W2 = make_param(random_bf16_values(k.experts * H * k.ffn, 0.1, rng), k.experts, {H, k.ffn}, DType::kBF16,
                       k.layout);
  DeviceBuffer<uint16_t> gw1(k.experts * k.fc1_out() * H), gw2(k.experts * H * k.ffn);
  const TensorView dw1(gw1.get(), DType::kBF16, {k.experts, k.fc1_out(), H});
  const TensorView dw2(gw2.get(), DType::kBF16, {k.experts, H, k.ffn});
  layer.set_weights({W1.views, {}, W2.views, {}});
  testing::expect_error_naming([&] { layer.set_grads({{dw1}, {}, W2.views, {}}); }, "'fc2.weight grad'");
  const TensorView dw2_over_dw1(gw1.get(), DType::kBF16, {k.experts, H, k.ffn});
  testing::expect_error_naming([&] { layer.set_grads({{dw1}, {}, {dw2_over_dw1}, {}}); }, "'fc1.weight grad'");
  layer.set_grads({{dw1}, {}, {dw2}, {}});
  layer.set_weights({{dw1}, {}, W2.views, {}});  // the old gradient memory, now a weight
  testing::expect_error_naming([&] { layer.set_grads({{dw1}, {}, {dw2}, {}}); }, "'fc1.weight grad'");
}

TEST(GroupedMlp, BadInputIsReported) {
  MOE_REQUIRE_GPU();
  GroupedMlpConfig k = small_config();
  GroupedMlp layer(k);
  const int64_t H = k.hidden, T = 8;
  DeviceBuffer<uint16_t> x(T * H), y(T * H);
  DeviceBuffer<int32_t> idx(std::vector<int32_t>(T * k.topk, 0));
  DeviceBuffer<float> probs(std::vector<float>(T * k.topk, 0.5f));
  RoutingView rv;
  rv.indices = TensorView(idx.get(), DType::kInt32, {T, k.topk});
  rv.probs = TensorView(probs.get(), DType::kFP32, {T, k.topk});
  TensorView xv(x.get(), DType::kBF16, {T, H}), yv(y.get(), DType::kBF16, {T, H});
  auto expect_error = [](auto&& f, const std::string& needle) { testing::expect_error_naming(f, needle); };
  const SavedState st = layer.new_state();
  expect_error([&] { layer.forward(xv, rv, yv, st, nullptr); }, "set_weights");
  std::mt19937_64 rng(1);
  auto W1 = make_param(random_bf16_values(k.experts * k.fc1_out() * H, 0.1, rng), k.experts, {k.fc1_out(), H},
                       DType::kBF16, k.layout);
  auto W2 = make_param(random_bf16_values(k.experts * H * k.ffn, 0.1, rng), k.experts, {H, k.ffn}, DType::kBF16,
                       k.layout);
  expect_error([&] { layer.set_weights({W2.views, {}, W1.views, {}}); }, "fc1.weight");
  layer.set_weights({W1.views, {}, W2.views, {}});
  expect_error([&] { layer.set_weights({W1.views, W1.views, W2.views, {}}); }, "fc1.bias");
  {  // transposed weights: fc2.weight [E, F, H] expected where [E, H, F] came (here fc1_out = H,
     // so fc1.weight's shape is the same in both orientations)
    GroupedMlpConfig kt = k;
    kt.transposed_weights = true;
    GroupedMlp transposed(kt);
    expect_error([&] { transposed.set_weights({W1.views, {}, W2.views, {}}); }, "fc2.weight");
  }
  TensorView wrong(x.get(), DType::kBF16, {T, H / 2});
  expect_error([&] { layer.forward(wrong, rv, yv, st, nullptr); }, "'x'");
  DeviceBuffer<uint16_t> big((k.max_tokens + 1) * H);
  expect_error([&] { layer.forward(TensorView(big.get(), DType::kBF16, {k.max_tokens + 1, H}), rv, yv, st, nullptr); },
               "max_tokens");
  const TensorView dpv(probs.get(), DType::kFP32, {T, k.topk});
  expect_error([&] { layer.backward(yv, yv, dpv, st, nullptr); }, "empty");
  expect_error([&] { layer.backward_dw(st, nullptr); }, "delay_wgrad");
  expect_error([&] { layer.forward(xv, rv, yv, SavedState(), nullptr); }, "'state'");
  // A state of another size (another op's) is refused by name.
  Dispatcher other(DispatcherConfig{64, 6, 2, 128});
  expect_error([&] { layer.forward(xv, rv, yv, other.new_plan(), nullptr); }, "'state'");
  // Device-detected: an expert id out of range is skipped and reported by check_errors.
  std::vector<int32_t> bad(T * k.topk, 1);
  bad[3] = k.experts + 5;
  idx.upload(bad);
  layer.forward(xv, rv, yv, st, nullptr);
  expect_error([&] { layer.check_errors(nullptr); }, "out of range");
  layer.check_errors(nullptr);  // cleared
  idx.upload(std::vector<int32_t>(T * k.topk, 0));
  // Saved-state misuse: a second forward into a filled state (its backward has not run) is refused
  // and leaves it filled; a refused forward (bad x) changes nothing; the backward consumes the
  // state once; another layer's state is refused.
  expect_error([&] { layer.forward(xv, rv, yv, st, nullptr); }, "reset()");
  expect_error([&] { layer.forward(wrong, rv, yv, st, nullptr); }, "'x'");
  EXPECT_EQ(st.status(), StateStatus::kFilled);
  GroupedMlp other_layer(k);
  other_layer.set_weights({W1.views, {}, W2.views, {}});
  const SavedState foreign = other_layer.new_state();
  other_layer.forward(xv, rv, yv, foreign, nullptr);
  DeviceBuffer<uint16_t> gw1(k.experts * k.fc1_out() * H), gw2(k.experts * H * k.ffn);
  layer.set_grads({{TensorView(gw1.get(), DType::kBF16, {k.experts, k.fc1_out(), H})}, {},
                   {TensorView(gw2.get(), DType::kBF16, {k.experts, H, k.ffn})}, {}});
  DeviceBuffer<uint16_t> dx(T * H);
  const TensorView dxv(dx.get(), DType::kBF16, {T, H});
  expect_error([&] { layer.backward(yv, dxv, dpv, foreign, nullptr); }, "another op");
  layer.backward(yv, dxv, dpv, st, nullptr);
  EXPECT_EQ(st.status(), StateStatus::kConsumed);
  expect_error([&] { layer.backward(yv, dxv, dpv, st, nullptr); }, "consumed");
  // A consumed state is reusable; reset() discards a forward whose backward will never run.
  layer.forward(xv, rv, yv, st, nullptr);
  SavedState again = st;
  again.reset();
  EXPECT_EQ(st.status(), StateStatus::kEmpty);
  expect_error([&] { layer.backward(yv, dxv, dpv, st, nullptr); }, "empty");
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  GroupedMlpConfig badcfg = k;
  badcfg.ffn = 60;
  expect_error([&] { GroupedMlp l(badcfg); }, "ffn");
}

}  // namespace
}  // namespace moe
