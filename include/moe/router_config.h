// Configuration of the fused router (moe::Router) and the host-side rules derived from it, shared
// by the device implementation and the CPU reference. See docs/router.md.
#pragma once

#include <cstdint>

#include "moe/routing.h"

namespace moe {

enum class ScoreFunction : uint8_t {
  kSoftmax,  // softmax over the E logits (Mixtral, Qwen2/3-MoE, OLMoE), or over the k chosen logits
  kSigmoid,  // sigmoid of each logit (DeepSeek-V3)
};

enum class CapacityDropPolicy : uint8_t {
  kProb,      // an expert over capacity keeps its tokens with the highest probs (ties: lower token id)
  kPosition,  // ... keeps its first tokens in token order
};

enum class TokenRounding : uint8_t {
  kNone,
  kDown,     // each expert's count rounded down to a multiple of the tile (drops lowest-score tokens)
  kUp,       // rounded up (adds the best-scoring unchosen candidates); needs map-form output
  kNearest,  // to the nearest multiple, a half rounded to even (SonicMoE); needs map-form output
};

struct RouterConfig {
  int num_experts = 0;     // E, 1..512
  int topk = 0;            // k, 1..min(16, E)
  int64_t max_tokens = 0;  // T_max: every call has T <= T_max

  ScoreFunction score = ScoreFunction::kSoftmax;
  // Softmax only: the softmax runs over the k chosen logits after the top-k (GPT-OSS) instead of
  // over all E logits before it.
  bool softmax_after_topk = false;
  // Renormalise the chosen probs to sum 1 (softmax before top-k: Mixtral, Qwen3 norm_topk_prob;
  // sigmoid: DeepSeek-V3). Ignored with softmax_after_topk (its probs sum to 1 already).
  bool normalize_topk = false;
  float scaling_factor = 1.0f;  // routed_scaling_factor: every returned prob is multiplied by it

  // Per-expert fp32 bias added to the scores for selection only (aux-loss-free balancing); the
  // bias tensor is then an argument of forward().
  bool expert_bias = false;

  // Group-limited top-k: E split into num_groups groups of consecutive experts; keep topk_groups of
  // them by the sum of each group's top-2 (biased) scores, choose the top-k inside. 1 = off.
  int num_groups = 1;   // divides E, <= 32
  int topk_groups = 1;  // 1..num_groups, k <= topk_groups * E / num_groups

  // Losses (0 = off). Their values are device fp32 scalars; backward takes their gradients.
  float aux_loss_coeff = 0.0f;      // switch load-balancing loss, coeff * E * sum_e f_e * P_e
  float seq_aux_loss_coeff = 0.0f;  // DeepSeek-V3 sequence-wise balance loss (needs seq_length)
  int64_t seq_length = 0;           // tokens of one sequence (contiguous); T must be a multiple
  float z_loss_coeff = 0.0f;        // coeff * mean_t logsumexp(logits_t)^2

  // Capacity: each expert keeps at most ceil(T * k / E * capacity_factor) tokens. 0 = dropless.
  double capacity_factor = 0.0;
  CapacityDropPolicy drop_policy = CapacityDropPolicy::kProb;

  // Token rounding to a multiple of rounding_tile per expert (not combined with a capacity).
  TokenRounding rounding = TokenRounding::kNone;
  int rounding_tile = 128;
  // kUp / kNearest: unchosen candidates per token considered for additions (its experts ranked
  // k .. k + rounding_candidates - 1 by selection score); k + rounding_candidates <= min(32, E).
  int rounding_candidates = 0;  // 0 = min(k, min(32, E) - k)

  RoutingForm output_form = RoutingForm::kTopK;  // top-k [T, k] or map [T, E]
};

// Host checks of a config (also run by the Router constructor); throws moe::Error naming the field.
void validate_router_config(const RouterConfig& config);

// Columns of the `selected` output: k, plus the rounding candidates with kUp / kNearest.
int router_selection_width(const RouterConfig& config);

// ceil(T * k / E * capacity_factor) (Megatron's rule) capped at T (no expert receives more: the same
// selection), or -1 when capacity_factor is 0.
int64_t router_capacity(const RouterConfig& config, int64_t T);

// Token rounding: the target count of an expert chosen by `chosen` tokens (before candidates are
// added), min(T, rounded) -- see docs/router.md.
int64_t router_rounded_count(const RouterConfig& config, int64_t chosen, int64_t T);

}  // namespace moe
