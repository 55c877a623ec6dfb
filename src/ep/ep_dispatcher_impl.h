// moe::EpDispatcher's private state and stages, shared by the stage-by-stage methods
// (ep_dispatcher.cpp) and the overlapped pipeline (ep_overlap.cpp). Every stage only enqueues work
// on the stream it is given; the argument checks happen in the public methods before any stage
// runs.
//
// The single-GPU moe::Dispatcher does two of the stages:
//  - the pack plan: the flat slots i = t * slots + s of this source, seen as a top-k routing with
//    k = 1 over P "experts" (their destination ranks), so a destination's entries are ranked in
//    pack order (token, then slot) deterministically; ep_capacity.cu maps those ranks to the
//    capacity layout (the send row of (d, rank) in the chunk layout, drops past C);
//  - the local stage of each chunk: the chunk's received rows seen as a top-k routing with k = 1
//    over the E_local local experts (expert-major, then receive order), and its permute / backward.
// Everything between them is row movement (permute_rows with a row map) and the all-to-alls.
// The dropless mode (ep_dropless.cpp) runs the same stages with the per-peer row counts read on the
// host: the pack plan's own rows as the send layout, variable-size exchanges, one local plan.
#pragma once

#include <array>
#include <initializer_list>
#include <memory>
#include <vector>

#include "ep/chunk_layout.h"
#include "ep/dropless_counts.h"
#include "ep/ep_kernels.h"
#include "moe/dispatch.h"
#include "moe/expert_parallel.h"

namespace moe {

constexpr int kEpMaxChunks = 64;

// The dispatcher's own part of a state (the chunks' local plans follow it).
// S = the send rows bound: P * C (capacity mode), T_max * slots (dropless mode).
struct EpStateLayout {
  int32_t* send_slot_row = nullptr;  // [T_max * slots]
  int32_t* send_row_slot = nullptr;  // [S]
  float* send_probs = nullptr;       // [S]
  int64_t* dropped = nullptr;        // [P]
};

// Per-dispatcher workspaces (shared by all states: calls are stream-ordered), in the chunk layout
// (capacity mode) or packed back to back (dropless mode). B = P * C (capacity mode), max(S, M)
// (dropless mode: each buffer holds the send layout in one direction and the receive layout in
// the other).
struct EpWorkspace {
  void* send = nullptr;          // [B, H]: the source side of every exchange
  void* recv = nullptr;          // [B, H]: the destination side
  int32_t* send_expert = nullptr;  // [B]
  int32_t* recv_expert = nullptr;  // [B]
  float* recv_probs = nullptr;     // [B]
  float* back_probs = nullptr;     // [B]: d_probs of the dispatch backward at the source
  int32_t* slot_dest = nullptr;    // [T_max * slots]
  int64_t* count_send = nullptr;   // dropless: [P * P], this rank's counts once per destination
  int64_t* count_recv = nullptr;   // dropless: [P * P], the count matrix (row s from source s)
};

struct EpDispatcher::Impl {
  EpDispatcherConfig cfg;
  EpTransport* transport = nullptr;
  uint64_t serial = 0;
  int P = 0, slots = 0, n = 1;
  int64_t C = 0, PC = 0, Rc = 0, R = 0, row_bytes = 0;
  bool dropless = false;
  int64_t S = 0, B = 0;  // send rows bound and exchange buffer rows (EpStateLayout, EpWorkspace)
  int64_t M = 0;         // dropless: the most rows a rank may receive
  int64_t* host_counts = nullptr;  // dropless: pinned [P * P], the count matrix read on the host
  ep::ChunkLayout layout;
  std::unique_ptr<Dispatcher> pack, local;
  SavedState pack_plan;
  DeviceBuffer ws_memory;
  EpWorkspace ws;
  size_t own_bytes = 0, local_bytes = 0;
  // The overlapped pipeline's events (ep_overlap.cpp), made at construction on the current device.
  std::vector<cudaEvent_t> events;

