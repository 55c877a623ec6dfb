// CPU reference of the whole expert layer (docs/semantics.md): fp64 finite-difference checks of dx,
// dprobs and every weight and bias gradient (each activation, bias on/off, probs in the activation
// or at combine), GLU interleave and weight layouts as pure storage choices (bitwise), main_grad
// accumulation, delayed wgrad and hooks, edge cases of the routing, map form, bf16 emulation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "moe/activation.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "moe/grouped_mlp_config.h"
#include "reference/grouped_mlp_ref.h"
#include "reference/quantize_ref.h"
#include "reference/routing_gen.h"
#include "reference/routing_ref.h"
#include "support/expect_error.h"

namespace moe::ref {
namespace {

using ::moe::testing::expect_error_naming;

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0);
}

GroupedMlpConfig make_config(Activation act, bool bias, ProbsPlacement placement, int E, int k, int64_t T,
                             int64_t H = 8, int64_t F = 8) {
  GroupedMlpConfig c;
  c.hidden = H;
  c.ffn = F;
  c.experts = E;
  c.topk = k;
  c.max_tokens = T;
  c.activation.kind = act;
  if (act == Activation::kClampedSwiGLU) c.activation.limit = 0.6f;  // fc1 outputs ~N(0, 1): both sides hit
  c.bias = bias;
  c.probs = placement;
  c.wgrad = WgradMode::kWrite;
  c.wgrad_dtype = DType::kFP32;
  return c;
}

// The four parameters in their logical (non-interleaved) order: fc1 rows [gate 0:F | linear 0:F].
struct Logical {
  std::vector<double> w1, b1, w2, b2;  // [E, F1, H], [E, F1], [E, H, F], [E, H]
};

Logical random_weights(const GroupedMlpConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0), ub(-0.5, 0.5);
  const int64_t E = c.experts, H = c.hidden, F = c.ffn, F1 = c.fc1_out();
  Logical w;
  w.w1.resize(E * F1 * H);
  w.w2.resize(E * H * F);
  for (auto& v : w.w1) v = u(rng);
  for (auto& v : w.w2) v = u(rng) / 2;
  if (c.bias) {
    w.b1.resize(E * F1);
    w.b2.resize(E * H);
    for (auto& v : w.b1) v = ub(rng);
    for (auto& v : w.b2) v = ub(rng);
  }
  return w;
}

// Physical fc1 row of logical row q (GLU interleave).
int64_t physical_row(const GroupedMlpConfig& c, int64_t q) {
  const int s = c.activation.glu_interleave;
  if (!is_gated(c.activation.kind) || s == 0) return q;
  return q < c.ffn ? gate_column(q, c.ffn, s) : linear_column(q - c.ffn, c.ffn, s);
}

// Parameters stored in the config's physical layout: one block per parameter with the experts'
// pointers inside it (single grouped) or one block per expert.
struct Stored {
  std::vector<std::vector<double>> blocks;
  ExpertParams params;
};

Stored store(const Logical& w, const GroupedMlpConfig& c, bool per_expert) {
  const int E = c.experts;
  const int64_t H = c.hidden, F = c.ffn, F1 = c.fc1_out();
  Stored s;
  s.blocks.reserve(4 * E + 4);  // pointers into blocks must stay valid
  auto add = [&](std::vector<double*>& table, const std::vector<double>& logical, int64_t per, int64_t row_len,
                 bool fc1) {
    if (logical.empty()) return;
    std::vector<double> phys(logical.size());
    for (int e = 0; e < E; ++e)
      for (int64_t q = 0; q < per / row_len; ++q) {
        const int64_t pq = fc1 ? physical_row(c, q) : q;
        for (int64_t i = 0; i < row_len; ++i) phys[e * per + pq * row_len + i] = logical[e * per + q * row_len + i];
      }
    if (per_expert) {
      for (int e = 0; e < E; ++e) {
        s.blocks.emplace_back(phys.begin() + e * per, phys.begin() + (e + 1) * per);
        table.push_back(s.blocks.back().data());
      }
    } else {
      s.blocks.push_back(std::move(phys));
      for (int e = 0; e < E; ++e) table.push_back(s.blocks.back().data() + e * per);
    }
  };
  add(s.params.fc1_weight, w.w1, F1 * H, H, true);
  add(s.params.fc1_bias, w.b1, F1, 1, true);
  add(s.params.fc2_weight, w.w2, H * F, F, false);
  add(s.params.fc2_bias, w.b2, H, 1, false);
  return s;
}

