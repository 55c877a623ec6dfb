// moe::Dispatcher -- token dispatch on the GPU: permute + pad, unpermute + unpad, forward and
// backward, CUDA-graph-safe (docs/semantics.md: dispatch, combine, state and graph safety, errors).
//
// A Dispatcher holds only its configuration (static bounds: T_max, E, k, H, routing form,
// options, row dtype). The routing of one micro-batch is turned into a *plan* -- counts, offsets,
// group offsets, row maps and probs_perm -- written into a caller-owned SavedState (made once with
// new_plan(), reusable), and every other call takes that plan. Any number of plans may be alive at
// once (micro-batches in flight); each call uses exactly the plan it is given. Per-call methods only
// enqueue work on the given stream: no allocation, no host synchronisation, no host read of device
// data, so they can be captured in a CUDA graph and replayed with new routing.
//
// Usage per micro-batch:  plan = d.new_plan();  d.plan(routing, err, plan) -> d.permute(plan, x)
//                  -> [experts on x_perm, groups = d.group_offsets(plan)] -> d.unpermute(plan, Y)
//                  backward: d.unpermute_backward(plan, dy) -> ... -> d.permute_backward(plan, ...).
//
// Layout: expert e owns rows [offset[e], offset[e] + padded[e]) of the permuted buffer
// x_perm [R, H]; token t's slot for e lands at offset[e] + #{t' < t routed to e} (stable token
// order, deterministic). Pad rows, and rows from sum(padded) to R, are zero in x_perm and
// probs_perm. Bad routing entries are skipped and flagged in the device error word (moe::ErrorBits);
// rows at or past R are never written (kErrRowOverflow).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

#include "moe/dispatcher_config.h"
#include "moe/dtype.h"
#include "moe/routing.h"
#include "moe/saved_state.h"
#include "moe/tensor.h"

namespace moe {

// Merging weights of the combine (unpermute) and of its backward.
enum class MergeProbs : uint8_t {
  kNone,     // weight 1 (probs already applied inside the experts)
  kPlanned,  // the routing probs the plan was made from (probs_perm), bitwise the same values
  kGiven,    // probs fp32 [T, slots] passed to the call
};

class Dispatcher {
 public:
  explicit Dispatcher(const DispatcherConfig& config);  // throws moe::Error naming a bad field
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  const DispatcherConfig& config() const;
  int64_t rows() const;             // R, the static row bound of x_perm
  int slots_per_token() const;      // k (top-k form) or E (map form)

  // A plan: device bytes (fixed by the static bounds) and host headers; new_plan() allocates one.
  size_t plan_bytes() const;
  static constexpr int kPlanHeaders = 1;
  SavedState new_plan(DeviceAllocator& allocator = cuda_malloc_allocator()) const;

  // Routing (device views, form per config: indices int32 [T, k] or map bool/uint8 [T, E], probs
  // fp32 of the same shape) -> the plan: counts, offsets, group offsets, row maps and probs_perm,
  // all on the device. error_word: the device word moe::ErrorBits are OR-ed into (moe::ErrorWord).
  // Every argument is checked before the plan is touched: a rejected call leaves it as it was.
  void plan(const RoutingView& routing, uint32_t* error_word, const SavedState& plan, cudaStream_t stream) const;

  // x [T, H] -> x_perm [R, H] (pad rows and rows past sum(padded) zero). With a scale block:
  // x_scale [T, *] -> x_perm_scale [R, *], scale_bytes_per_row bytes per row.
  void permute(const SavedState& plan, const TensorView& x, const TensorView& x_perm, cudaStream_t stream,
               const TensorView* x_scale = nullptr, const TensorView* x_perm_scale = nullptr) const;

  // Backward of permute: d_x_perm [R, H] -> dx [T, H] = fp32 sum over the token's rows, in slot
  // order; with d_probs_perm fp32 [R]: dprobs fp32 [T, slots] = d_probs_perm at the slot's row
  // (zero for slots not dispatched; dprobs without d_probs_perm is all zero).
  void permute_backward(const SavedState& plan, const TensorView& d_x_perm, const TensorView& dx, cudaStream_t stream,
                        const TensorView* d_probs_perm = nullptr, const TensorView* dprobs = nullptr) const;

  // Combine: Y [R, H] -> y [T, H] = sum over the token's rows, in slot order, of w * Y[row], fp32
  // accumulation; w per `merge` (kGiven: probs fp32 [T, slots]). Tokens routed nowhere get a zero
  // row; pad rows are never read.
  void unpermute(const SavedState& plan, const TensorView& Y, const TensorView& y, MergeProbs merge,
                 cudaStream_t stream, const TensorView* probs = nullptr) const;