  ~Impl();

  EpStateLayout carve_state(char* base, size_t* bytes = nullptr) const;
  EpWorkspace carve_workspace(char* base, size_t* bytes = nullptr) const;
  size_t state_bytes() const { return own_bytes + static_cast<size_t>(n) * local_bytes; }
  // Dropless: after the local plan's header, the rank's per-peer row counts (2 * P int64, 8 per
  // 64-byte header).
  int count_headers() const { return dropless ? (2 * P + 7) / 8 : 0; }
  int state_headers() const { return 1 + n + count_headers(); }
  // Chunk j's local plan: its part of the state's memory and header 1 + j.
  SavedState local_state(const SavedState& state, int j) const {
    return state.slice(own_bytes + static_cast<size_t>(j) * local_bytes, local_bytes, 1 + j, 1);
  }
  // The layout of a filled state of this dispatcher, and its T.
  EpStateLayout filled(const SavedState& state, const char* call, int64_t* T) const;
  void check_chunk(int chunk) const;
  // The routing of this rank's T tokens as the pack kernels read it.
  kernels::EpRouting ep_routing(const RoutingView& routing, int64_t T) const;
  // Destinations of every slot and the dropless pack plan over them (pack_plan): the first part of
  // both modes' pack.
  void plan_pack(const kernels::EpRouting& r, const RoutingView& routing, uint32_t* error_word,
                 cudaStream_t stream) const;

  TensorView rows_view(void* p, int64_t rows) const { return TensorView(p, cfg.row_dtype, {rows, cfg.hidden}); }
  void check_rows(const TensorView& t, const char* name, int64_t rows) const {
    check_device_tensor(t, name, cfg.row_dtype, {rows, cfg.hidden});
  }
  // Block j of a [R, H] tensor (x_perm, Y, dY, d_x_perm): rows [j * Rc, (j + 1) * Rc).
  TensorView block(const TensorView& t, int j) const {
    return rows_view(static_cast<char*>(t.data) + j * Rc * row_bytes, Rc);
  }
  TensorView probs_block(const TensorView& t, int j) const {
    return TensorView(static_cast<float*>(t.data) + j * Rc, DType::kFP32, {Rc});
  }
  // Rows of chunk j in the send / receive layout: P * size(j), from first_row(j).
  int64_t chunk_exchange_rows(int j) const { return P * layout.size(j); }
  // Chunk j of a [P * C, H] exchange buffer (per-row arrays: base + layout.first_row(j)).
  void* chunk_rows(void* base, int j) const { return static_cast<char*>(base) + layout.first_row(j) * row_bytes; }

  // One buffer pair of an exchange: `send` -> `recv`, `bytes` per row.
  struct Lane {
    const void* send;
    void* recv;
    int64_t bytes;
  };
  // Chunks [j0, j1) of every lane, in one all_to_all (one collective): per chunk, one exchange of
  // blocks of size(j) rows per lane.
  void exchange(std::initializer_list<Lane> lanes, int j0, int j1, cudaStream_t stream) const;

