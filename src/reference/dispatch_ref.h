// CPU reference of dispatch (permute + pad) and combine (unpermute + unpad), forward and backward
// (docs/semantics.md, Dispatch and Combine). Values are fp64 on the host (exact for every
// bf16/fp16/fp32 input); sums in fp64.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/routing_ref.h"

namespace moe::ref {

// x [T, H] -> x_perm [R, H] (pad and unused rows zero), probs_perm [R] (zero on pad rows).
void permute(const DispatchPlan& plan, const double* x, int64_t H, double* x_perm, double* probs_perm);

// d_x_perm [R, H], d_probs_perm [R] (may be null) -> dx [T, H] = sum over the token's rows;
// dprobs [T, slots] = d_probs_perm at the slot's row, zero for unused slots (skipped if null).
void permute_backward(const DispatchPlan& plan, const double* d_x_perm, const double* d_probs_perm, int64_t H,
                      double* dx, double* dprobs);

// Y [R, H] -> y [T, H] = sum over the token's rows of w * Y[row], w = the slot prob when
// merge_probs, else 1. Tokens routed nowhere get a zero row; pad rows are never read.
void unpermute(const DispatchPlan& plan, const double* Y, int64_t H, bool merge_probs, double* y);

// dy [T, H] -> dY [R, H] = w * dy[token] (pad / unused rows zero); dprobs [T, slots] (skipped if
// null) = <Y[row], dy[t]> when merge_probs, zero for unused slots and everywhere without
// merge_probs (y does not depend on the probs then). Y is only read when merge_probs.
void unpermute_backward(const DispatchPlan& plan, const double* Y, const double* dy, int64_t H, bool merge_probs,
                        double* dY, double* dprobs);

// Token chunks (docs/state.md): chunk c holds tokens [c Tc, min((c + 1) Tc, T)), Tc = max(1,
// ceil(T / chunks)). Inside an expert the plan's rows follow the tokens, so a chunk's rows of expert
// e are one window of e's real rows (no pad rows): rows [row_begin[c][e], row_begin[c][e] + n) with
// n = offsets[c][e + 1] - offsets[c][e], the windows packed in expert order (offsets[c][0] = 0);
// row_begin of an empty window is where the chunk's rows of e would start. local_row[t * slots + s]
// is the slot's row inside its chunk's packed rows (-1 where the slot has no row). Throws if a
// chunk's rows of an expert are not contiguous (the plan's token order is what this rests on).
struct ChunkWindows {
  int64_t Tc = 1;
  std::vector<std::vector<int64_t>> row_begin, offsets;  // [chunks][E], [chunks][E + 1]
  std::vector<int64_t> local_row;                       // [T * slots]
};
ChunkWindows chunk_windows(const DispatchPlan& plan, int chunks);

}  // namespace moe::ref
