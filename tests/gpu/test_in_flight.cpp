// Several micro-batches in flight (pipeline schedules): four forwards, then their backwards in
// reverse and in shuffled order -- for the layer (default, probs at the combine with biases,
// delayed wgrad, activation recompute) and for the experts-only op composed with the dispatcher by
// hand. Every output and gradient must be bitwise what that micro-batch gives when run alone, eager
// and inside one captured CUDA graph replayed with new data. Weight gradients accumulate into an
// fp32 main_grad, so the final main_grad is bitwise the same exactly when the backwards (the
// backward_dw calls in delayed mode) ran in the same order as the one-at-a-time runs.
// Also: recompute mode equals the saved-activation mode bitwise, and the experts-only composition
// equals the layer bitwise.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "moe/dispatch.h"
#include "moe/error_word.h"
#include "moe/grouped_experts.h"
#include "moe/grouped_mlp.h"
#include "moe/saved_state.h"
#include "reference/routing_gen.h"
#include "support/gpu.h"
#include "support/layer_data.h"

namespace moe {
namespace {

using testing::DeviceBuffer;
using namespace testing::layer_data;

constexpr int kMicroBatches = 4;
const std::vector<int64_t> kTokens = {64, 37, 0, 50};

GroupedMlpConfig base_config() {
  GroupedMlpConfig c;
  c.hidden = 128;
  c.ffn = 64;
  c.experts = 6;
  c.topk = 2;
  c.max_tokens = 64;
  c.dispatch.align = 16;
  c.wgrad = WgradMode::kAccumulate;
  return c;
}

// The parameters (shared by every micro-batch) and their fp32 main_grads, at fixed addresses.
struct Params {
  DeviceParam W1, W2, B1, B2, G1, G2, GB1, GB2;
  std::vector<double> g1, g2, gb1, gb2;  // initial main_grad values

  explicit Params(const GroupedMlpConfig& k) {
    const int E = k.experts;
    const int64_t H = k.hidden, F = k.ffn, F1 = k.fc1_out();
    std::mt19937_64 rng(77);
    W1 = make_param(random_bf16_values(E * F1 * H, 0.1, rng), E, {F1, H}, DType::kBF16, k.layout);
    W2 = make_param(random_bf16_values(E * H * F, 0.1, rng), E, {H, F}, DType::kBF16, k.layout);
    B1 = make_param(random_bf16_values(E * F1, 0.5, rng), E, {F1}, DType::kBF16, k.layout);
    B2 = make_param(random_bf16_values(E * H, 0.5, rng), E, {H}, DType::kBF16, k.layout);
    g1 = random_bf16_values(E * F1 * H, 1.0, rng);
    g2 = random_bf16_values(E * H * F, 1.0, rng);
    gb1 = random_bf16_values(E * F1, 1.0, rng);
    gb2 = random_bf16_values(E * H, 1.0, rng);
    G1 = make_param(g1, E, {F1, H}, DType::kFP32, k.layout);
    G2 = make_param(g2, E, {H, F}, DType::kFP32, k.layout);
    GB1 = make_param(gb1, E, {F1}, DType::kFP32, k.layout);
    GB2 = make_param(gb2, E, {H}, DType::kFP32, k.layout);
  }
  // Back to the initial main_grad values, in place (graphs hold the addresses).
  void reset_grads() {
    for (auto [p, init] : {std::pair<DeviceParam*, std::vector<double>*>{&G1, &g1}, {&G2, &g2}, {&GB1, &gb1},
                           {&GB2, &gb2}}) {
      std::vector<float> f(init->begin(), init->end());
      size_t off = 0;
      for (auto& b : p->bufs) {
        MOE_CUDA_CHECK(cudaMemcpy(b.get(), f.data() + off, b.size(), cudaMemcpyHostToDevice));
        off += b.size() / sizeof(float);
      }
    }
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  ExpertTensors weights(bool bias) const {
    return {W1.views, bias ? B1.views : std::vector<TensorView>{}, W2.views,
            bias ? B2.views : std::vector<TensorView>{}};
  }
  ExpertTensors grads(bool bias) const {
    return {G1.views, bias ? GB1.views : std::vector<TensorView>{}, G2.views,
            bias ? GB2.views : std::vector<TensorView>{}};
  }
  std::vector<std::vector<double>> download_grads(bool bias) const {
    std::vector<std::vector<double>> r{download_param(G1, DType::kFP32), download_param(G2, DType::kFP32)};
    if (bias) {
      r.push_back(download_param(GB1, DType::kFP32));
      r.push_back(download_param(GB2, DType::kFP32));
    }
    return r;
  }
};

// One micro-batch's inputs and outputs, at fixed addresses (a captured graph holds them).
struct MicroBatch {
  int64_t T, H;
  int k;
  DeviceBuffer<uint16_t> x, dy, y, dx;
  DeviceBuffer<int32_t> idx;
  DeviceBuffer<float> probs, dprobs;

