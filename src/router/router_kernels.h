// Launchers of the router kernels (plain C++ signatures; the kernels live in router_*.cu).
// moe::Router (router.cpp) checks every argument before calling these: the launchers trust their
// parameters and only enqueue work on the stream. The kernel design is in docs/router.md.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "moe/router_config.h"

namespace moe::kernels {

// Warps per block of the row kernels, and the most blocks of the forward row kernel (its loss
// partial sums have one entry per block).
constexpr int kRouterWarps = 8;
constexpr int kRouterMaxBlocks = 1024;
// The per-expert arrival entries of the counts (publish_counts_by_arrival) lie 256 bytes apart:
// every block adds to every entry at about the same time at the end of a one-wave grid, and entries
// packed side by side put those 64-bit atomics on a few L2 slices (packed: 18.8 us against 17.1 at
// E = 256, bf16, k = 2 on the H100; 32, 64 and 128 bytes apart were slower, 512 and 1024 no faster).
constexpr int kRouterArrivalStride = 32;  // in 64-bit words

// A token row lives in a group of G lanes (a power of two, 1..32); lane g of the group owns the
// NJ consecutive experts [g NJ, g NJ + NJ), read with 16-byte loads. NJ = 8 (one 16-byte vector of
// bf16), or 16 when E > 256; G is the smallest power of two with G NJ >= E.
inline int router_experts_per_lane(int E) { return E > 256 ? 16 : 8; }
inline int router_lanes_per_row(int E) {
  const int nj = router_experts_per_lane(E), need = (E + nj - 1) / nj;
  int g = 1;
  while (g < need) g *= 2;
  return g;
}

// Grid of the row kernels for T tokens with G lanes per row: a warp's tile is 32 / G rows, and
// block b works on tiles [b tiles_per_block, (b + 1) tiles_per_block). A function of (T, E) only --
// the reduction order of the losses depends on it, so it must not depend on the device.
struct RouterRowGrid {
  int blocks = 1;
  int32_t tiles_per_block = 0;
};
RouterRowGrid router_row_grid(int64_t T, int G);

// What every row kernel needs to recompute a row's scores.
struct RouterRowParams {
  int32_t T = 0;
  int E = 0, k = 0, W = 0;  // W: selection width
  int G = 1;                // lanes per row (router_lanes_per_row)
  bool bf16 = false;        // logits dtype: bf16, else fp32
  bool vec = false;         // rows read with 16-byte vectors: E % NJ == 0 and 16-byte aligned logits
  const void* logits = nullptr;
  const float* bias = nullptr;  // [E] or null
  ScoreFunction score = ScoreFunction::kSoftmax;
  bool softmax_after = false, normalize = false;
  float alpha = 1.0f;  // scaling factor
  int groups = 1, topk_groups = 1;
  float aux_coeff = 0, seq_coeff = 0, z_coeff = 0;
  int32_t seq_length = 0;
};

enum class SelectKey : uint8_t { kNone, kProb, kPosition, kScore };

struct RouterForwardArgs {
  RouterRowParams p;
  RoutingForm form = RoutingForm::kTopK;
  bool out_vec = false;                 // map form: map and probs rows stored with vectors
  SelectKey select = SelectKey::kNone;  // capacity (prob / position) or rounding (score): a select pass
  int64_t capacity = -1;                // capacity (kProb / kPosition)
  TokenRounding rounding = TokenRounding::kNone;
  int rounding_tile = 0;
  // Outputs (caller's).
  int32_t* indices = nullptr;  // [T, k]
  uint8_t* map = nullptr;      // [T, E]
  float* probs = nullptr;
  int32_t* selected = nullptr;  // [T, W]
  int32_t* selection_counts = nullptr;
  int32_t* counts32 = nullptr;
  int64_t* counts64 = nullptr;  // may be null
  int32_t* seq_counts = nullptr;
  float *aux_loss = nullptr, *seq_loss = nullptr, *z_loss = nullptr;
  uint32_t* error_word = nullptr;
  // Scratch (the router's). The accumulators, arrival entries and tickets are zero between calls:
  // the last block of the kernel that fills them (the last arriving one, for an entry) reads and
  // clears them.
  int32_t* count_acc = nullptr;             // [E] selection counts
  // [E * kRouterArrivalStride] the counts by last arrival: entry e at e * kRouterArrivalStride
  // holds the blocks arrived << 32 | the count so far
  unsigned long long* count_arrivals = nullptr;
  int32_t* cand_acc = nullptr;              // [E] select-pass list entries
  unsigned long long* aux_acc = nullptr;    // [E] sum_t a_{t,e} in fixed point (2^-32)
  uint32_t* tickets = nullptr;              // [2] blocks done: row kernel, sequence kernel
  float* z_partials = nullptr;              // [kRouterMaxBlocks]
  double* seq_partials = nullptr;           // [T_max]
  float* slot_prob = nullptr;               // [T_max, W]
  float* slot_key = nullptr;                // [T_max, W]
  uint8_t* kept = nullptr;                  // [T_max, W]
  int32_t* cand_count = nullptr;            // [E]
  int32_t* cand_offset = nullptr;           // [E]
  int32_t* cand_cursor = nullptr;           // [E]
  uint64_t* list_key = nullptr;             // [T_max * W]
  int32_t* list_slot = nullptr;             // [T_max * W]
};

// Runs the forward: the plain top-k kernel where it applies (router_topk_rows_apply), the biased one
// where it does (router_biased_rows_apply), else the general row kernel and, with a capacity or
// rounding, the select pass.
void launch_router_forward(const RouterForwardArgs& a, cudaStream_t stream);
// The plain top-k kernel (router_topk_rows.cu): bf16 or fp32 logits in 16-byte vector rows
// (RouterRowParams vec), E <= 512, k <= 8, top-k form, no bias, group limit, loss, capacity or rounding.
bool router_topk_rows_apply(const RouterForwardArgs& a);
void launch_router_topk_rows(const RouterForwardArgs& a, cudaStream_t stream);
// The biased / group-limited top-k kernel (router_biased_rows.cu): sigmoid scores with an expert bias
// and / or a group limit (groups of a power-of-two number of 4-expert vectors), 64 <= E <= 512, k <= 8,
// 16-byte vector rows, top-k form, no loss, capacity or rounding. Its outputs are the general kernel's bits.
bool router_biased_rows_apply(const RouterForwardArgs& a);
void launch_router_biased_rows(const RouterForwardArgs& a, cudaStream_t stream);

struct RouterBackwardArgs {
  RouterRowParams p;
  RoutingForm form = RoutingForm::kTopK;
  bool out_vec = false;  // d logits rows stored with 16-byte vectors
  const int32_t* indices = nullptr;
  const uint8_t* map = nullptr;
  const int32_t* selected = nullptr;
  const int32_t* selection_counts = nullptr;
  const int32_t* seq_counts = nullptr;
  const float* d_probs = nullptr;  // null = zero
  const float *d_aux = nullptr, *d_seq = nullptr, *d_z = nullptr;
  void* d_logits = nullptr;
};

void launch_router_backward(const RouterBackwardArgs& a, cudaStream_t stream);

// True when d logits are zero outside each row's k chosen experts and need only their logits: top-k
// form, no loss, scores of the chosen logits alone (not a plain softmax), 16-byte rows of d logits.
// launch_router_backward then runs launch_router_backward_topk (router_backward_topk.cu).
bool router_backward_is_topk_only(const RouterBackwardArgs& a);
void launch_router_backward_topk(const RouterBackwardArgs& a, cudaStream_t stream);

// bias[e] += rate * sign(sum(counts) - E * counts[e]).
void launch_update_expert_bias(const void* counts, bool counts64, float* bias, int E, float rate, cudaStream_t stream);

}  // namespace moe::kernels