// Reads stored parameters (gradients) back in logical order.
Logical load(const Stored& s, const GroupedMlpConfig& c) {
  const int E = c.experts;
  const int64_t H = c.hidden, F = c.ffn, F1 = c.fc1_out();
  Logical w;
  auto get = [&](std::vector<double>& out, const std::vector<double*>& table, int64_t per, int64_t row_len, bool fc1) {
    if (table.empty()) return;
    out.resize(E * per);
    for (int e = 0; e < E; ++e)
      for (int64_t q = 0; q < per / row_len; ++q) {
        const int64_t pq = fc1 ? physical_row(c, q) : q;
        for (int64_t i = 0; i < row_len; ++i) out[e * per + q * row_len + i] = table[e][pq * row_len + i];
      }
  };
  get(w.w1, s.params.fc1_weight, F1 * H, H, true);
  get(w.b1, s.params.fc1_bias, F1, 1, true);
  get(w.w2, s.params.fc2_weight, H * F, F, false);
  get(w.b2, s.params.fc2_bias, H, 1, false);
  return w;
}

// Gradient destinations shaped like the parameters, every entry `fill`.
Logical filled(const GroupedMlpConfig& c, double fill) {
  Logical g = random_weights(c, 0);
  for (auto* v : {&g.w1, &g.b1, &g.w2, &g.b2}) std::fill(v->begin(), v->end(), fill);
  return g;
}

struct Problem {
  Routing routing;
  std::vector<double> x, dy;  // [T, H]
};

Problem make_problem(const GroupedMlpConfig& c, Routing routing, uint64_t seed) {
  Problem P;
  P.routing = std::move(routing);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  P.x.resize(P.routing.T * c.hidden);
  P.dy.resize(P.routing.T * c.hidden);
  for (auto& v : P.x) v = u(rng);
  for (auto& v : P.dy) v = u(rng);
  return P;
}

struct Result {
  std::vector<double> y, dx, dprobs;
  Logical grads;
  std::vector<Param> hooks;
};

// forward + backward (+ backward_dw when delayed); gradients start as `grad_init` (logical).
Result run(const GroupedMlpConfig& c, const Problem& P, const Logical& w, bool per_expert, const Logical* grad_init,
           bool emulate = false, const OperandQuant* quant = nullptr) {
  GroupedMlpRef layer(c, emulate);
  if (quant) layer.set_operand_quant(*quant);
  Stored ws = store(w, c, per_expert);
  Stored gs = store(grad_init ? *grad_init : filled(c, std::nan("")), c, per_expert);
  layer.set_weights(ws.params);
  layer.set_grads(gs.params);
  Result res;
  for (Param p : {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias})
    layer.register_hook(p, [&res](Param q) { res.hooks.push_back(q); });
  const int64_t T = P.routing.T, H = c.hidden;
  res.y.resize(T * H);
  res.dx.resize(T * H);
  res.dprobs.resize(T * P.routing.slots());
  layer.forward(P.routing, P.x.data(), res.y.data());
  layer.backward(P.dy.data(), res.dx.data(), res.dprobs.data());
  if (c.delay_wgrad) layer.backward_dw();
  res.grads = load(gs, c);
  return res;
}

// Loss = sum(y * dy): its gradient is the backward with d_y = dy.
double loss(const GroupedMlpConfig& c, const Problem& P, const Logical& w) {
  GroupedMlpRef layer(c);
  Stored ws = store(w, c, false);
  layer.set_weights(ws.params);
  std::vector<double> y(P.routing.T * c.hidden);
  layer.forward(P.routing, P.x.data(), y.data());
  double s = 0;
  for (size_t i = 0; i < y.size(); ++i) s += y[i] * P.dy[i];
  return s;
}

// Central differences over every entry of `param` (perturbed in place, restored).
void check_fd(const char* name, std::vector<double>& param, const std::vector<double>& analytic,
              const std::function<double()>& f) {
  ASSERT_EQ(param.size(), analytic.size()) << name;
  // fp64 central differences: truncation ~eps^2 * f''' ~ 1e-12, rounding ~1e-16 * |L| / eps ~ 1e-9.
  const double eps = 1e-6, tol = 1e-6;
  int bad = 0;
  for (size_t i = 0; i < param.size() && bad < 5; ++i) {
    const double keep = param[i];
    param[i] = keep + eps;
    const double lp = f();
    param[i] = keep - eps;
    const double lm = f();
    param[i] = keep;
    const double fd = (lp - lm) / (2 * eps);
    if (!(std::fabs(analytic[i] - fd) <= tol * (1.0 + std::fabs(fd)))) {
      ++bad;
      ADD_FAILURE() << name << "[" << i << "]: analytic " << analytic[i] << ", finite difference " << fd;
    }
  }
}

double abs_sum(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += std::fabs(x);
  return s;
}