  // --- the stages ---
  // 1. Pack (source): destinations, their ranks in pack order, the capacity layout, the rows into
  //    the send buffer. Checks nothing (the caller did).
  void pack_rows(const RoutingView& routing, int64_t T, const TensorView& x, uint32_t* error_word,
                 const EpStateLayout& s, cudaStream_t stream) const;
  // 2. The forward exchange of chunks [j0, j1): rows, their local experts and their probs.
  void exchange_forward(const EpStateLayout& s, int j0, int j1, cudaStream_t stream) const;
  // 3. Local stage of chunk j (destination): its plan and its rows into block j of x_perm.
  void receive_chunk(const SavedState& state, int j, uint32_t* error_word, const TensorView& x_perm,
                     cudaStream_t stream) const;
  // 4. Block j of Y gathered into chunk j of the receive buffer in receive order (zero for empty
  //    rows and rows past R_c), ready for the exchange back into the send buffer.
  void gather_chunk(const SavedState& state, int j, const TensorView& Y, cudaStream_t stream) const;
  // What the overlapped pipeline's experts callable gets for chunk j: `in` -> `out`, blocks j of
  // [R, H] buffers, with the chunk's local groups and probs (ep_overlap.cpp).
  EpChunk chunk(const SavedState& state, int j, const TensorView& in, const TensorView& out) const;
  // 5. On the source: each token's slots in slot order, fp32, from the returned rows in the send
  //    buffer (the single-GPU combine kernel).
  void sum_slots(const EpStateLayout& s, int64_t T, const TensorView& y, const float* by_row, const float* by_slot,
                 cudaStream_t stream) const;
  // Combine backward on the source: each send row's gradient w * dy[t] (and <Y row, dy[t]> into
  // dprobs, Y rows read from the send buffer) into the receive buffer, zero on unused rows.
  void scale_grads(const EpStateLayout& s, int64_t T, int64_t send_rows, const TensorView& dy, const float* by_row,
                   const float* by_slot, bool merging, const TensorView* dprobs, bool read_Y,
                   cudaStream_t stream) const;
  // Combine backward on the destination: chunk j's received gradients (send buffer) onto block j of dY.
  void grads_to_rows(const SavedState& state, int j, const TensorView& dY, cudaStream_t stream) const;
  // Dispatch backward on the destination: block j of d_x_perm (and d_probs_perm) into chunk j of
  // the receive buffer (and received probs) in receive order.
  void grads_to_receive_order(const SavedState& state, int j, const TensorView& d_x_perm,
                              const TensorView* d_probs_perm, cudaStream_t stream) const;
  // The exchange back of the dispatch backward, chunks [j0, j1): rows and d_probs.
  void exchange_grads_back(int j0, int j1, cudaStream_t stream) const;
  // Dispatch backward on the source: dx[t] = the token's rows in slot order; dprobs at each slot.
  void sum_grads(const EpStateLayout& s, int64_t T, const TensorView& dx, bool with_probs, const TensorView* dprobs,
                 cudaStream_t stream) const;

  // --- the dropless mode (ep_dropless.cpp): the same ops, sized by the state's host counts ---
  // Refuses a stream that is capturing a CUDA graph (moe::Error naming 'stream' and `call`).
  void check_eager(cudaStream_t stream, const char* call) const;
  // The rank's per-peer rows of the dispatch that filled `state`, and their block starts.
  ep::PeerRows peer_rows(const SavedState& state) const;
  void store_peer_rows(const SavedState& state, const ep::PeerRows& rows) const;
  // One variable-size all_to_all of every lane: forward (send layout -> receive layout) or back.
  void exchange_v(std::initializer_list<Lane> lanes, const ep::PeerRows& rows, bool back, cudaStream_t stream) const;
  void dispatch_dropless(const RoutingView& routing, int64_t T, const TensorView& x, uint32_t* error_word,
                         const SavedState& state, const EpStateLayout& s, const TensorView& x_perm,
                         cudaStream_t stream) const;
  // Y rows of the received rows gathered in receive order and brought back into the send buffer.
  void return_Y_dropless(const SavedState& state, const ep::PeerRows& rows, const TensorView& Y,
                         cudaStream_t stream) const;
  void combine_backward_dropless(const SavedState& state, const EpStateLayout& s, int64_t T, const TensorView& dy,
                                 const TensorView& dY, const float* by_row, const float* by_slot, bool merging,
                                 const TensorView* Y, const TensorView* dprobs, cudaStream_t stream) const;
  void dispatch_backward_dropless(const SavedState& state, const EpStateLayout& s, int64_t T,
                                  const TensorView& d_x_perm, const TensorView& dx, const TensorView* d_probs_perm,
                                  const TensorView* dprobs, cudaStream_t stream) const;
};

}  // namespace moe
