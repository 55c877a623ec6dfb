// moe::Router -- the fused, CUDA-graph-safe router: logits [T, E] -> top-k routing, per-expert
// counts and optional balancing losses, forward and backward (d logits). See docs/router.md for
// every variant, its formulas and the models that use it.
//
// A Router is built once from a RouterConfig (E, k, max_tokens, the routing variant) and allocates
// its device scratch then. forward() and backward() only enqueue work on the given stream: no
// allocation, no host synchronisation, no host read of device data. Everything backward needs is
// an output of forward held by the caller (the "saved" tensors below), so any number of forwards
// may be in flight and their backwards may run in any order. The scratch is reused by every call:
// calls on one Router must be ordered (one stream, or events between streams).
//
// Determinism: ties break toward the lower expert id (selection) and the lower token id (capacity
// and token rounding); every floating-point reduction has a fixed order, so two runs on the same
// input give the same bits, eager or graph-replayed.
#pragma once

#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "moe/router_config.h"
#include "moe/routing.h"
#include "moe/tensor.h"

namespace moe {

// Caller-owned outputs of forward() (device views; T = logits rows). Entries marked "saved" are
// what backward() needs.
struct RouterOutputs {
  TensorView indices;  // top-k form: int32 [T, k], -1 = slot dropped by capacity / rounding (saved)
  TensorView map;      // map form: bool or uint8 [T, E] (saved)
  TensorView probs;    // fp32 [T, k] or [T, E] (0 where not routed)
  // int32 [T, selection_width()]: each token's chosen experts in descending selection score (the
  // first k), then its rounding candidates; -1 for a row with non-finite logits (saved).
  TensorView selected;
  TensorView selection_counts;  // int32 [E]: tokens that chose e in the top-k, before drops (saved)
  TensorView counts;            // int32 [E]: tokens routed to e after capacity / rounding
  TensorView counts_int64;      // optional int64 [E]: the same counts
  TensorView seq_counts;        // int32 [T / seq_length, E] when the sequence loss is on (saved)
  TensorView aux_loss;          // fp32 [1] when aux_loss_coeff != 0
  TensorView seq_aux_loss;      // fp32 [1] when seq_aux_loss_coeff != 0
  TensorView z_loss;            // fp32 [1] when z_loss_coeff != 0
};

// Inputs of backward(): the forward's logits and saved outputs, and the incoming gradients.
struct RouterGrads {
  TensorView d_probs;       // fp32 [T, k] or [T, E] (the probs' shape); empty = zero
  TensorView d_aux_loss;    // fp32 [1] device scalar; empty = zero
  TensorView d_seq_aux_loss;
  TensorView d_z_loss;
};

class Router {
 public:
  explicit Router(const RouterConfig& config);  // throws moe::Error naming a bad field
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  const RouterConfig& config() const;
  int selection_width() const;      // k, plus the rounding candidates with kUp / kNearest
  size_t workspace_bytes() const;   // device scratch held
  // The capacity for T tokens (ceil(T * k / E * capacity_factor), at most T: no expert receives more), or
  // -1 when dropless.
  int64_t capacity(int64_t T) const;

  // logits bf16 or fp32 [T, E] (T <= max_tokens); bias fp32 [E] when config.expert_bias.
  // Non-finite logits or bias raise kErrNonFiniteLogit in error_word: such a row is routed nowhere
  // (indices -1, probs 0, no loss contribution, zero gradient).
  void forward(const TensorView& logits, const TensorView& bias, const RouterOutputs& out, uint32_t* error_word,
               cudaStream_t stream) const;

  // d_logits (same dtype and shape as logits) from the forward's logits, its saved outputs and the
  // incoming gradients; fp32 arithmetic.
  void backward(const TensorView& logits, const RouterOutputs& saved, const RouterGrads& grads,
                const TensorView& d_logits, cudaStream_t stream) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Aux-loss-free bias update (DeepSeek-V3, Megatron's rule): bias[e] += rate * sign(mean - counts[e]),
// mean = sum(counts) / E. counts int32 or int64 [E] on the device, bias fp32 [E]; graph-safe.
void update_expert_bias(const TensorView& counts, const TensorView& bias, float rate, cudaStream_t stream);

}  // namespace moe