// Every gradient of the layer against finite differences of the loss.
void check_all_gradients(const GroupedMlpConfig& c, Problem P, uint64_t seed) {
  Logical w = random_weights(c, seed);
  Result r = run(c, P, w, false, nullptr);
  auto f = [&] { return loss(c, P, w); };
  check_fd("dx", P.x, r.dx, f);
  check_fd("dprobs", P.routing.probs, r.dprobs, f);
  check_fd("fc1.weight", w.w1, r.grads.w1, f);
  check_fd("fc2.weight", w.w2, r.grads.w2, f);
  if (c.bias) {
    check_fd("fc1.bias", w.b1, r.grads.b1, f);
    check_fd("fc2.bias", w.b2, r.grads.b2, f);
  }
  // Not vacuous: with tokens routed, the gradients are far from zero.
  if (P.routing.T > 0) {
    EXPECT_GT(abs_sum(r.dx), 1e-3);
    EXPECT_GT(abs_sum(r.grads.w1), 1e-3);
    EXPECT_GT(abs_sum(r.dprobs), 1e-3);
  }
}

const Activation kActivations[] = {Activation::kSwiGLU, Activation::kGeGLU, Activation::kClampedSwiGLU,
                                   Activation::kSquaredReLU};

TEST(GroupedMlpRef, FiniteDifferencesEveryActivationBiasAndPlacement) {
  for (Activation act : kActivations)
    for (bool bias : {false, true})
      for (ProbsPlacement pl : {ProbsPlacement::kInActivation, ProbsPlacement::kAtCombine}) {
        SCOPED_TRACE(std::string(activation_name(act)) + (bias ? " bias" : " no-bias") +
                     (pl == ProbsPlacement::kInActivation ? " probs-in-act" : " probs-at-combine"));
        GroupedMlpConfig c = make_config(act, bias, pl, 3, 2, 5);
        check_all_gradients(c, make_problem(c, make_topk_routing(5, 3, 2, 17), 3), 5);
      }
}

Routing topk_routing(int64_t T, int E, int k, std::vector<int32_t> idx, uint64_t seed) {
  Routing r;
  r.form = RoutingForm::kTopK;
  r.T = T;
  r.E = E;
  r.k = k;
  r.indices = std::move(idx);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(0.05, 1.0);
  for (size_t i = 0; i < r.indices.size(); ++i) r.probs.push_back(static_cast<float>(u(rng)));
  return r;
}

TEST(GroupedMlpRef, EdgeCasesFiniteDifferences) {
  struct Edge {
    const char* name;
    int E, k;
    int64_t T;
    int align;
    std::function<Routing()> routing;
  };
  const std::vector<Edge> edges = {
      {"experts without tokens", 4, 2, 4, 0, [] { return topk_routing(4, 4, 2, {0, 2, 2, 0, 0, 2, 2, 0}, 1); }},
      {"one expert takes every token", 3, 1, 5, 0, [] { return topk_routing(5, 3, 1, {1, 1, 1, 1, 1}, 2); }},
      {"k = 1", 3, 1, 6, 0, [] { return make_topk_routing(6, 3, 1, 3); }},
      {"k = E", 3, 3, 4, 0, [] { return make_topk_routing(4, 3, 3, 4); }},
      {"alignment 16, pad rows", 3, 2, 5, 16, [] { return make_topk_routing(5, 3, 2, 5); }},
      {"dropped slots (-1)", 3, 2, 4, 0, [] { return topk_routing(4, 3, 2, {0, -1, -1, 2, 1, 0, -1, -1}, 6); }},
      {"T = 0", 3, 2, 0, 16, [] { return make_topk_routing(0, 3, 2, 7); }},
  };
  for (const Edge& ed : edges) {
    for (ProbsPlacement pl : {ProbsPlacement::kInActivation, ProbsPlacement::kAtCombine}) {
      SCOPED_TRACE(std::string(ed.name) + (pl == ProbsPlacement::kInActivation ? " probs-in-act" : " at-combine"));
      GroupedMlpConfig c = make_config(Activation::kSwiGLU, true, pl, ed.E, ed.k, ed.T);
      c.dispatch.align = ed.align;
      check_all_gradients(c, make_problem(c, ed.routing(), 9), 11);
    }
  }
}