  MicroBatch(int64_t T_, int64_t H_, int k_)
      : T(T_), H(H_), k(k_), x(T * H), dy(T * H), y(T * H), dx(T * H), idx(T * k), probs(T * k), dprobs(T * k) {}

  void load(int E, uint64_t seed, double skew) {
    std::mt19937_64 g(seed);
    const ref::Routing rt = ref::make_topk_routing(T, E, k, seed, skew);
    x.upload(to_bf16(random_bf16_values(T * H, 1.0, g)));
    dy.upload(to_bf16(random_bf16_values(T * H, 1.0, g)));
    idx.upload(rt.indices);
    probs.upload(std::vector<float>(rt.probs.begin(), rt.probs.end()));
    for (auto* b : {&y, &dx}) b->fill_bytes(0xFF);
    dprobs.fill_bytes(0xFF);
  }
  RoutingView routing() const {
    RoutingView rv;
    rv.indices = TensorView(idx.get(), DType::kInt32, {T, k});
    rv.probs = TensorView(probs.get(), DType::kFP32, {T, k});
    return rv;
  }
  TensorView xv() const { return TensorView(x.get(), DType::kBF16, {T, H}); }
  TensorView yv() const { return TensorView(y.get(), DType::kBF16, {T, H}); }
  TensorView dyv() const { return TensorView(dy.get(), DType::kBF16, {T, H}); }
  TensorView dxv() const { return TensorView(dx.get(), DType::kBF16, {T, H}); }
  TensorView dprobsv() const { return TensorView(dprobs.get(), DType::kFP32, {T, k}); }
  std::vector<std::vector<uint16_t>> outputs() const { return {y.download(), dx.download()}; }
};

// Everything a run produced: per micro-batch y, dx, dprobs (as raw bits), then the main_grads.
struct RunResult {
  std::vector<std::vector<uint16_t>> bf16;
  std::vector<std::vector<float>> dprobs;
  std::vector<std::vector<double>> grads;
};

void expect_same(const RunResult& a, const RunResult& b, const std::string& what) {
  ASSERT_EQ(a.bf16.size(), b.bf16.size());
  for (size_t i = 0; i < a.bf16.size(); ++i) EXPECT_TRUE(a.bf16[i] == b.bf16[i]) << what << ": y/dx tensor " << i;
  for (size_t i = 0; i < a.dprobs.size(); ++i)
    EXPECT_EQ(0, std::memcmp(a.dprobs[i].data(), b.dprobs[i].data(), a.dprobs[i].size() * 4))
        << what << ": dprobs of micro-batch " << i;
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(a.grads[i] == b.grads[i]) << what << ": main_grad " << i;
}

// The three steps of a micro-batch for whatever implementation is under test.
struct Model {
  std::function<void(int, cudaStream_t)> forward, backward, backward_dw;
  bool delayed = false;
};

// forwards of all micro-batches, then backwards in `order` (delayed: all backwards in order, then
// the backward_dw calls in `dw_order`).
void enqueue_in_flight(const Model& m, const std::vector<int>& order, const std::vector<int>& dw_order,
                       cudaStream_t s) {
  for (int i = 0; i < kMicroBatches; ++i) m.forward(i, s);
  for (int i : order) m.backward(i, s);
  if (m.delayed)
    for (int i : dw_order) m.backward_dw(i, s);
}

// One micro-batch at a time, in the order in which main_grad accumulates in the in-flight run.
void enqueue_alone(const Model& m, const std::vector<int>& order, const std::vector<int>& dw_order, cudaStream_t s) {
  for (int i : m.delayed ? dw_order : order) {
    m.forward(i, s);
    m.backward(i, s);
    if (m.delayed) m.backward_dw(i, s);
  }
}

struct Harness {
  GroupedMlpConfig cfg;
  Params params;
  std::vector<std::unique_ptr<MicroBatch>> mb;

