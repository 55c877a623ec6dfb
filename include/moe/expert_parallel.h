// Expert parallelism on the GPU: the experts of one MoE layer split over P ranks, tokens moved by
// an all-to-all (docs/expert_parallel.md). Two parts:
//
//  - EpTransport: the all-to-all of fixed-size blocks (and its variable-size form, sizes per peer
//    known on the host), enqueued on a stream, no host sync. Two implementations: NcclTransport (one
//    rank per GPU, ncclSend/ncclRecv) and InProcessGroup's endpoints (P simulated ranks on one GPU,
//    each rank a host thread, for tests and debugging).
//  - EpDispatcher: the token dispatcher of one rank: pack by destination rank, exchange, local
//    permute over the rank's E_local experts; the combine back to the source; both backwards. Two
//    modes (EpDispatcherConfig::mode): capacity (graph-safe: a static capacity per pair, overflow
//    dropped and flagged) and dropless eager (never drops: one host synchronisation per dispatch
//    reads how many rows each pair sends; not capturable). Every result equals the CPU reference
//    (src/reference/ep_dispatch_ref.h) bitwise for data movement, and the combine sums a token's
//    slots in slot order in fp32 exactly as the single-GPU moe::Dispatcher does.
//
// Usage per rank and micro-batch (every rank makes the same calls in the same order: each one
// contains all-to-alls, which are collectives):
//   state = ep.new_state();                                               // once, reusable
//   ep.plan_and_dispatch(routing, x, err, state, x_perm, stream);        // x_perm [R_d, H]
//   experts(x_perm, ep.group_offsets(state), ep.probs_perm(state)) -> Y  // e.g. moe::GroupedExperts
//   ep.combine(state, Y, y, merge, stream);                               // y [T, H]
//   backward: ep.combine_backward(state, dy, dY, ...) -> experts backward -> ep.dispatch_backward(...)
//
// Overlapped (config.chunks = n > 1): the exchange in n chunks, the experts of chunk j running on
// the compute stream while chunk j + 1 moves on a communication stream:
//   ep.forward_overlapped(routing, x, err, state, x_perm, Y, y, merge, experts, stream, comm_stream);
//   ep.backward_overlapped(state, dy, dY, d_x_perm, dx, merge, experts_backward, stream, comm_stream);
// where experts(chunk, stream) runs the experts on one chunk's rows (its own expert groups).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "moe/dispatch.h"
#include "moe/dtype.h"
#include "moe/routing.h"
#include "moe/saved_state.h"
#include "moe/tensor.h"

struct ncclComm;  // nccl.h: typedef struct ncclComm* ncclComm_t

namespace moe {

// One exchange of an all-to-all: each rank's `send` holds P blocks of `block_bytes` (block d, at
// d * block_bytes, goes to rank d) and its `recv` receives P blocks (block s, at s * block_bytes,
// from rank s). send and recv must not overlap.
struct EpExchange {
  const void* send = nullptr;
  void* recv = nullptr;
  size_t block_bytes = 0;
};

// One exchange of a variable-size all-to-all (the dropless mode's rows): this rank sends
// send_bytes[d] bytes from send + send_offsets[d] to each rank d and receives recv_bytes[s] bytes
// from each rank s into recv + recv_offsets[s]. The four are host arrays of P entries; recv_bytes[s]
// must equal what rank s sends to this rank (its send_bytes[this rank]), which the counts exchange
// told both. Zero-byte entries move nothing. send and recv must not overlap.
struct EpVarExchange {
  const void* send = nullptr;
  void* recv = nullptr;
  const size_t* send_bytes = nullptr;    // [P]
  const size_t* send_offsets = nullptr;  // [P]
  const size_t* recv_bytes = nullptr;    // [P]
  const size_t* recv_offsets = nullptr;  // [P]
};

// The all-to-all between the P ranks of an expert-parallel group.
class EpTransport {
 public:
  virtual ~EpTransport() = default;
  virtual int rank() const = 0;
  virtual int ranks() const = 0;
  // A collective: every rank calls it with the same number of exchanges and the same block sizes.
  // The exchanges are enqueued on `stream` (after the work already there; later work waits for
  // them), with no host synchronisation and no allocation, so the call may be captured in a CUDA
  // graph.
  virtual void all_to_all(const EpExchange* exchanges, int count, cudaStream_t stream) = 0;
  // The variable-size all-to-all: a collective (every rank calls it with the same number of
  // exchanges, and the sizes of every pair agree between its two ranks); enqueued on `stream` as
  // all_to_all, no host synchronisation. The per-peer sizes are host values, so a captured call
  // would replay the sizes of its capture: callers use it eagerly (the dropless mode).
  virtual void all_to_all_v(const EpVarExchange* exchanges, int count, cudaStream_t stream) = 0;
  // The counts exchange of a dropless (host-sized) schedule: send int64 [P] (entry d for rank d)
  // -> recv int64 [P] (entry s from rank s). One all_to_all of 8-byte blocks.
  void all_to_all_counts(const int64_t* send, int64_t* recv, cudaStream_t stream);
};

// P simulated ranks on the current device. endpoint(r) is rank r's transport. The ranks are host
// threads (one per rank) that all enqueue on the same stream: each all_to_all call waits on the
// host until all P ranks have called it; the last one to arrive enqueues every rank's block copies
// (cudaMemcpyAsync, device to device) on that stream and releases the others (all_to_all_v the
// same, after checking that the sizes of every pair agree). Work a rank enqueued
// before the call therefore precedes the copies, and work after it follows them. Capturable: begin
// the capture on the shared stream (cudaStreamCaptureModeRelaxed, since the ranks' threads launch
// into it), run the ranks' threads, join them, end the capture.
// If a rank fails, abort() (called by the failing thread or its owner) wakes the waiting ranks,
// whose calls then throw moe::Error instead of waiting forever.
class InProcessGroup {
 public:
  explicit InProcessGroup(int ranks);
  ~InProcessGroup();
  InProcessGroup(const InProcessGroup&) = delete;
  InProcessGroup& operator=(const InProcessGroup&) = delete;