TEST(GroupedMlpRef, MapFormFiniteDifferencesAndEqualsTopK) {
  for (ProbsPlacement pl : {ProbsPlacement::kInActivation, ProbsPlacement::kAtCombine}) {
    GroupedMlpConfig c = make_config(Activation::kGeGLU, true, pl, 4, 3, 6);
    c.routing_form = RoutingForm::kMap;
    c.dispatch.row_bound = 6 * 4;
    check_all_gradients(c, make_problem(c, make_map_routing(6, 4, 3, 21), 4), 8);
  }
  // The map form of a top-k routing gives the same y, dx and gradients; dprobs lands in [T, E].
  GroupedMlpConfig ck = make_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation, 4, 2, 6);
  GroupedMlpConfig cm = ck;
  cm.routing_form = RoutingForm::kMap;
  cm.dispatch.row_bound = 6 * 2;
  Problem pk = make_problem(ck, make_topk_routing(6, 4, 2, 30), 2);
  Problem pm = pk;
  pm.routing = topk_to_map(pk.routing);
  Logical w = random_weights(ck, 3);
  Result rk = run(ck, pk, w, false, nullptr), rm = run(cm, pm, w, false, nullptr);
  EXPECT_TRUE(same_bits(rk.y, rm.y));
  EXPECT_TRUE(same_bits(rk.dx, rm.dx));
  EXPECT_TRUE(same_bits(rk.grads.w1, rm.grads.w1));
  EXPECT_TRUE(same_bits(rk.grads.b2, rm.grads.b2));
  for (int64_t t = 0; t < 6; ++t)
    for (int s = 0; s < 2; ++s)
      EXPECT_EQ(rk.dprobs[t * 2 + s], rm.dprobs[t * 4 + pk.routing.indices[t * 2 + s]]);
}

TEST(GroupedMlpRef, TokensRoutedNowhereAndZeroTokens) {
  GroupedMlpConfig c = make_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation, 3, 2, 3);
  Problem P = make_problem(c, topk_routing(3, 3, 2, {0, 1, -1, -1, 2, 0}, 1), 2);
  Result r = run(c, P, random_weights(c, 4), false, nullptr);
  for (int64_t h = 0; h < c.hidden; ++h) {
    EXPECT_EQ(r.y[1 * c.hidden + h], 0.0);  // token 1 goes nowhere: zero output and zero dx
    EXPECT_EQ(r.dx[1 * c.hidden + h], 0.0);
  }
  EXPECT_EQ(r.dprobs[2], 0.0);
  EXPECT_EQ(r.dprobs[3], 0.0);
  // T = 0: written gradients are zeros, the hooks still fire once each.
  GroupedMlpConfig c0 = make_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation, 3, 2, 0);
  Result r0 = run(c0, make_problem(c0, make_topk_routing(0, 3, 2, 1), 1), random_weights(c0, 4), false, nullptr);
  EXPECT_TRUE(r0.y.empty());
  EXPECT_EQ(abs_sum(r0.grads.w1) + abs_sum(r0.grads.b1) + abs_sum(r0.grads.w2) + abs_sum(r0.grads.b2), 0.0);
  EXPECT_EQ(r0.hooks.size(), 4u);
}

// GLU interleave is only a storage layout: same logical weights, bitwise-identical results (dx up
// to the order of its sum over the fc1 columns).
TEST(GroupedMlpRef, InterleaveIsOnlyALayout) {
  for (Activation act : {Activation::kSwiGLU, Activation::kGeGLU, Activation::kClampedSwiGLU}) {
    for (ProbsPlacement pl : {ProbsPlacement::kInActivation, ProbsPlacement::kAtCombine}) {
      SCOPED_TRACE(activation_name(act));
      GroupedMlpConfig plain = make_config(act, true, pl, 3, 2, 6, 8, 32);
      Problem P = make_problem(plain, make_topk_routing(6, 3, 2, 8), 5);
      Logical w = random_weights(plain, 6);
      Result ref = run(plain, P, w, false, nullptr);
      for (int s : {8, 16}) {
        GroupedMlpConfig il = plain;
        il.activation.glu_interleave = s;
        // The physical storage really differs (the check below is not comparing identical arrays).
        Stored a = store(w, plain, false), b = store(w, il, false);
        EXPECT_NE(a.blocks[0], b.blocks[0]);
        Result r = run(il, P, w, false, nullptr);
        EXPECT_TRUE(same_bits(r.y, ref.y)) << "s=" << s;
        // dx = dh W1 sums over the fc1 columns in their physical order, which the interleave
        // permutes: equal up to fp64 reordering, |diff| <= 2F * 2^-53 * sum|terms| << 1e-12.
        ASSERT_EQ(r.dx.size(), ref.dx.size());
        for (size_t i = 0; i < r.dx.size(); ++i) EXPECT_NEAR(r.dx[i], ref.dx[i], 1e-12 * (1.0 + std::fabs(ref.dx[i])));
        EXPECT_TRUE(same_bits(r.dprobs, ref.dprobs));
        EXPECT_TRUE(same_bits(r.grads.w1, ref.grads.w1));
        EXPECT_TRUE(same_bits(r.grads.b1, ref.grads.b1));
        EXPECT_TRUE(same_bits(r.grads.w2, ref.grads.w2));
        EXPECT_TRUE(same_bits(r.grads.b2, ref.grads.b2));
      }
    }
  }
}