  explicit Harness(const GroupedMlpConfig& k) : cfg(k), params(k) {
    for (int i = 0; i < kMicroBatches; ++i) mb.push_back(std::make_unique<MicroBatch>(kTokens[i], k.hidden, k.topk));
  }
  void load(uint64_t seed) {
    for (int i = 0; i < kMicroBatches; ++i) mb[i]->load(cfg.experts, seed + i, i % 2 ? 1.5 : 0.0);
  }
  RunResult collect() {
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    RunResult r;
    for (auto& b : mb) {
      for (auto& o : b->outputs()) r.bf16.push_back(std::move(o));
      r.dprobs.push_back(b->dprobs.download());
    }
    r.grads = params.download_grads(cfg.bias);
    return r;
  }
  void reset_outputs() {
    for (auto& b : mb) {
      for (auto* o : {&b->y, &b->dx}) o->fill_bytes(0xFF);
      b->dprobs.fill_bytes(0xFF);
    }
  }
};

// Runs the in-flight schedule eagerly (two backward orders) and in one captured graph replayed with
// new data and routing, each against the one-at-a-time run of the same data.
void check_model(Harness& h, const Model& m) {
  const std::vector<int> dw_order = {1, 3, 0, 2};
  for (const std::vector<int>& order : {std::vector<int>{3, 2, 1, 0}, std::vector<int>{2, 0, 3, 1}}) {
    SCOPED_TRACE(::testing::Message() << "backward order " << order[0] << order[1] << order[2] << order[3]);
    h.load(100);
    h.params.reset_grads();
    enqueue_in_flight(m, order, dw_order, nullptr);
    const RunResult together = h.collect();
    h.reset_outputs();
    h.params.reset_grads();
    enqueue_alone(m, order, dw_order, nullptr);
    expect_same(together, h.collect(), "eager in flight vs alone");
  }
  cudaStream_t s;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  const std::vector<int> order = {2, 0, 3, 1}, graph_dw_order = {3, 1, 2, 0};
  h.load(200);
  h.params.reset_grads();
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  enqueue_in_flight(m, order, graph_dw_order, s);
  MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (uint64_t seed : {300, 400}) {
    SCOPED_TRACE(::testing::Message() << "graph replay, data seed " << seed);
    h.load(seed);
    h.params.reset_grads();
    MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    const RunResult replayed = h.collect();
    h.reset_outputs();
    h.params.reset_grads();
    enqueue_alone(m, order, graph_dw_order, s);
    MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    expect_same(replayed, h.collect(), "graph in flight vs eager alone");
  }
  MOE_CUDA_CHECK(cudaGraphExecDestroy(exec));
  MOE_CUDA_CHECK(cudaGraphDestroy(graph));
  MOE_CUDA_CHECK(cudaStreamDestroy(s));
}

// The layer with one saved state per micro-batch.
struct LayerModel {
  GroupedMlp layer;
  std::vector<SavedState> states;
  Model model;

  explicit LayerModel(Harness& h) : layer(h.cfg) {
    layer.set_weights(h.params.weights(h.cfg.bias));
    layer.set_grads(h.params.grads(h.cfg.bias));
    for (int i = 0; i < kMicroBatches; ++i) states.push_back(layer.new_state());
    model.delayed = h.cfg.delay_wgrad;
    model.forward = [this, &h](int i, cudaStream_t s) {
      const MicroBatch& b = *h.mb[i];
      layer.forward(b.xv(), b.routing(), b.yv(), states[i], s);
    };
    model.backward = [this, &h](int i, cudaStream_t s) {
      const MicroBatch& b = *h.mb[i];
      layer.backward(b.dyv(), b.dxv(), b.dprobsv(), states[i], s);
    };
    model.backward_dw = [this](int i, cudaStream_t s) { layer.backward_dw(states[i], s); };
  }
};

// The experts-only op composed with the dispatcher by hand, one plan + experts state + buffers per
// micro-batch; the combine merges with the given routing probs (the layer uses the plan's).
struct ExpertsModel {
  Dispatcher d;
  GroupedExperts ex;
  ErrorWord ew;
  int64_t R, H;
  bool probs_in_act;
  std::vector<SavedState> plans, states;
  std::vector<DeviceBuffer<uint16_t>> x_perm, Y, dY, dx_perm;
  std::vector<DeviceBuffer<float>> dpp;
  Model model;

  TensorView rows(const DeviceBuffer<uint16_t>& b) const { return TensorView(b.get(), DType::kBF16, {R, H}); }