  int ranks() const;
  EpTransport& endpoint(int rank);
  void abort();
  bool aborted() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// True when the library was built with NCCL (MOE_HAVE_NCCL).
bool nccl_transport_available();

// A rank of an NCCL communicator (not owned: the caller creates and destroys it). all_to_all is one
// ncclGroupStart / ncclSend + ncclRecv per peer and exchange / ncclGroupEnd; all_to_all_v the same
// with each peer's own sizes (a zero-byte send or receive is left out on both sides). The communicator's
// device must be current when calling. Without NCCL in the build the constructor throws moe::Error.
class NcclTransport final : public EpTransport {
 public:
  explicit NcclTransport(ncclComm* comm);
  int rank() const override { return rank_; }
  int ranks() const override { return ranks_; }
  void all_to_all(const EpExchange* exchanges, int count, cudaStream_t stream) override;
  void all_to_all_v(const EpVarExchange* exchanges, int count, cudaStream_t stream) override;

 private:
  ncclComm* comm_ = nullptr;
  int rank_ = 0;
  int ranks_ = 0;
};

// How the rows of each (source, destination) pair are sized (docs/expert_parallel.md, Capacity and
// dropless mode).
enum class EpMode : int32_t {
  // A static capacity C per pair: fixed-size exchanges, no host synchronisation, capturable in a
  // CUDA graph; entries past C are dropped (counted, flagged with kErrRowOverflow).
  kCapacity = 0,
  // Every entry is sent: plan_and_dispatch exchanges the per-pair row counts, reads them on the
  // host (one stream synchronisation), then moves exactly those rows (variable-size exchange).
  // NOT capturable: every method refuses a stream that is capturing a CUDA graph. Buffers are sized
  // at construction for config.dropless_max_rows; a dispatch that would receive more rows on any
  // rank throws moe::Error on every rank (nothing dropped, nothing moved). chunks must be 1 (the
  // overlapped pipeline is capacity mode only).
  kDroplessEager = 1,
};

// Static configuration of one rank's dispatcher; the same on every rank.
struct EpDispatcherConfig {
  EpMode mode = EpMode::kCapacity;
  int ranks = 1;             // P; the transport's ranks() must equal it
  int local_experts = 1;     // E_local; the routing covers E = P * E_local global experts
  int64_t hidden = 0;        // H; H * dtype bytes a multiple of 16
  DType row_dtype = DType::kBF16;  // bf16, fp16 or fp32
  RoutingForm form = RoutingForm::kTopK;
  int topk = 0;              // k (top-k form)
  int align = 0;             // A of each local expert group: 0, 16, 32, 64, 128 or 256
  int64_t capacity = 0;      // C: rows per (source, destination) pair; entries past it are dropped
                             // (capacity mode; unused in dropless mode)
  int64_t max_tokens = 0;    // T_max of any rank's micro-batch
  // Dropless mode: the most rows any rank may receive in one dispatch (its receive buffer, and with
  // R_d its x_perm, are sized for it). -1 = the worst case P * T_max * min(slots, E_local) (every
  // token of every source routed to one rank's experts). The send side is T_max * slots rows.
  int64_t dropless_max_rows = -1;
  // R_c: rows of each chunk's block of x_perm (R_d = chunks * R_c); -1 = P * c + E_local * (A - 1)
  // (A > 0), P * c else, with c = ceil(C / chunks) (chunks = 1: P * C + E_local * (A - 1)). Dropless
  // mode: R_d; -1 = M + E_local * (A - 1) (A > 0), M else, M = the dropless_max_rows in effect.
  int64_t row_bound = -1;
  // n: the exchange split into n chunks (1..64, and at most max(C, 1)); chunk j carries the rows
  // [floor(j * C / n), floor((j + 1) * C / n)) of every (source, destination) pair's block, and its
  // received rows form their own expert groups (block j of x_perm). Results are bitwise those of
  // chunks = 1 for any experts that compute each row on its own (moe::GroupedExperts's outputs and
  // activation gradients; not its weight gradients, which sum over a chunk's rows). Capacity mode
  // only: 1 in dropless mode.
  int chunks = 1;
};

// One chunk's rows handed to the caller's experts by the overlapped pipeline: views of block
// `index` of the caller's tensors (rows [index * R_c, (index + 1) * R_c)) and of the state.
struct EpChunk {
  int index = 0;             // j, 0 <= j < chunks
  TensorView in;             // forward: x_perm [R_c, H]; backward: dY [R_c, H]
  TensorView out;            // forward: Y [R_c, H] to write; backward: d_x_perm [R_c, H] to write
  TensorView group_offsets;  // int32 [E_local + 1] of this block (g[0] = 0)
  TensorView probs_perm;     // fp32 [R_c], zero on pad rows
  TensorView d_probs_perm;   // backward: fp32 [R_c] to write (empty when the caller passed none)
};
// Enqueues the experts (or their backward) of one chunk on `stream`, the pipeline's compute
// stream. Called once per chunk, in chunk order, on the calling thread.
using EpChunkFn = std::function<void(const EpChunk& chunk, cudaStream_t stream)>;

// Optional inputs and outputs of EpDispatcher::backward_overlapped (those of combine_backward and
// dispatch_backward).
struct EpBackwardOptions {
  const TensorView* probs = nullptr;           // MergeProbs::kGiven: fp32 [T, slots]
  const TensorView* Y = nullptr;               // [R_d, H], the forward's experts output: dprobs_combine when merging
  const TensorView* dprobs_combine = nullptr;  // fp32 [T, slots]: combine_backward's dprobs
  const TensorView* d_probs_perm = nullptr;    // fp32 [R_d]: the experts' backward writes it per chunk
  const TensorView* dprobs = nullptr;          // fp32 [T, slots]: dispatch_backward's dprobs
};

// One rank's expert-parallel token dispatcher (docs/expert_parallel.md). What follows describes
// capacity mode; dropless mode (config.mode = kDroplessEager) differs as stated at the end.
// Buffers: send and receive buffers [P * C, H] (unused rows zero) in the chunk layout: chunk j is
// rows [P * b_j, P * b_(j+1)), b_j = floor(j * C / chunks), with peer d's block of b_(j+1) - b_j rows
// at P * b_j + d * (b_(j+1) - b_j) -- unchunked, d's block at d * C. x_perm [R_d, H] is chunks
// blocks of R_c rows, block j holding chunk j's received rows in its own expert groups (one block
// when chunks = 1). Workspaces sized at construction. Per-call methods only enqueue work on the
// stream: no allocation, no host synchronisation, no host read of device data (capturable in a
// CUDA graph and replayable with new routing). What the combine and the backwards need lives in
// the caller-owned SavedState (any number in flight). Calls of one EpDispatcher must be
// stream-ordered (its exchange workspaces and events are shared by all states).
// Errors (OR-ed into this rank's error word): bad routing entries of its tokens (skipped, as the
// single-GPU plan does) and kErrRowOverflow when one of its entries was past the capacity of its
// pair (the entry is dropped: counted in dropped(), no contribution in combine, zero gradients);
// kErrRowOverflow as well when a chunk's received groups exceed R_c (rows past it not written).
//
// Dropless mode: nothing is dropped (dropped() is zero). plan_and_dispatch packs the send buffer
// back to back (destination d's rows from the sum of the counts of the destinations before it), all
// ranks exchange their per-destination counts (each rank receives the whole P x P count matrix),
// the stream is synchronised once and the counts read on the host; the rows, their local experts
// and their probs then move by a variable-size exchange into a receive buffer packed back to back
// in source-rank order, which is permuted as in capacity mode. The rank's per-peer row counts are
// kept in the state's headers (state_headers() = 2 + ceil(P / 4)), so combine and both backwards
// move exactly those rows with no further synchronisation. The buffers hold
// max(T_max * slots, dropless_max_rows) rows (exchange_rows()); only the first sent / received
// rows of a dispatch are meaningful. If any rank would receive more than dropless_max_rows rows,
// every rank's plan_and_dispatch throws moe::Error naming 'dropless_max_rows' (the same counts on
// every rank: no rank is left waiting in a collective) and resets its state; the dispatcher stays
// usable. Every method throws when `stream` is capturing a CUDA graph (the sizes are host values
// of one dispatch); forward_overlapped / backward_overlapped are refused.
class EpDispatcher {
 public:
  EpDispatcher(const EpDispatcherConfig& config, EpTransport& transport);  // throws moe::Error naming a bad field
  ~EpDispatcher();
  EpDispatcher(const EpDispatcher&) = delete;
  EpDispatcher& operator=(const EpDispatcher&) = delete;