// Single-grouped and per-expert pointer tables: bitwise-identical outputs and gradients.
TEST(GroupedMlpRef, SingleGroupedEqualsPerExpert) {
  for (WgradMode mode : {WgradMode::kWrite, WgradMode::kAccumulate}) {
    GroupedMlpConfig c = make_config(Activation::kClampedSwiGLU, true, ProbsPlacement::kInActivation, 4, 2, 7);
    c.wgrad = mode;
    c.dispatch.align = 16;
    Problem P = make_problem(c, make_topk_routing(7, 4, 2, 12), 13);
    Logical w = random_weights(c, 14), g0 = random_weights(c, 15);
    Result a = run(c, P, w, false, &g0), b = run(c, P, w, true, &g0);
    EXPECT_TRUE(same_bits(a.y, b.y));
    EXPECT_TRUE(same_bits(a.dx, b.dx));
    EXPECT_TRUE(same_bits(a.dprobs, b.dprobs));
    EXPECT_TRUE(same_bits(a.grads.w1, b.grads.w1));
    EXPECT_TRUE(same_bits(a.grads.b1, b.grads.b1));
    EXPECT_TRUE(same_bits(a.grads.w2, b.grads.w2));
    EXPECT_TRUE(same_bits(a.grads.b2, b.grads.b2));
  }
}

// main_grad += dW: exactly the written gradient added to the old value; experts without rows untouched.
TEST(GroupedMlpRef, AccumulateIntoMainGrad) {
  for (bool delay : {false, true}) {
    GroupedMlpConfig c = make_config(Activation::kSwiGLU, true, ProbsPlacement::kAtCombine, 4, 2, 4);
    c.delay_wgrad = delay;
    Problem P = make_problem(c, topk_routing(4, 4, 2, {0, 2, 2, 0, 0, 2, 2, 0}, 1), 2);  // experts 1, 3 empty
    Logical w = random_weights(c, 3), main = random_weights(c, 4);
    Result written = run(c, P, w, false, nullptr);
    c.wgrad = WgradMode::kAccumulate;
    Result acc = run(c, P, w, false, &main);
    auto expect_sum = [](const std::vector<double>& got, const std::vector<double>& m, const std::vector<double>& d,
                         int64_t per, std::vector<int> empty) {
      for (size_t i = 0; i < got.size(); ++i) {
        const int e = static_cast<int>(i / per);
        const bool untouched = e == empty[0] || e == empty[1];
        const double want = untouched ? m[i] : m[i] + d[i];
        EXPECT_EQ(got[i], want) << i;
      }
    };
    expect_sum(acc.grads.w1, main.w1, written.grads.w1, c.fc1_out() * c.hidden, {1, 3});
    expect_sum(acc.grads.b1, main.b1, written.grads.b1, c.fc1_out(), {1, 3});
    expect_sum(acc.grads.w2, main.w2, written.grads.w2, c.hidden * c.ffn, {1, 3});
    expect_sum(acc.grads.b2, main.b2, written.grads.b2, c.hidden, {1, 3});
    // Written mode zeroes the empty experts.
    for (int64_t i = 0; i < c.hidden; ++i) EXPECT_EQ(written.grads.b2[1 * c.hidden + i], 0.0);
  }
}