  explicit ExpertsModel(Harness& h)
      : d(h.cfg.dispatcher_config()), ex(h.cfg.experts_config()), R(d.rows()), H(h.cfg.hidden),
        probs_in_act(h.cfg.probs == ProbsPlacement::kInActivation) {
    EXPECT_EQ(R, h.cfg.row_bound());
    ex.set_weights(h.params.weights(h.cfg.bias));
    ex.set_grads(h.params.grads(h.cfg.bias));
    for (int i = 0; i < kMicroBatches; ++i) {
      plans.push_back(d.new_plan());
      states.push_back(ex.new_state());
      for (auto* v : {&x_perm, &Y, &dY, &dx_perm}) v->emplace_back(R * H);
      dpp.emplace_back(R);
    }
    model.delayed = h.cfg.delay_wgrad;
    model.forward = [this, &h](int i, cudaStream_t s) {
      const MicroBatch& b = *h.mb[i];
      const RoutingView rv = b.routing();
      d.plan(rv, ew.device_ptr(), plans[i], s);
      d.permute(plans[i], b.xv(), rows(x_perm[i]), s);
      ex.forward(rows(x_perm[i]), d.group_offsets(plans[i]), probs_in_act ? d.probs_perm(plans[i]) : TensorView(),
                 rows(Y[i]), states[i], s);
      d.unpermute(plans[i], rows(Y[i]), b.yv(), probs_in_act ? MergeProbs::kNone : MergeProbs::kGiven, s, &rv.probs);
    };
    model.backward = [this, &h](int i, cudaStream_t s) {
      const MicroBatch& b = *h.mb[i];
      const RoutingView rv = b.routing();
      const TensorView Yv = rows(Y[i]), dprobs = b.dprobsv();
      const TensorView dppv(dpp[i].get(), DType::kFP32, {R});
      d.unpermute_backward(plans[i], b.dyv(), rows(dY[i]), probs_in_act ? MergeProbs::kNone : MergeProbs::kGiven, s,
                           &rv.probs, &Yv, &dprobs);
      ex.backward(rows(dY[i]), rows(dx_perm[i]), probs_in_act ? dppv : TensorView(), states[i], s);
      if (probs_in_act)
        d.permute_backward(plans[i], rows(dx_perm[i]), b.dxv(), s, &dppv, &dprobs);
      else
        d.permute_backward(plans[i], rows(dx_perm[i]), b.dxv(), s);
    };
    model.backward_dw = [this](int i, cudaStream_t s) { ex.backward_dw(states[i], s); };
  }
};

struct Variant {
  const char* name;
  bool bias, at_combine, delay, recompute;
  bool lean = false;  // the fused fc1 keeping no x_perm (a layer option): the state refers to each x
  bool dgrad = false;  // the fused fc2 dgrad (in the layer: gathering dy, no dY_perm when lean without bias)
  bool fp8 = false;    // the FP8 experts (A = 128; the layer quantizes the gathered rows of x, and of dy
                       // without bias with the probs in the activation)
};
const Variant kVariants[] = {
    {"default", false, false, false, false},
    {"bias, probs at combine", true, true, false, false},
    {"bias, delayed wgrad", true, false, true, false},
    {"recompute", true, false, false, true},
    {"recompute, probs at combine", false, true, false, true},
    {"fused fc1 without x_perm", true, false, false, false, true},
    {"fused fc1 without x_perm, delayed wgrad", true, true, true, false, true},
    {"fused fc2 dgrad, no x_perm or dY_perm", false, false, false, false, true, true},
    {"fused fc2 dgrad, bias, delayed wgrad", true, false, true, false, false, true},
    {"fp8", true, false, false, false, false, false, true},
    {"fp8, no bias (dY quantized from dy's rows)", false, false, false, false, false, false, true},
    {"fp8, recompute, probs at combine", false, true, false, true, false, false, true},
    // Delayed: the states keep the columnwise FP8 copies of dY and dh for backward_dw; without bias
    // the layer's state keeps no dY at all (dy's rows are quantized straight into those copies).
    {"fp8, bias, delayed wgrad", true, false, true, false, false, false, true},
    {"fp8, no bias, delayed wgrad", false, false, true, false, false, false, true},
    {"fp8, probs at combine, delayed wgrad", false, true, true, false, false, false, true},
};

GroupedMlpConfig config_of(const Variant& v) {
  GroupedMlpConfig c = base_config();
  c.bias = v.bias;
  c.probs = v.at_combine ? ProbsPlacement::kAtCombine : ProbsPlacement::kInActivation;
  c.delay_wgrad = v.delay;
  c.recompute = v.recompute;
  c.fuse_fc1 = v.lean;
  c.save_x_perm = !v.lean;
  c.fuse_fc2_dgrad = v.dgrad;
  if (v.fp8) {
    c.fp8 = Fp8Recipe::kBlock;
    c.dispatch.align = 128;
  }
  return c;
}

TEST(GroupedMlp, in_flight_micro_batches_any_backward_order) {
  MOE_REQUIRE_GPU();
  for (const Variant& v : kVariants) {
    SCOPED_TRACE(v.name);
    Harness h(config_of(v));
    LayerModel lm(h);
    check_model(h, lm.model);
  }
}

TEST(GroupedExperts, in_flight_micro_batches_any_backward_order) {
  MOE_REQUIRE_GPU();
  for (const Variant& v : kVariants) {
    if (v.recompute || v.lean) continue;  // layer options
    SCOPED_TRACE(v.name);
    Harness h(config_of(v));
    ExpertsModel em(h);
    check_model(h, em.model);
  }
}

// The experts-only composition and the layer give the same bits; recompute mode gives the same
// bits as saved activations.
TEST(GroupedMlp, in_flight_compositions_agree_bitwise) {
  MOE_REQUIRE_GPU();
  const std::vector<int> order = {0, 1, 2, 3};
  for (const Variant& v : kVariants) {
    if (v.recompute || v.lean) continue;
    SCOPED_TRACE(v.name);
    Harness h(config_of(v));
    h.load(500);
    LayerModel lm(h);
    h.params.reset_grads();
    enqueue_alone(lm.model, order, order, nullptr);
    const RunResult layer = h.collect();
    ExpertsModel em(h);
    h.reset_outputs();
    h.params.reset_grads();
    enqueue_alone(em.model, order, order, nullptr);
    expect_same(layer, h.collect(), "experts-only composition vs layer");
    if (v.delay) continue;
    GroupedMlpConfig rc = h.cfg;
    rc.recompute = true;
    Harness hr(rc);
    hr.load(500);
    LayerModel rm(hr);
    hr.params.reset_grads();
    enqueue_alone(rm.model, order, order, nullptr);
    expect_same(layer, hr.collect(), "recompute vs saved activations");
  }
}

// The state and workspace budget: recompute keeps only the plan in the state.
TEST(GroupedMlp, RecomputeStateHoldsOnlyThePlan) {
  MOE_REQUIRE_GPU();
  GroupedMlpConfig c = base_config();
  GroupedMlp saved(c);
  c.recompute = true;
  GroupedMlp recompute(c);
  EXPECT_EQ(recompute.state_bytes(), recompute.dispatcher().plan_bytes());
  EXPECT_LT(recompute.state_bytes() * 4, saved.state_bytes());
}

// With the FP8 experts the layer's state is its plan and the experts' state (h and the FP8
// columnwise copies): the bf16 x_perm (2 R H bytes) stays in the workspace. So does dY with delayed
// weight gradients and no bias (the experts' state keeps its FP8 copies instead); with bias the
// delayed state keeps dY for the bias gradient.
TEST(GroupedMlp, Fp8StateHoldsNoXPerm) {
  MOE_REQUIRE_GPU();
  for (const Variant& v : {Variant{"fp8", true, false, false, false, false, false, true},
                           Variant{"fp8 delayed", false, false, true, false, false, false, true},
                           Variant{"fp8 delayed, bias", true, false, true, false, false, false, true}}) {
    SCOPED_TRACE(v.name);
    const GroupedMlpConfig c = config_of(v);
    GroupedMlp layer(c);
    const size_t parts = layer.dispatcher().plan_bytes() + GroupedExperts(c.experts_config()).state_bytes();
    const size_t rows_h = static_cast<size_t>(c.row_bound() * c.hidden * 2);  // one bf16 [R, H]
    const size_t dY = v.delay && v.bias ? rows_h : 0;
    EXPECT_GE(layer.state_bytes(), parts + dY);
    EXPECT_LT(layer.state_bytes(), parts + dY + rows_h / 4);  // alignment padding only
    if (v.delay) {  // the experts' state adds the columnwise FP8 copies of dY and dh with their scales
      ExpertsConfig immediate = c.experts_config();
      immediate.delay_wgrad = false;
      const int64_t R = c.row_bound(), blocks = (R + 127) / 128, cols = c.hidden + c.fc1_out();
      const size_t copies = static_cast<size_t>(R * cols + 4 * blocks * cols);
      const size_t added = GroupedExperts(c.experts_config()).state_bytes() - GroupedExperts(immediate).state_bytes();
      EXPECT_GE(added, copies);
      EXPECT_LT(added, copies + 4 * 256);  // alignment padding only
    }
  }
}

}  // namespace
}  // namespace moe