  const EpDispatcherConfig& config() const;
  int rank() const;
  int64_t rows() const;          // R_d = chunks * R_c: rows of x_perm
  int chunks() const;            // n
  int64_t chunk_rows() const;    // R_c: rows of one chunk's block of x_perm
  int64_t exchange_rows() const;  // rows of the send and receive buffers: P * C (dropless: above)
  int slots_per_token() const;   // k (top-k form) or E (map form)
  EpMode mode() const;
  int64_t dropless_max_rows() const;  // dropless mode: the bound in effect (the default resolved); 0 else

  size_t state_bytes() const;
  int state_headers() const;  // 1 + chunks (dropless mode: 2 + ceil(P / 4))
  static constexpr int kStateHeaders = 2;  // state_headers() in capacity mode when chunks = 1
  SavedState new_state(DeviceAllocator& allocator = cuda_malloc_allocator()) const;

  // Routing of this rank's T tokens over the global experts (form per config) and x [T, H] ->
  // x_perm [R_d, H] of this rank's local experts (pad rows and rows past the groups zero); the
  // plan (send layout, local groups, probs_perm, drop counts) is written into `state`. With
  // chunks > 1, every chunk's block of x_perm (group_offsets(state, j)) is filled, all on `stream`.
  void plan_and_dispatch(const RoutingView& routing, const TensorView& x, uint32_t* error_word,
                         const SavedState& state, const TensorView& x_perm, cudaStream_t stream) const;

