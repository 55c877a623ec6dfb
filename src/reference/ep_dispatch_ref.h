// CPU reference of expert-parallel dispatch and combine, forward and backward (see
// docs/expert_parallel.md). P ranks each hold E_local experts: rank r owns the global experts
// [r * E_local, (r + 1) * E_local). Every rank p has its own tokens x_p [T_p, H] and routing over
// the global expert ids. Dispatch runs in three stages, each a plain function here so that a
// multi-GPU implementation can be tested stage by stage:
//   1. pack:     on each source rank, permute its (token, slot) entries by destination rank into a
//                send buffer (order: destination rank, then token, then slot);
//   2. exchange: the all-to-all -- destination d receives from every source s the rows s packed for
//                d, concatenated in source-rank order;
//   3. local:    on each destination, the single-GPU dispatch of the received rows over its local
//                experts (expert-major, then source rank, then source token; padded to A).
// Combine mirrors it and sums each token's expert outputs on its source rank in slot order, in
// fp64, exactly as the single-GPU reference does. Values are fp64 on the host; data movement is
// exact, so every result equals the single-GPU reference of all ranks' tokens bitwise.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/routing_ref.h"

namespace moe::ref {

// Per-rank buffers: [P] row-major arrays, one per rank.
using RankBuffers = std::vector<std::vector<double>>;

struct EpConfig {
  int P = 1;              // ranks
  int E_local = 1;        // experts per rank; the routing's E must be P * E_local
  int align = 0;          // A of the per-expert groups on each destination (as single-GPU dispatch)
  int64_t capacity = -1;  // C: static rows per (source, destination) pair (graph-safe mode);
                          // -1 = dropless (buffer sizes depend on the routing)
  int64_t row_bound = -1;  // R_d of every destination's x_perm; -1 = the dropless bound of the
                           // received rows: recv_rows + E_local * (A - 1) (A > 0), recv_rows else
};

// Where every entry goes. Send and receive buffers:
//   dropless: send buffer of s = its rows for d = 0, 1, ... packed back to back; receive buffer of
//             d = the rows from s = 0, 1, ... packed back to back;
//   capacity: send buffer of s is [P * C] with d's block at d * C; receive buffer of d is [P * C]
//             with s's block at s * C (the fixed-size all-to-all); the unused rows of a block are
//             zero and empty.
struct EpPlan {
  int P = 0;
  int E_local = 0;
  int slots = 0;          // per token (k in top-k form, P * E_local in map form)
  int64_t capacity = -1;  // as in EpConfig

  // [P] per source rank: the pack stage as a dispatch plan whose "experts" are destination ranks.
  // slot_expert = destination rank of the slot (-1 if the slot is empty or invalid), slot_row =
  // its row in the send buffer (-1 if not sent: invalid or past capacity), slot_prob = its prob;
  // count[d] = valid entries for d (before capacity), padded[d] = rows reserved for d (C, or
  // count[d] when dropless), offset[d] = d's block in the send buffer, R = send buffer rows.
  std::vector<DispatchPlan> send;
  // [P] per source rank: the global expert of each slot, -1 if empty or invalid (validated as the
  // single-GPU plan does: out of range, duplicate, non-finite prob).
  std::vector<std::vector<int32_t>> slot_expert;
  std::vector<int64_t> sent;     // [P * P] (s * P + d): rows source s sends to destination d
  std::vector<int64_t> dropped;  // [P * P] (s * P + d): entries of s for d past the capacity
  // [P] per destination: where the rows from source s start in d's receive buffer ([P] each).
  std::vector<std::vector<int64_t>> recv_offset;
  // [P] per destination: the source rank and source slot index (t * slots + s) of each receive
  // buffer row, -1 for an empty row.
  std::vector<std::vector<int32_t>> recv_rank;
  std::vector<std::vector<int64_t>> recv_slot;
  // [P] per destination: the local stage, the single-GPU plan of the receive buffer seen as a
  // top-k routing with k = 1 over the E_local local experts (T = receive buffer rows, empty rows
  // are empty slots). Its count / padded / offset are the expert groups of x_perm_d.
  std::vector<DispatchPlan> local;
  // [P] the error word of each rank: bad routing entries of its tokens (as plan_dispatch),
  // kErrRowOverflow when one of its entries was past the capacity of its (source, destination)
  // pair, or when its x_perm rows exceeded R_d.
  std::vector<uint32_t> error_bits;

  int64_t send_rows(int rank) const { return send[rank].R; }
  int64_t recv_rows(int rank) const { return local[rank].T; }
  int64_t total_dropped() const;
};

// routing[p]: rank p's routing (either form) over E = P * E_local global experts; every rank uses
// the same form and k. Host-checkable problems throw moe::Error naming the argument.
EpPlan plan_ep_dispatch(const std::vector<Routing>& routing, const EpConfig& config);

// Stage 1 (pack): x [P][T_p * H] -> send [P][send_rows * H], send_probs [P][send_rows] (zero on
// unused rows).
void ep_pack(const EpPlan& plan, const RankBuffers& x, int64_t H, RankBuffers& send, RankBuffers& send_probs);
// Stage 2 (exchange): send [P][send_rows * W] -> recv [P][recv_rows * W], W values per row
// (H for rows, 1 for probs). Empty receive rows are zero.
void ep_exchange(const EpPlan& plan, const RankBuffers& send, int64_t W, RankBuffers& recv);
// The reverse all-to-all: recv [P][recv_rows * W] -> send [P][send_rows * W] (unused rows zero).
void ep_exchange_back(const EpPlan& plan, const RankBuffers& recv, int64_t W, RankBuffers& send);

// Dispatch: x [P][T_p * H] -> x_perm [P][R_d * H], probs_perm [P][R_d] (pad and unused rows zero):
// pack, exchange (rows and probs), then the single-GPU permute of the received rows.
void ep_dispatch(const EpPlan& plan, const RankBuffers& x, int64_t H, RankBuffers& x_perm, RankBuffers& probs_perm);

// Dispatch backward: d_x_perm [P][R_d * H], d_probs_perm [P][R_d] (empty = none) -> dx
// [P][T_p * H] = sum over the token's rows, in slot order; dprobs [P][T_p * slots] = the gradient at
// the slot's row, zero for slots that were not delivered (or everywhere without d_probs_perm).
void ep_dispatch_backward(const EpPlan& plan, const RankBuffers& d_x_perm, const RankBuffers& d_probs_perm,
                          int64_t H, RankBuffers& dx, RankBuffers& dprobs);

// Combine: Y [P][R_d * H] (each destination's expert outputs) -> y [P][T_p * H]: each delivered row
// goes back to its source rank, y_p[t] = sum over t's slots in slot order of w * Y row (w = the slot
// prob when merge_probs, else 1), fp64. Pad rows are never read; tokens routed nowhere get zero.
void ep_combine(const EpPlan& plan, const RankBuffers& Y, int64_t H, bool merge_probs, RankBuffers& y);

// Combine backward: dy [P][T_p * H] -> dY [P][R_d * H] = w * dy[token] at each delivered row (pad
// and unused rows zero); dprobs [P][T_p * slots] = <Y row, dy[t]> when merge_probs, zero otherwise
// and for undelivered slots. Y is only read when merge_probs (the rows travel back to the source,
// as in the forward).
void ep_combine_backward(const EpPlan& plan, const RankBuffers& Y, const RankBuffers& dy, int64_t H,
                         bool merge_probs, RankBuffers& dY, RankBuffers& dprobs);

}  // namespace moe::ref
