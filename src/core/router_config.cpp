#include "moe/router_config.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "moe/error.h"

namespace moe {

namespace {
constexpr int kMaxExperts = 512;    // a token row lives in one warp's registers: 16 per lane
constexpr int kMaxTopk = 16;
constexpr int kMaxWidth = 32;       // chosen + rounding candidates, one lane each
constexpr int kMaxGroups = 32;      // one lane per group

bool rounding_adds(TokenRounding r) { return r == TokenRounding::kUp || r == TokenRounding::kNearest; }

int default_candidates(const RouterConfig& c) {
  return std::max(0, std::min(c.topk, std::min(kMaxWidth, c.num_experts) - c.topk));
}
}  // namespace

void validate_router_config(const RouterConfig& c) {
  MOE_CHECK(c.num_experts >= 1 && c.num_experts <= kMaxExperts, "argument 'num_experts': expected 1..", kMaxExperts,
            ", got ", c.num_experts);
  MOE_CHECK(c.topk >= 1 && c.topk <= std::min(kMaxTopk, c.num_experts), "argument 'topk': expected 1..",
            std::min(kMaxTopk, c.num_experts), " (at most 16 and at most num_experts), got ", c.topk);
  // The device lists hold max_tokens x max(num_experts, 32) int32 indices; bounded by division, so that
  // the product cannot wrap into a small list.
  const int64_t per_token = std::max(c.num_experts, kMaxWidth);
  const int64_t max_tokens_bound = std::numeric_limits<int32_t>::max() / per_token;
  MOE_CHECK(c.max_tokens >= 0 && c.max_tokens <= max_tokens_bound, "argument 'max_tokens': expected 0..",
            max_tokens_bound, " (max_tokens x ", per_token, " must fit the int32 indices of the device lists), got ",
            c.max_tokens);
  MOE_CHECK(c.score == ScoreFunction::kSoftmax || c.score == ScoreFunction::kSigmoid,
            "argument 'score': expected softmax or sigmoid, got ", int(c.score));
  MOE_CHECK(!c.softmax_after_topk || c.score == ScoreFunction::kSoftmax,
            "argument 'softmax_after_topk': needs score = softmax");
  MOE_CHECK(std::isfinite(c.scaling_factor) && c.scaling_factor > 0.0f,
            "argument 'scaling_factor': expected a finite value > 0, got ", c.scaling_factor);
  MOE_CHECK(c.num_groups >= 1 && c.num_groups <= kMaxGroups && c.num_experts % c.num_groups == 0,
            "argument 'num_groups': expected 1..", kMaxGroups, " dividing num_experts = ", c.num_experts, ", got ",
            c.num_groups);
  MOE_CHECK(c.topk_groups >= 1 && c.topk_groups <= c.num_groups, "argument 'topk_groups': expected 1..",
            c.num_groups, ", got ", c.topk_groups);
  MOE_CHECK(c.topk <= int64_t{c.topk_groups} * (c.num_experts / c.num_groups),
            "argument 'topk_groups': the kept groups hold ", c.topk_groups * (c.num_experts / c.num_groups),
            " experts, fewer than topk = ", c.topk);
  for (auto [v, name] : {std::pair{c.aux_loss_coeff, "aux_loss_coeff"}, std::pair{c.seq_aux_loss_coeff,
                                                                                  "seq_aux_loss_coeff"},
                         std::pair{c.z_loss_coeff, "z_loss_coeff"}})
    MOE_CHECK(std::isfinite(v) && v >= 0.0f, "argument '", name, "': expected a finite value >= 0, got ", v);
  MOE_CHECK(c.seq_aux_loss_coeff == 0.0f || c.seq_length >= 1,
            "argument 'seq_length': expected >= 1 with the sequence aux loss on, got ", c.seq_length);
  MOE_CHECK(std::isfinite(c.capacity_factor) && c.capacity_factor >= 0.0,
            "argument 'capacity_factor': expected a finite value >= 0 (0 = dropless), got ", c.capacity_factor);
  MOE_CHECK(c.drop_policy == CapacityDropPolicy::kProb || c.drop_policy == CapacityDropPolicy::kPosition,
            "argument 'drop_policy': expected prob or position");
  MOE_CHECK(c.output_form == RoutingForm::kTopK || c.output_form == RoutingForm::kMap,
            "argument 'output_form': expected top-k or map");
  if (c.rounding != TokenRounding::kNone) {
    MOE_CHECK(c.rounding == TokenRounding::kDown || rounding_adds(c.rounding),
              "argument 'rounding': expected none, down, up or nearest");
    MOE_CHECK(c.rounding_tile >= 1, "argument 'rounding_tile': expected >= 1, got ", c.rounding_tile);
    MOE_CHECK(c.capacity_factor == 0.0, "argument 'rounding': token rounding replaces a capacity; set ",
              "capacity_factor = 0 (got ", c.capacity_factor, ")");
  }
  if (rounding_adds(c.rounding)) {
    MOE_CHECK(c.output_form == RoutingForm::kMap, "argument 'rounding': up / nearest add experts to a token ",
              "beyond its k slots; expected output_form = map");
    MOE_CHECK(!c.softmax_after_topk, "argument 'rounding': up / nearest need a score over all experts; ",
              "softmax_after_topk has none for unchosen experts");
    const int cap = std::min(kMaxWidth, c.num_experts) - c.topk;
    MOE_CHECK(c.rounding_candidates >= 0 && c.rounding_candidates <= cap, "argument 'rounding_candidates': ",
              "expected 0..", cap, " (k + candidates <= min(32, num_experts)), got ", c.rounding_candidates);
  }
}

int router_selection_width(const RouterConfig& c) {
  if (!rounding_adds(c.rounding)) return c.topk;
  return c.topk + (c.rounding_candidates > 0 ? c.rounding_candidates : default_candidates(c));
}

int64_t router_capacity(const RouterConfig& c, int64_t T) {
  if (c.capacity_factor == 0.0) return -1;
  // An expert receives at most T tokens: a larger capacity keeps every token (and a huge factor must
  // not reach the conversion to int64, which is undefined past its range).
  const double cap = std::ceil(static_cast<double>(T) * c.topk / c.num_experts * c.capacity_factor);
  return cap >= static_cast<double>(T) ? T : static_cast<int64_t>(cap);
}

int64_t router_rounded_count(const RouterConfig& c, int64_t chosen, int64_t T) {
  const int64_t M = c.rounding_tile, q = chosen / M, r = chosen % M;
  int64_t tiles = q;
  switch (c.rounding) {
    case TokenRounding::kNone: return chosen;
    case TokenRounding::kDown: break;
    case TokenRounding::kUp: tiles = q + (r != 0); break;
    case TokenRounding::kNearest: tiles = q + (2 * r > M || (2 * r == M && (q % 2) == 1)); break;
  }
  return std::min(tiles * M, T);
}

}  // namespace moe