  // Backward of combine: dy [T, H] -> dY [R, H] = w * dy[token] (pad rows zero). With dprobs fp32
  // [T, slots]: <Y[row], dy[t]> in fp32 when merging (Y [R, H] required then), zero for slots not
  // dispatched and everywhere without merging.
  void unpermute_backward(const SavedState& plan, const TensorView& dy, const TensorView& dY, MergeProbs merge,
                          cudaStream_t stream, const TensorView* probs = nullptr, const TensorView* Y = nullptr,
                          const TensorView* dprobs = nullptr) const;

  // ---- Token chunks (docs/state.md) ----
  // The combine and the permute backward in `chunks` pieces of consecutive tokens, so that the
  // experts' output for every routed row (Y, d_x_perm) need exist for one piece at a time. Piece c
  // holds tokens [c Tc, min((c + 1) Tc, T)), Tc = chunk_tokens(T, chunks). Inside an expert the rows
  // follow the tokens, so a piece's rows of expert e are one window of e's rows (pad rows belong to
  // no window); a grouped GEMM reads the windows with GemmProblem::a_row_begin and writes them packed.
  // chunk_windows() writes into `windows` (int32 [chunk_windows_size(chunks)], device; the caller's
  // memory, valid until the plan is refilled) what chunk_row_begin() / chunk_offsets() view per piece
  // -- row_begin int32 [E], the first row of each window, and offsets int32 [E + 1], the windows
  // packed in expert order -- and every slot's row inside its piece's packed rows.
  static int64_t chunk_tokens(int64_t T, int chunks);  // ceil(T / chunks), at least 1
  int64_t chunk_windows_size(int chunks) const;
  void chunk_windows(const SavedState& plan, int chunks, const TensorView& windows, cudaStream_t stream) const;
  TensorView chunk_row_begin(const TensorView& windows, int chunks, int chunk) const;
  TensorView chunk_offsets(const TensorView& windows, int chunks, int chunk) const;
  // int32 [T, slots]: every slot's row inside its piece's packed rows, -1 where it has none.
  TensorView chunk_slot_rows(const TensorView& windows, int chunks, int64_t T) const;
  // unpermute (weight 1: probs applied in the experts) of piece `chunk`: Y_chunk [rows', H], the
  // piece's packed rows (rows' >= min(R, chunk_tokens(T, chunks) x slots), which bounds every
  // piece's) -> y's rows of the piece's tokens (y [T, H]).
  void unpermute_chunk(const SavedState& plan, const TensorView& windows, int chunks, int chunk,
                       const TensorView& Y_chunk, const TensorView& y, cudaStream_t stream) const;
  // permute_backward of piece `chunk`: d_x_perm_chunk [rows', H] -> dx's rows of the piece's tokens;
  // with d_probs_perm fp32 [R] (every row of the plan): dprobs fp32 [T, slots] of those tokens.
  void permute_backward_chunk(const SavedState& plan, const TensorView& windows, int chunks, int chunk,
                              const TensorView& d_x_perm_chunk, const TensorView& dx, cudaStream_t stream,
                              const TensorView* d_probs_perm = nullptr, const TensorView* dprobs = nullptr) const;

  // Views into a filled plan's device memory (valid while the plan's memory lives):
  int64_t tokens(const SavedState& plan) const;                                 // T of the plan
  TensorView counts(const SavedState& plan, DType dtype = DType::kInt32) const;  // [E] tokens routed to e
  TensorView padded_counts(const SavedState& plan, DType dtype = DType::kInt32) const;  // [E] rows of e incl. pad
  TensorView offsets(const SavedState& plan, DType dtype = DType::kInt32) const;  // [E] first row of e (may exceed R)
  // int32 [E + 1]: g[0] = 0, g[e + 1] = min(offset[e] + padded[e], R); group e of a grouped GEMM
  // is rows [g[e], g[e + 1]) of x_perm.
  TensorView group_offsets(const SavedState& plan) const;
  TensorView probs_perm(const SavedState& plan) const;  // fp32 [R]: prob of each row, zero on pad rows
  TensorView slot_rows(const SavedState& plan) const;   // int32 [T, slots]: row of each slot, -1 if not dispatched
  TensorView row_slots(const SavedState& plan) const;   // int32 [R]: slot t * slots + s of each row, -1 if none

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