  // Combine: Y [R_d, H] (this rank's expert outputs; pad rows never read) -> y [T, H] of this
  // rank's tokens = sum over the token's delivered slots, in slot order, of w * the returned row,
  // fp32 accumulation; w per `merge` (kPlanned: the routing probs; kGiven: probs fp32 [T, slots]).
  void combine(const SavedState& state, const TensorView& Y, const TensorView& y, MergeProbs merge,
               cudaStream_t stream, const TensorView* probs = nullptr) const;

  // Combine backward: dy [T, H] -> dY [R_d, H] = w * dy[token] at each delivered row (pad rows
  // zero). With dprobs fp32 [T, slots]: <Y row, dy[t]> in fp32 when merging (Y [R_d, H], the
  // combine's input, required then: its rows travel back again), zero for undelivered slots and
  // everywhere without merging.
  void combine_backward(const SavedState& state, const TensorView& dy, const TensorView& dY, MergeProbs merge,
                        cudaStream_t stream, const TensorView* probs = nullptr, const TensorView* Y = nullptr,
                        const TensorView* dprobs = nullptr) const;

  // Dispatch backward: d_x_perm [R_d, H] (and d_probs_perm fp32 [R_d]) -> dx [T, H] = fp32 sum over
  // the token's delivered rows in slot order; dprobs fp32 [T, slots] = the gradient at the slot's
  // row (zero for undelivered slots, and everywhere without d_probs_perm).
  void dispatch_backward(const SavedState& state, const TensorView& d_x_perm, const TensorView& dx,
                         cudaStream_t stream, const TensorView* d_probs_perm = nullptr,
                         const TensorView* dprobs = nullptr) const;