// Delayed wgrad: backward gives dx and dprobs only; backward_dw gives the same gradients as the
// non-delayed backward, fc2's before fc1's, each parameter's hooks once, when that gradient is final.
TEST(GroupedMlpRef, DelayedWgradAndHooks) {
  for (bool bias : {true, false}) {
    SCOPED_TRACE(bias ? "bias" : "no bias");
    GroupedMlpConfig c = make_config(Activation::kGeGLU, bias, ProbsPlacement::kInActivation, 3, 2, 6);
    Problem P = make_problem(c, make_topk_routing(6, 3, 2, 40), 41);
    Logical w = random_weights(c, 42);
    Result eager = run(c, P, w, false, nullptr);
    const std::vector<Param> order = bias ? std::vector<Param>{Param::kFc2Weight, Param::kFc2Bias, Param::kFc1Weight,
                                                               Param::kFc1Bias}
                                          : std::vector<Param>{Param::kFc2Weight, Param::kFc1Weight};
    EXPECT_EQ(eager.hooks, order);

    c.delay_wgrad = true;
    GroupedMlpRef layer(c);
    Stored ws = store(w, c, false);
    Stored gs = store(filled(c, std::nan("")), c, false);
    layer.set_weights(ws.params);
    layer.set_grads(gs.params);
    std::vector<Param> fired;
    // At each hook, that parameter's gradient is final (equals the eager one); fc1's are not yet
    // computed when fc2's hooks run.
    auto hook = [&](Param p) {
      fired.push_back(p);
      Logical now = load(gs, c);
      if (p == Param::kFc2Weight) {
        EXPECT_TRUE(same_bits(now.w2, eager.grads.w2));
        EXPECT_TRUE(std::isnan(now.w1[0])) << "fc1.weight computed before fc2's hooks";
      }
      if (p == Param::kFc2Bias) EXPECT_TRUE(same_bits(now.b2, eager.grads.b2));
      if (p == Param::kFc1Weight) EXPECT_TRUE(same_bits(now.w1, eager.grads.w1));
      if (p == Param::kFc1Bias) EXPECT_TRUE(same_bits(now.b1, eager.grads.b1));
    };
    for (Param p : {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias}) layer.register_hook(p, hook);
    std::vector<double> y(6 * c.hidden), dx(6 * c.hidden), dp(6 * 2);
    layer.forward(P.routing, P.x.data(), y.data());
    layer.backward(P.dy.data(), dx.data(), dp.data());
    EXPECT_TRUE(fired.empty());
    EXPECT_TRUE(same_bits(dx, eager.dx));
    EXPECT_TRUE(same_bits(dp, eager.dprobs));
    Logical before = load(gs, c);
    EXPECT_TRUE(std::isnan(before.w1[0]) && std::isnan(before.w2[0])) << "gradients written before backward_dw";
    // The saved activations are still needed: a new forward or backward must wait.
    expect_error_naming([&] { layer.forward(P.routing, P.x.data(), y.data()); }, "backward_dw");
    expect_error_naming([&] { layer.backward(P.dy.data(), dx.data(), dp.data()); }, "backward_dw");
    layer.backward_dw();
    EXPECT_EQ(fired, order);
    Logical after = load(gs, c);
    EXPECT_TRUE(same_bits(after.w1, eager.grads.w1));
    EXPECT_TRUE(same_bits(after.w2, eager.grads.w2));
    EXPECT_TRUE(same_bits(after.b1, eager.grads.b1));
    EXPECT_TRUE(same_bits(after.b2, eager.grads.b2));
    expect_error_naming([&] { layer.backward_dw(); }, "backward_dw");  // nothing pending
  }
  GroupedMlpConfig c = make_config(Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 3, 2, 6);
  GroupedMlpRef layer(c);
  expect_error_naming([&] { layer.backward_dw(); }, "delay_wgrad");
}

// emulate_bf16: every stored intermediate and output is bf16-representable, close to the fp64 result.
TEST(GroupedMlpRef, EmulateBf16RoundsWhatTheGpuStores) {
  GroupedMlpConfig c = make_config(Activation::kSwiGLU, true, ProbsPlacement::kInActivation, 3, 2, 6);
  c.wgrad_dtype = DType::kBF16;
  Problem P = make_problem(c, make_topk_routing(6, 3, 2, 50), 51);
  for (auto& v : P.x) v = round_to_bf16(static_cast<float>(v));
  for (auto& v : P.dy) v = round_to_bf16(static_cast<float>(v));
  Logical w = random_weights(c, 52);
  for (auto* p : {&w.w1, &w.b1, &w.w2, &w.b2})
    for (auto& v : *p) v = round_to_bf16(static_cast<float>(v));
  Result exact = run(c, P, w, false, nullptr), emu = run(c, P, w, false, nullptr, true);
  auto is_bf16 = [](const std::vector<double>& v) {
    for (double x : v)
      if (x != static_cast<double>(round_to_bf16(static_cast<float>(x)))) return false;
    return true;
  };
  EXPECT_TRUE(is_bf16(emu.y));
  EXPECT_TRUE(is_bf16(emu.dx));
  EXPECT_TRUE(is_bf16(emu.grads.w1));  // written as bf16 (config.wgrad_dtype)
  EXPECT_TRUE(is_bf16(emu.grads.b2));
  EXPECT_FALSE(is_bf16(exact.y));  // the fp64 reference is not rounded
  GroupedMlpRef layer(c, true);
  Stored ws = store(w, c, false);
  layer.set_weights(ws.params);
  std::vector<double> y(P.x.size());
  layer.forward(P.routing, P.x.data(), y.data());
  EXPECT_TRUE(is_bf16(layer.fc1_out()));
  EXPECT_TRUE(is_bf16(layer.act()));
  EXPECT_TRUE(is_bf16(layer.fc2_out()));
  // A handful of bf16 roundings (2^-9 relative each) through two products: within 5% of fp64.
  for (size_t i = 0; i < y.size(); ++i) EXPECT_NEAR(emu.y[i], exact.y[i], 0.05 * (std::fabs(exact.y[i]) + 0.05));
  for (size_t i = 0; i < emu.dx.size(); ++i)
    EXPECT_NEAR(emu.dx[i], exact.dx[i], 0.05 * (std::fabs(exact.dx[i]) + 0.05));
}

