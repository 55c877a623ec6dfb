// CPU reference of the fused router: hand-computed cases of every variant, ties, non-finite input,
// odd E, k = 1 and k = E, capacity and token rounding, the losses, the bias update, and
// finite-difference checks of d logits (routing decisions held fixed).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <vector>

#include "moe/device_errors.h"
#include "moe/router_config.h"
#include "reference/router_ref.h"
#include "support/expect_error.h"

namespace moe {
namespace {

using ref::router_forward;
using V = std::vector<double>;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

RouterConfig base(int E, int k) {
  RouterConfig c;
  c.num_experts = E;
  c.topk = k;
  c.max_tokens = 1 << 16;
  return c;
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

TEST(RouterRef, SoftmaxBeforeTopkHandComputed) {
  RouterConfig c = base(4, 2);
  const V z = {1, 2, 3, 0};
  const double Z = std::exp(1) + std::exp(2) + std::exp(3) + std::exp(0);
  auto r = router_forward(c, z, 1, nullptr);
  EXPECT_EQ(r.indices, (std::vector<int32_t>{2, 1}));
  EXPECT_NEAR(r.probs[0], std::exp(3) / Z, 1e-15);
  EXPECT_NEAR(r.probs[1], std::exp(2) / Z, 1e-15);
  // Renormalised (Mixtral / Qwen3 norm_topk_prob): e^3 / (e^3 + e^2), and the same from the softmax
  // over the chosen logits (GPT-OSS): the two variants agree on the math.
  c.normalize_topk = true;
  c.scaling_factor = 2.0f;
  r = router_forward(c, z, 1, nullptr);
  EXPECT_NEAR(r.probs[0], 2.0 / (1.0 + std::exp(-1.0)), 1e-15);
  EXPECT_NEAR(r.probs[1], 2.0 / (1.0 + std::exp(1.0)), 1e-15);
  RouterConfig after = base(4, 2);
  after.softmax_after_topk = true;
  after.scaling_factor = 2.0f;
  auto ra = router_forward(after, z, 1, nullptr);
  EXPECT_EQ(ra.indices, r.indices);
  EXPECT_NEAR(ra.probs[0], r.probs[0], 1e-15);
  EXPECT_NEAR(ra.probs[1], r.probs[1], 1e-15);
  EXPECT_EQ(r.selection_counts, (std::vector<int64_t>{0, 1, 1, 0}));
  EXPECT_EQ(r.counts, r.selection_counts);
}

TEST(RouterRef, MapFormHoldsTheSameRouting) {
  RouterConfig c = base(5, 2);
  c.output_form = RoutingForm::kMap;
  const V z = {0.5, -1, 2, 2.5, 0};
  auto r = router_forward(c, z, 1, nullptr);
  EXPECT_EQ(r.map, (std::vector<uint8_t>{0, 0, 1, 1, 0}));
  double Z = 0;
  for (double v : z) Z += std::exp(v);
  EXPECT_NEAR(r.probs[3], std::exp(2.5) / Z, 1e-15);
  EXPECT_NEAR(r.probs[2], std::exp(2.0) / Z, 1e-15);
  EXPECT_EQ(r.probs[0], 0.0);
  EXPECT_EQ(r.selected, (std::vector<int32_t>{3, 2}));
}

TEST(RouterRef, DeepSeekV3GroupLimitedSigmoidWithBias) {
  // E = 8 in 4 groups of 2; keep 2 groups by the sum of their top-2 biased scores; k = 2.
  RouterConfig c = base(8, 2);
  c.score = ScoreFunction::kSigmoid;
  c.normalize_topk = true;
  c.expert_bias = true;
  c.num_groups = 4;
  c.topk_groups = 2;
  c.scaling_factor = 2.5f;
  const V z = {3.0, -3.0, 1.0, 1.0, 0.0, 0.5, -1.0, 2.0};
  const V b = {0.0, 0.0, 0.0, 0.0, 0.6, 0.6, 0.0, 0.0};
  // Biased scores and group sums (top-2 of 2 = both):
  V v(8);
  for (int e = 0; e < 8; ++e) v[e] = sigmoid(z[e]) + b[e];
  const double g0 = v[0] + v[1], g1 = v[2] + v[3], g2 = v[4] + v[5], g3 = v[6] + v[7];
  // g2 = s(0) + s(.5) + 1.2 = 2.32 is the best, g1 = 2 s(1) = 1.46 second; g0 = 1, g3 = 1.15.
  ASSERT_GT(g2, g1);
  ASSERT_GT(g1, g3);
  ASSERT_GT(g3, g0);
  auto r = router_forward(c, z, 1, &b);
  // Inside groups 1 and 2: v = {s(1), s(1), s(0)+.6, s(.5)+.6} = {.731, .731, 1.1, 1.222}: experts 5, 4.
  // Expert 0 (the largest logit) is in a dropped group, expert 7 too.
  EXPECT_EQ(r.indices, (std::vector<int32_t>{5, 4}));
  const double S = sigmoid(0.5) + sigmoid(0.0);  // probs come from the unbiased scores
  EXPECT_NEAR(r.probs[0], 2.5 * sigmoid(0.5) / S, 1e-15);
  EXPECT_NEAR(r.probs[1], 2.5 * sigmoid(0.0) / S, 1e-15);
}

TEST(RouterRef, TiesBreakTowardTheLowerExpertId) {
  RouterConfig c = base(6, 3);
  auto r = router_forward(c, V(6, 0.25), 1, nullptr);
  EXPECT_EQ(r.indices, (std::vector<int32_t>{0, 1, 2}));
  for (double p : r.probs) EXPECT_NEAR(p, 1.0 / 6.0, 1e-15);
  // A tie at the boundary: experts 1 and 4 equal and second best.
  r = router_forward(base(6, 2), {0, 1, 0, 2, 1, 0}, 1, nullptr);
  EXPECT_EQ(r.indices, (std::vector<int32_t>{3, 1}));
  // Bias creating a tie between two different logits: the lower id wins.
  RouterConfig cb = base(4, 1);
  cb.score = ScoreFunction::kSigmoid;
  cb.expert_bias = true;
  const V b = {0, 0, 0, 0};
  r = router_forward(cb, {1, 1, 1, 1}, 1, &b);
  EXPECT_EQ(r.indices, (std::vector<int32_t>{0}));
}

// Scores equal in floating point but logits apart: without a bias the larger logit wins, as on the
// device (which compares the logits); with a bias the biased score decides, ties to the lower id.
TEST(RouterRef, WithoutABiasTheLogitDecidesWhereTheScoreSaturates) {
  RouterConfig cs = base(8, 1);
  cs.score = ScoreFunction::kSigmoid;
  V z = {38, 40, 0, 0, 0, 0, 0, 0};  // sigmoid(38) == sigmoid(40) == 1 in fp64
  auto r = router_forward(cs, z, 1, nullptr);
  EXPECT_EQ(r.indices, (std::vector<int32_t>{1}));
  cs.expert_bias = true;
  const V b(8, 0.0);
  r = router_forward(cs, z, 1, &b);
  EXPECT_EQ(r.indices, (std::vector<int32_t>{0}));
  // Softmax scores that underflow to 0 in fp64: experts 1 and 2 are ordered by their logits.
  RouterConfig cm = base(8, 2);
  r = router_forward(cm, {0, -1000, -900, -2000, -2000, -2000, -2000, -2000}, 1, nullptr);
  EXPECT_EQ(r.indices, (std::vector<int32_t>{0, 2}));
}

TEST(RouterRef, NonFiniteRowsAreRoutedNowhereAndFlagged) {
  RouterConfig c = base(4, 2);
  c.aux_loss_coeff = 0.1f;
  c.z_loss_coeff = 0.01f;
  const V z = {0, 1, 2, 3, kNaN, 0, 0, 0, 1, kInf, 0, 0, 0, 0, -kInf, 1};
  auto r = router_forward(c, z, 4, nullptr);
  EXPECT_EQ(r.error_bits, kErrNonFiniteLogit);
  EXPECT_EQ(r.indices, (std::vector<int32_t>{3, 2, -1, -1, -1, -1, -1, -1}));
  for (int i = 2; i < 8; ++i) EXPECT_EQ(r.probs[i], 0.0);
  EXPECT_EQ(r.selection_counts, (std::vector<int64_t>{0, 0, 1, 1}));
  EXPECT_TRUE(std::isfinite(r.aux_loss) && std::isfinite(r.z_loss));
  auto dz = ref::router_backward(c, z, 4, r, V(8, 1.0), 1.0, 0.0, 1.0);
  for (int i = 4; i < 16; ++i) EXPECT_EQ(dz[i], 0.0);
  // A non-finite bias poisons every row.
  RouterConfig cb = base(4, 1);
  cb.expert_bias = true;
  const V b = {0, kNaN, 0, 0};
  r = router_forward(cb, {0, 1, 2, 3}, 1, &b);
  EXPECT_EQ(r.error_bits, kErrNonFiniteLogit);
  EXPECT_EQ(r.indices[0], -1);
}

TEST(RouterRef, OddExpertCountsAndExtremeK) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> n;
  for (int E : {1, 7, 13, 100}) {
    V z(5 * E);
    for (auto& v : z) v = n(rng);
    for (int k : {1, std::min(E, 16)}) {
      RouterConfig c = base(E, k);
      c.normalize_topk = true;
      auto r = router_forward(c, z, 5, nullptr);
      for (int64_t t = 0; t < 5; ++t) {
        double sum = 0;
        for (int s = 0; s < k; ++s) {
          const int e = r.indices[t * k + s];
          ASSERT_GE(e, 0);
          sum += r.probs[t * k + s];
          for (int e2 = 0; e2 < E; ++e2) {  // every unchosen expert is no better than slot s
            bool chosen = false;
            for (int s2 = 0; s2 < k; ++s2) chosen = chosen || r.indices[t * k + s2] == e2;
            if (!chosen) EXPECT_LE(z[t * E + e2], z[t * E + e]);
          }
          if (s > 0) EXPECT_GE(r.probs[t * k + s - 1], r.probs[t * k + s]);
        }
        EXPECT_NEAR(sum, 1.0, 1e-14);
      }
    }
  }
}

// Capacity: T = 4, E = 2, k = 1, factor 1 -> capacity ceil(4 * 1 / 2) = 2.
TEST(RouterRef, CapacityDropsByProbOrPosition) {
  RouterConfig c = base(2, 1);
  c.capacity_factor = 1.0;
  // Every token prefers expert 0, with softmax probs s(z0 - z1) growing with the gap.
  const V z = {1, 0, 3, 0, 2, 0, 0.5, 0};
  EXPECT_EQ(router_capacity(c, 4), 2);
  auto r = router_forward(c, z, 4, nullptr);  // by prob: tokens 1 and 2 keep expert 0
  EXPECT_EQ(r.indices, (std::vector<int32_t>{-1, 0, 0, -1}));
  EXPECT_EQ(r.probs[0], 0.0);
  EXPECT_NEAR(r.probs[1], sigmoid(3.0), 1e-15);
  EXPECT_EQ(r.selection_counts, (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(r.counts, (std::vector<int64_t>{2, 0}));
  c.drop_policy = CapacityDropPolicy::kPosition;
  r = router_forward(c, z, 4, nullptr);  // first two tokens
  EXPECT_EQ(r.indices, (std::vector<int32_t>{0, 0, -1, -1}));
  // Equal probs: the lower token id is kept.
  c.drop_policy = CapacityDropPolicy::kProb;
  r = router_forward(c, V{1, 0, 1, 0, 1, 0, 1, 0}, 4, nullptr);
  EXPECT_EQ(r.indices, (std::vector<int32_t>{0, 0, -1, -1}));
  // Megatron's capacity: ceil(T * k / E * factor).
  c.capacity_factor = 1.3;
  EXPECT_EQ(router_capacity(c, 10), 7);  // 10 * 1 / 2 * 1.3 = 6.5
}

// Token rounding with a tile of 2, E = 3, k = 1, T = 6; expert 0 chosen by 3 tokens, expert 1 by
// 2, expert 2 by 1.
TEST(RouterRef, TokenRoundingDownUpNearest) {
  const V z = {
      3, 1, 0,    // t0 -> 0 (then 1)
      2, 0, 1.5,  // t1 -> 0 (then 2)
      5, 0, 0,    // t2 -> 0
      0, 2, 1,    // t3 -> 1 (then 2)
      0, 3, 0,    // t4 -> 1
      0, 0.5, 4,  // t5 -> 2 (then 1)
  };
  RouterConfig c = base(3, 1);
  c.rounding = TokenRounding::kDown;
  c.rounding_tile = 2;
  auto r = router_forward(c, z, 6, nullptr);
  // Down: expert 0 keeps its 2 best (t2: s = .99, t0: .84; t1 .55 dropped), 1 keeps 2, 2 drops t5.
  EXPECT_EQ(r.indices, (std::vector<int32_t>{0, -1, 0, 1, 1, -1}));
  EXPECT_EQ(r.counts, (std::vector<int64_t>{2, 2, 0}));
  c.output_form = RoutingForm::kMap;
  c.rounding = TokenRounding::kUp;
  c.rounding_candidates = 1;
  r = router_forward(c, z, 6, nullptr);
  // Up: expert 0 -> 4 adds its one candidate, t4 (second choice 0, tied with 2 at logit 0: the
  // lower id). Expert 1 stays at 2. Expert 2 -> 2: candidates t1 (score e^1.5 / (e^2 + 1 + e^1.5)
  // = .348) and t3 (e / (1 + e^2 + e) = .245): t1 is added.
  EXPECT_EQ(r.counts, (std::vector<int64_t>{4, 2, 2}));
  EXPECT_EQ(r.map[4 * 3 + 0], 1);
  EXPECT_EQ(r.map[1 * 3 + 2], 1);
  EXPECT_EQ(r.map[3 * 3 + 2], 0);
  double Z1 = std::exp(2) + std::exp(0) + std::exp(1.5);
  EXPECT_NEAR(r.probs[1 * 3 + 2], std::exp(1.5) / Z1, 1e-15);  // an added slot gets its score
  EXPECT_EQ(r.selected[1 * 2 + 1], 2);
  c.rounding = TokenRounding::kNearest;
  r = router_forward(c, z, 6, nullptr);
  // Nearest: 3 -> 4 (1.5 tiles, half to even = 2 tiles: t4 added), 2 -> 2, 1 -> 0 (half a tile
  // rounds to even = 0 tiles): expert 2 drops t5.
  EXPECT_EQ(r.counts, (std::vector<int64_t>{4, 2, 0}));
  EXPECT_EQ(r.map[5 * 3 + 2], 0);
  EXPECT_EQ(router_rounded_count(c, 3, 6), 4);
  EXPECT_EQ(router_rounded_count(c, 1, 6), 0);
  EXPECT_EQ(router_rounded_count(c, 5, 6), 4);  // 2.5 tiles: half to even -> 2 tiles
  EXPECT_EQ(router_rounded_count(c, 7, 7), 7);  // 3.5 -> 4 tiles = 8, capped at T
}

TEST(RouterRef, LossesHandComputed) {
  // T = 2, E = 2, k = 1.
  RouterConfig c = base(2, 1);
  c.aux_loss_coeff = 0.5f;
  c.z_loss_coeff = 0.25f;
  c.seq_aux_loss_coeff = 2.0f;
  c.seq_length = 1;
  const V z = {1, 0, 0, 2};
  auto r = router_forward(c, z, 2, nullptr);
  const double p0 = sigmoid(1.0), p1 = sigmoid(2.0);  // softmax of two logits
  // f = counts / (T k) = {.5, .5}; P = mean softmax = {(p0 + 1 - p1) / 2, (1 - p0 + p1) / 2}.
  const double P0 = (p0 + 1 - p1) / 2, P1 = (1 - p0 + p1) / 2;
  EXPECT_NEAR(r.aux_loss, 0.5 * 2 * (0.5 * P0 + 0.5 * P1), 1e-15);
  const double lse0 = std::log(std::exp(1.0) + 1.0), lse1 = std::log(1.0 + std::exp(2.0));
  EXPECT_NEAR(r.z_loss, 0.25 * (lse0 * lse0 + lse1 * lse1) / 2, 1e-14);
  // Sequences of one token: f_{b,e} = E / (k L) * count = 2 for the chosen expert.
  EXPECT_NEAR(r.seq_aux_loss, 2.0 * (2 * p0 + 2 * p1) / 2, 1e-14);
}

TEST(RouterRef, BiasUpdateIsMegatronsRule) {
  const auto b = ref::update_expert_bias({3, 1, 2, 2}, {0.0, 0.5, -1.0, 0.25}, 0.125);
  EXPECT_EQ(b, (V{-0.125, 0.625, -1.0, 0.25}));  // mean 2: over -> down, under -> up, equal -> same
}

TEST(RouterRef, RejectsBadConfig) {
  using testing::expect_error_naming;
  auto bad = [](auto edit, const char* needle) {
    RouterConfig c = base(8, 2);
    edit(c);
    expect_error_naming([&] { validate_router_config(c); }, needle);
  };
  bad([](RouterConfig& c) { c.num_experts = 513; }, "num_experts");
  bad([](RouterConfig& c) { c.topk = 9; }, "topk");
  bad([](RouterConfig& c) { c.topk = 17; c.num_experts = 64; }, "topk");
  bad([](RouterConfig& c) { c.num_groups = 3; }, "num_groups");
  bad([](RouterConfig& c) { c.num_groups = 4; c.topk_groups = 5; }, "topk_groups");
  bad([](RouterConfig& c) { c.num_groups = 8; c.topk_groups = 1; }, "topk_groups");  // 1 expert kept < k
  bad([](RouterConfig& c) { c.score = ScoreFunction::kSigmoid; c.softmax_after_topk = true; }, "softmax_after_topk");
  bad([](RouterConfig& c) { c.aux_loss_coeff = -1; }, "aux_loss_coeff");
  bad([](RouterConfig& c) { c.seq_aux_loss_coeff = 1; }, "seq_length");
  bad([](RouterConfig& c) { c.capacity_factor = -1; }, "capacity_factor");
  bad([](RouterConfig& c) { c.rounding = TokenRounding::kUp; }, "output_form");
  bad([](RouterConfig& c) { c.rounding = TokenRounding::kDown; c.capacity_factor = 1; }, "capacity_factor");
  bad([](RouterConfig& c) { c.rounding = TokenRounding::kDown; c.rounding_tile = 0; }, "rounding_tile");
  bad([](RouterConfig& c) { c.scaling_factor = 0; }, "scaling_factor");
  bad([](RouterConfig& c) { c.max_tokens = int64_t{1} << 30; }, "max_tokens");
  // Products that wrap around int64 into small lists (2^59 x 32 = 2^64) are refused too.
  bad([](RouterConfig& c) { c.max_tokens = int64_t{1} << 59; }, "max_tokens");
  bad([](RouterConfig& c) { c.max_tokens = std::numeric_limits<int64_t>::max(); }, "max_tokens");
  bad([](RouterConfig& c) { c.score = static_cast<ScoreFunction>(7); }, "score");
}

// A capacity above T keeps every token (no expert receives more than T), so any finite factor is
// accepted and reports at most T -- also factors whose ceil(T k / E x factor) is past int64.
TEST(RouterRef, CapacityIsAtMostTheTokens) {
  RouterConfig c = base(8, 2);
  c.capacity_factor = 1e300;
  validate_router_config(c);
  EXPECT_EQ(router_capacity(c, 4096), 4096);
  c.capacity_factor = 1e18;
  EXPECT_EQ(router_capacity(c, 4096), 4096);
  c.capacity_factor = 100;
  EXPECT_EQ(router_capacity(c, 40), 40);   // 40 x 2 / 8 x 100 = 1000
  c.capacity_factor = 1.25;
  EXPECT_EQ(router_capacity(c, 40), 13);   // ceil(12.5)
  EXPECT_EQ(router_capacity(c, 0), 0);
}

// ---- finite differences: every loss and d logits, decisions fixed ----

struct FdCase {
  const char* name;
  std::function<void(RouterConfig&)> edit;
  int E = 12, k = 3;
};

double objective(const RouterConfig& c, const ref::RouterResult& r, const V& dp, double da, double ds, double dz) {
  double L = da * r.aux_loss + ds * r.seq_aux_loss + dz * r.z_loss;
  for (size_t i = 0; i < dp.size(); ++i) L += dp[i] * r.probs[i];
  return L;
}

TEST(RouterRef, BackwardMatchesFiniteDifferences) {
  const std::vector<FdCase> cases = {
      {"softmax", [](RouterConfig&) {}},
      {"softmax norm scaled", [](RouterConfig& c) { c.normalize_topk = true; c.scaling_factor = 1.7f; }},
      {"softmax after topk", [](RouterConfig& c) { c.softmax_after_topk = true; }},
      {"sigmoid norm bias groups", [](RouterConfig& c) {
         c.score = ScoreFunction::kSigmoid;
         c.normalize_topk = true;
         c.expert_bias = true;
         c.num_groups = 4;
         c.topk_groups = 2;
       }},
      {"sigmoid plain", [](RouterConfig& c) { c.score = ScoreFunction::kSigmoid; }},
      {"all losses softmax", [](RouterConfig& c) {
         c.aux_loss_coeff = 0.3f;
         c.seq_aux_loss_coeff = 0.7f;
         c.seq_length = 3;
         c.z_loss_coeff = 0.2f;
       }},
      {"all losses sigmoid", [](RouterConfig& c) {
         c.score = ScoreFunction::kSigmoid;
         c.normalize_topk = true;
         c.aux_loss_coeff = 0.3f;
         c.seq_aux_loss_coeff = 0.7f;
         c.seq_length = 2;
         c.z_loss_coeff = 0.2f;
       }},
      {"capacity by prob, map form", [](RouterConfig& c) {
         c.capacity_factor = 0.8;
         c.normalize_topk = true;
         c.output_form = RoutingForm::kMap;
       }},
      {"rounding up", [](RouterConfig& c) {
         c.output_form = RoutingForm::kMap;
         c.rounding = TokenRounding::kNearest;
         c.rounding_tile = 4;
         c.normalize_topk = true;
         c.aux_loss_coeff = 0.1f;
       }},
      {"k = E", [](RouterConfig& c) { c.topk = 12; c.normalize_topk = true; c.z_loss_coeff = 0.1f; }},
      {"k = 1", [](RouterConfig& c) { c.topk = 1; c.aux_loss_coeff = 1.0f; }},
  };
  std::mt19937_64 rng(11);
  std::normal_distribution<double> n;
  const int64_t T = 6;
  for (const auto& fc : cases) {
    SCOPED_TRACE(fc.name);
    RouterConfig c = base(fc.E, fc.k);
    fc.edit(c);
    V z(T * c.num_experts), b(c.num_experts);
    for (auto& v : z) v = 1.5 * n(rng);
    for (auto& v : b) v = 0.05 * n(rng);
    const V* bias = c.expert_bias ? &b : nullptr;
    const auto r = router_forward(c, z, T, bias);
    ASSERT_GT(r.decision_margin, 1e-4);
    V dp(r.probs.size());
    for (auto& v : dp) v = n(rng);
    const double da = 0.9, ds = -1.3, dzl = 0.6;
    const V g = ref::router_backward(c, z, T, r, dp, da, ds, dzl);
    const double h = 1e-6;
    for (size_t i = 0; i < z.size(); ++i) {
      V zp = z, zm = z;
      zp[i] += h;
      zm[i] -= h;
      const auto rp = router_forward(c, zp, T, bias), rm = router_forward(c, zm, T, bias);
      ASSERT_EQ(rp.selected, r.selected);
      ASSERT_EQ(rp.kept, r.kept);
      ASSERT_EQ(rm.kept, r.kept);
      const double fd = (objective(c, rp, dp, da, ds, dzl) - objective(c, rm, dp, da, ds, dzl)) / (2 * h);
      // Central differences in fp64: truncation O(h^2) ~ 1e-12, cancellation ~ 1e-16 / h = 1e-10.
      EXPECT_NEAR(g[i], fd, 1e-8) << "logit " << i;
    }
  }
}

}  // namespace
}  // namespace moe