  // The overlapped forward: the same results, bit for bit, as
  //   plan_and_dispatch(routing, x, error_word, state, x_perm, stream);
  //   experts(chunk j) for j = 0 .. chunks - 1 (the caller's function: x_perm block j -> Y block j);
  //   combine(state, Y, y, merge, stream, probs);
  // with the all-to-alls on `comm_stream`: chunk j + 1 moves while the experts of chunk j run on
  // `stream`. The pack, every local permute, the experts, the gathers and the final sum run on
  // `stream`; comm_stream waits for the pack and for each chunk's experts through CUDA events, and
  // `stream` waits for each chunk's arrival and for the last return. On return, comm_stream's work
  // is joined into `stream` (later work on `stream` follows all of it). No host synchronisation, no
  // allocation: capturable (begin the capture on `stream`; comm_stream joins through the events).
  // comm_stream must differ from `stream` for any overlap (equal streams serialise, still correct);
  // with the in-process transport every rank passes the same comm_stream (the transport's one
  // stream), so the overlap is only functional there. x_perm, Y [R_d, H].
  void forward_overlapped(const RoutingView& routing, const TensorView& x, uint32_t* error_word,
                          const SavedState& state, const TensorView& x_perm, const TensorView& Y, const TensorView& y,
                          MergeProbs merge, const EpChunkFn& experts, cudaStream_t stream, cudaStream_t comm_stream,
                          const TensorView* probs = nullptr) const;

  // The overlapped backward: bit for bit
  //   combine_backward(state, dy, dY, merge, stream, opt.probs, opt.Y, opt.dprobs_combine);
  //   experts_backward(chunk j) for j = 0 .. chunks - 1 (dY block j -> d_x_perm, d_probs_perm block j);
  //   dispatch_backward(state, d_x_perm, dx, stream, opt.d_probs_perm, opt.dprobs);
  // with the all-to-alls on comm_stream, as forward_overlapped. With opt.dprobs_combine when merging,
  // the Y rows travel back first (not overlapped). dY, d_x_perm [R_d, H].
  void backward_overlapped(const SavedState& state, const TensorView& dy, const TensorView& dY,
                           const TensorView& d_x_perm, const TensorView& dx, MergeProbs merge,
                           const EpChunkFn& experts_backward, cudaStream_t stream, cudaStream_t comm_stream,
                           const EpBackwardOptions& opt = {}) const;

  // Views into a filled state (valid while its memory lives). `chunk`: 0 .. chunks - 1 (0, the only
  // one, when chunks = 1); its views describe block `chunk` of x_perm (offsets relative to it).
  int64_t tokens(const SavedState& state) const;          // T of the dispatch
  TensorView group_offsets(const SavedState& state, int chunk = 0) const;  // int32 [E_local + 1]
  TensorView probs_perm(const SavedState& state, int chunk = 0) const;     // fp32 [R_c], zero on pad rows
  TensorView local_counts(const SavedState& state, DType dtype = DType::kInt32, int chunk = 0) const;  // [E_local]
  TensorView dropped(const SavedState& state) const;     // int64 [P]: entries of this source dropped per destination
  TensorView slot_rows(const SavedState& state) const;   // int32 [T, slots]: send row of each slot, -1 if not sent
  TensorView send_probs(const SavedState& state) const;  // fp32 [P * C]: prob of each send row (0 if unused);
                                                         // dropless: [sent rows]
  // Rows of each peer's block moved by the dispatch that filled the state (host values): [P] rows
  // sent to each destination, [P] rows received from each source. Capacity mode: C each (the
  // fixed blocks, unused rows included); dropless mode: the counts read on the host.
  std::vector<int64_t> sent_rows(const SavedState& state) const;
  std::vector<int64_t> received_rows(const SavedState& state) const;

  // Workspace views (for tests): after plan_and_dispatch, until the next call of this dispatcher,
  // the send buffer [P * C, H], the receive buffer [P * C, H] and the received probs fp32 [P * C]
  // of that dispatch (dropless: [exchange_rows()], of which the first sent / received rows are the
  // dispatch's).
  TensorView send_buffer() const;
  TensorView recv_buffer() const;
  TensorView recv_probs() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
