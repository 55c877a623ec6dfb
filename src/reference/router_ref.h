// CPU reference of the fused router (moe::Router): fp64 arithmetic, plain loops, every variant of
// RouterConfig. The executable spec the GPU router is tested against; docs/router.md gives the
// formulas this file implements.
#pragma once

#include <cstdint>
#include <vector>

#include "moe/router_config.h"

namespace moe::ref {

struct RouterResult {
  int64_t T = 0;
  int E = 0, k = 0, W = 0;  // W: selection width (k + rounding candidates)
  std::vector<int32_t> selected;  // [T * W]: chosen experts (desc. selection score), then candidates; -1 none
  std::vector<uint8_t> kept;      // [T * W]: slot routed after capacity / rounding
  std::vector<double> slot_prob;  // [T * W]: prob a slot has when kept (scaled)
  std::vector<int32_t> indices;   // top-k form [T * k] (-1 = dropped or bad row)
  std::vector<uint8_t> map;       // map form [T * E]
  std::vector<double> probs;      // [T * k] or [T * E]
  std::vector<int64_t> selection_counts;  // [E] top-k choices before drops
  std::vector<int64_t> counts;            // [E] after drops / rounding
  std::vector<int64_t> seq_counts;        // [B * E] top-k choices per sequence
  double aux_loss = 0, seq_aux_loss = 0, z_loss = 0;
  uint32_t error_bits = 0;
  // Smallest positive relative gap |a - b| / max(|a|, |b|) between two values compared at a
  // decision boundary (k-th vs next selection score, kept vs first dropped group, capacity /
  // rounding threshold). A device in fp32 reproduces every decision whose gap is well above its
  // rounding error.
  double decision_margin = 1e300;
};

// logits [T * E] (values the device sees: bf16/fp32-representable), bias [E] or null.
RouterResult router_forward(const RouterConfig& config, const std::vector<double>& logits, int64_t T,
                            const std::vector<double>* bias);

// d logits [T * E] of  sum(d_probs * probs) + d_aux * aux_loss + d_seq * seq_aux_loss + d_z * z_loss
// with the routing decisions of `fwd` held fixed. d_probs has the probs' shape (empty = zero).
std::vector<double> router_backward(const RouterConfig& config, const std::vector<double>& logits, int64_t T,
                                    const RouterResult& fwd, const std::vector<double>& d_probs, double d_aux,
                                    double d_seq, double d_z);

// bias[e] + rate * sign(mean(counts) - counts[e]).
std::vector<double> update_expert_bias(const std::vector<int64_t>& counts, const std::vector<double>& bias,
                                       double rate);

}  // namespace moe::ref