// Quantized operands: checked against products written here from the quantize reference (fc1's
// output, fc2's weight gradient with columnwise copies built as the rowwise quantization of the
// transpose), both layouts bitwise equal, and a change of the size that NVFP4's rounding makes.
namespace quantized {

// v [rows, cols] through c's rowwise copy, or its columnwise copy (= the rowwise quantization of
// v^T), dequantized, in v's orientation.
std::vector<double> fake(const QuantConfig& c, const std::vector<double>& v, int64_t rows, int64_t cols,
                         bool columnwise) {
  QuantConfig r = c;
  r.rowwise = true;
  r.columnwise = false;
  std::vector<float> x(v.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j)
      x[columnwise ? j * rows + i : i * cols + j] = static_cast<float>(v[i * cols + j]);
  const int64_t m = columnwise ? cols : rows, k = columnwise ? rows : cols;
  const std::vector<float> d = dequantize(r, quantize_fp32(r, x, 1, m, k), false, 1, m, k);
  std::vector<double> out(v.size());
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) out[i * cols + j] = d[columnwise ? j * rows + i : i * cols + j];
  return out;
}

// A token operand v [R, cols]: each expert's rows through `fake` as a matrix of their own (NVFP4:
// its own global amax; columnwise blocks from the expert's first row); rows of no expert 0.
std::vector<double> fake_per_expert(const QuantConfig& c, const std::vector<double>& v, const DispatchPlan& plan,
                                    int64_t cols, bool columnwise) {
  std::vector<double> out(v.size(), 0.0);
  for (size_t e = 0; e < plan.offset.size(); ++e) {
    const int64_t r0 = plan.offset[e], n = plan.rows_in_bound(static_cast<int>(e));
    if (n == 0) continue;
    const std::vector<double> slice(v.begin() + r0 * cols, v.begin() + (r0 + n) * cols);
    const std::vector<double> q = fake(c, slice, n, cols, columnwise);
    std::copy(q.begin(), q.end(), out.begin() + r0 * cols);
  }
  return out;
}

double rel(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
  return std::sqrt(num / den);
}

}  // namespace quantized

TEST(GroupedMlpRef, QuantizedOperandsFollowTheRecipe) {
  GroupedMlpConfig c = make_config(Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 4, 2, 40, 32, 32);
  c.dispatch.align = 16;
  c.dispatch.row_bound = 144;  // NVFP4 columnwise copies: rows in multiples of 16
  OperandQuant q;
  q.tokens.format = QuantFormat::kNVFP4;
  q.weights.format = QuantFormat::kNVFP4;
  q.weights.blocking = QuantBlocking::k2D;
  Problem P = make_problem(c, make_topk_routing(40, 4, 2, 21), 22);
  const Logical w = random_weights(c, 23);
  const int64_t H = c.hidden, F = c.ffn, F1 = c.fc1_out(), E = c.experts;

  GroupedMlpRef layer(c);
  layer.set_operand_quant(q);
  Stored ws = store(w, c, false);
  Logical g0 = filled(c, 0.0);
  Stored gs = store(g0, c, false);
  layer.set_weights(ws.params);
  layer.set_grads(gs.params);
  std::vector<double> y(40 * H), dx(40 * H), dprobs(40 * 2);
  layer.forward(P.routing, P.x.data(), y.data());
  layer.backward(P.dy.data(), dx.data(), dprobs.data());
  const Logical grads = load(gs, c);

  // fc1's output: Q(x_perm) Q(W1_e)^T over each expert's rows.
  const DispatchPlan& plan = layer.plan();
  const int64_t R = plan.R;
  const std::vector<double> xq = quantized::fake_per_expert(q.tokens, layer.x_perm(), plan, H, false);
  double worst = 0;
  for (int e = 0; e < E; ++e) {
    const std::vector<double> w1(ws.params.fc1_weight[e], ws.params.fc1_weight[e] + F1 * H);
    const std::vector<double> w1q = quantized::fake(q.weights, w1, F1, H, false);
    for (int64_t r = plan.offset[e]; r < plan.offset[e] + plan.rows_in_bound(e); ++r)
      for (int64_t n = 0; n < F1; ++n) {
        double s = 0;
        for (int64_t k = 0; k < H; ++k) s += xq[r * H + k] * w1q[n * H + k];
        worst = std::max(worst, std::fabs(s - layer.fc1_out()[r * F1 + n]));
      }
  }
  EXPECT_LT(worst, 1e-12);

  // fc2's weight gradient from the columnwise copies of dY (dy's rows, probs in the activation)
  // and act, blocks of 16 rows from each expert's first row.
  std::vector<double> dY(R * H, 0.0);
  for (int64_t r = 0; r < R; ++r)
    if (plan.row_token[r] >= 0)
      for (int64_t j = 0; j < H; ++j) dY[r * H + j] = P.dy[plan.row_token[r] * H + j];
  const std::vector<double> dYc = quantized::fake_per_expert(q.tokens, dY, plan, H, true);
  const std::vector<double> actc = quantized::fake_per_expert(q.tokens, layer.act(), plan, F, true);
  worst = 0;
  for (int e = 0; e < E; ++e)
    for (int64_t n = 0; n < H; ++n)
      for (int64_t k = 0; k < F; ++k) {
        double s = 0;
        for (int64_t r = plan.offset[e]; r < plan.offset[e] + plan.rows_in_bound(e); ++r)
          s += dYc[r * H + n] * actc[r * F + k];
        worst = std::max(worst, std::fabs(s - grads.w2[(e * H + n) * F + k]));
      }
  EXPECT_LT(worst, 1e-12);

  // Both layouts give the same bits; the quantization moves every result by what NVFP4 rounding
  // (2-3 significant bits) costs: several percent, far from zero and from O(1).
  const Result a = run(c, P, w, false, &g0, false, &q), b = run(c, P, w, true, &g0, false, &q);
  EXPECT_TRUE(same_bits(a.y, b.y) && same_bits(a.dx, b.dx) && same_bits(a.dprobs, b.dprobs));
  EXPECT_TRUE(same_bits(a.grads.w1, b.grads.w1) && same_bits(a.grads.w2, b.grads.w2));
  const Result plain = run(c, P, w, false, &g0);
  for (const auto& [name, got, want] :
       {std::tuple<const char*, const std::vector<double>*, const std::vector<double>*>{"y", &a.y, &plain.y},
        {"dx", &a.dx, &plain.dx}, {"dprobs", &a.dprobs, &plain.dprobs}, {"dW1", &a.grads.w1, &plain.grads.w1},
        {"dW2", &a.grads.w2, &plain.grads.w2}}) {
    const double err = quantized::rel(*got, *want);
    EXPECT_GT(err, 0.01) << name;
    EXPECT_LT(err, 0.5) << name;
  }
  OperandQuant bad = q;
  bad.tokens.blocking = QuantBlocking::k2D;
  expect_error_naming([&] { layer.set_operand_quant(bad); }, "quant.tokens");
}

TEST(GroupedMlpRef, BadArgumentsNameTheArgument) {
  GroupedMlpConfig c = make_config(Activation::kSwiGLU, false, ProbsPlacement::kInActivation, 3, 2, 4);
  GroupedMlpRef layer(c);
  Logical w = random_weights(c, 1);
  Stored ws = store(w, c, false);
  ExpertParams short_table = ws.params;
  short_table.fc1_weight.pop_back();
  expect_error_naming([&] { layer.set_weights(short_table); }, "fc1.weight");
  ExpertParams with_bias = ws.params;
  with_bias.fc2_bias = with_bias.fc2_weight;
  expect_error_naming([&] { layer.set_weights(with_bias); }, "bias");
  ExpertParams null_ptr = ws.params;
  null_ptr.fc2_weight[1] = nullptr;
  expect_error_naming([&] { layer.set_grads(null_ptr); }, "fc2.weight");
  std::vector<double> x(4 * 8), y(4 * 8), dp(8);
  expect_error_naming([&] { layer.forward(make_topk_routing(4, 3, 2, 1), x.data(), y.data()); }, "set_weights");
  layer.set_weights(ws.params);
  expect_error_naming([&] { layer.forward(make_topk_routing(4, 4, 2, 1), x.data(), y.data()); }, "routing.E");
  expect_error_naming([&] { layer.forward(make_topk_routing(4, 3, 1, 1), x.data(), y.data()); }, "routing.k");
  expect_error_naming([&] { layer.forward(make_topk_routing(5, 3, 2, 1), x.data(), y.data()); }, "routing.T");
  expect_error_naming([&] { layer.backward(y.data(), x.data(), dp.data()); }, "forward");
  GroupedMlpConfig bad = c;
  bad.hidden = 12;
  expect_error_naming([&] { GroupedMlpRef l(bad); }, "hidden");
  bad = c;
  bad.transposed_weights = true;  // the reference takes the standard orientation only
  expect_error_naming([&] { GroupedMlpRef l(bad); }, "transposed_weights");
  expect_error_naming([&] { ExpertWeightsSpec::from_config(bad); }, "transposed_weights");
}

}  // namespace
}  // namespace moe::ref
