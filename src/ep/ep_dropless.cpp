// The dropless eager mode of moe::EpDispatcher (docs/expert_parallel.md, Dropless mode): the ops of
// ep_dispatcher.cpp with every entry sent. plan_and_dispatch packs with the pack plan's own rows
// (destinations back to back), exchanges the count matrix, synchronises the stream once to read it
// on the host, keeps the rank's per-peer row counts in the state's headers, and then moves exactly
// those rows with variable-size exchanges; combine and both backwards read the counts from the state
// (no further synchronisation) and run the capacity mode's kernels over the counted rows.
// Argument checks happen in the public methods before these run.
#include <algorithm>
#include <array>
#include <cstring>

#include "device/cuda_check.h"
#include "ep/ep_dispatcher_impl.h"
#include "ep/ep_kernels.h"
#include "kernels/dispatch_kernels.h"
#include "moe/error.h"

namespace moe {

void EpDispatcher::Impl::check_eager(cudaStream_t stream, const char* call) const {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &status));
  MOE_CHECK(status == cudaStreamCaptureStatusNone, "argument 'stream' of ", call,
            ": the stream is capturing a CUDA graph, and the dropless mode (config.mode = EpMode::kDroplessEager) ",
            "is not capturable: it reads the per-pair row counts on the host and sizes its exchanges with them, so a ",
            "replay would move the rows of the captured dispatch; use EpMode::kCapacity in graphs");
}

// Counts per header: a StateHeader is 64 plain bytes, 8 int64.
constexpr int kCountsPerHeader = sizeof(StateHeader) / sizeof(int64_t);

void EpDispatcher::Impl::store_peer_rows(const SavedState& state, const ep::PeerRows& rows) const {
  const int first = 1 + n;
  for (int i = 0; i < 2 * P; ++i) {
    const int64_t v = i < P ? rows.send[i] : rows.recv[i - P];
    std::memcpy(reinterpret_cast<char*>(&state.header(first + i / kCountsPerHeader)) +
                    (i % kCountsPerHeader) * sizeof(int64_t),
                &v, sizeof(v));
  }
}

ep::PeerRows EpDispatcher::Impl::peer_rows(const SavedState& state) const {
  const int first = 1 + n;
  std::vector<int64_t> send(P), recv(P);
  for (int i = 0; i < 2 * P; ++i) {
    int64_t v = 0;
    std::memcpy(&v,
                reinterpret_cast<const char*>(&state.header(first + i / kCountsPerHeader)) +
                    (i % kCountsPerHeader) * sizeof(int64_t),
                sizeof(v));
    (i < P ? send[i] : recv[i - P]) = v;
  }
  return ep::peer_rows(send, recv);
}

void EpDispatcher::Impl::exchange_v(std::initializer_list<Lane> lanes, const ep::PeerRows& rows, bool back,
                                    cudaStream_t stream) const {
  std::array<ep::LaneSpans, 3> spans;
  std::array<EpVarExchange, 3> xs;
  int count = 0;
  for (const Lane& l : lanes) {
    const ep::LaneSpans forward = ep::lane_spans(rows, l.bytes);
    spans[count] = back ? ep::reverse(forward) : forward;
    const ep::LaneSpans& sp = spans[count];
    xs[count] = {l.send, l.recv, sp.send_bytes.data(), sp.send_offsets.data(), sp.recv_bytes.data(),
                 sp.recv_offsets.data()};
    ++count;
  }
  transport->all_to_all_v(xs.data(), count, stream);
}

void EpDispatcher::Impl::dispatch_dropless(const RoutingView& routing, int64_t T, const TensorView& x,
                                           uint32_t* error_word, const SavedState& state, const EpStateLayout& s,
                                           const TensorView& x_perm, cudaStream_t stream) const {
  // 1. Pack plan and layout (the pack plan's rows), and the send side of the counts exchange.
  const kernels::EpRouting r = ep_routing(routing, T);
  plan_pack(r, routing, error_word, stream);
  kernels::EpDroplessArgs a;
  a.routing = r;
  a.P = P;
  a.E_local = cfg.local_experts;
  a.slot_dest = ws.slot_dest;
  a.pack_slot_row = pack->slot_rows(pack_plan).ptr<int32_t>();
  a.pack_count = pack->counts(pack_plan, DType::kInt64).ptr<int64_t>();
  a.send_slot_row = s.send_slot_row;
  a.send_row_slot = s.send_row_slot;
  a.send_probs = s.send_probs;
  a.send_expert = ws.send_expert;
  a.count_blocks = ws.count_send;
  kernels::launch_ep_dropless(a, stream);
  MOE_CUDA_CHECK(cudaMemsetAsync(s.dropped, 0, sizeof(int64_t) * P, stream));  // nothing is ever dropped

  // 2. The counts exchange: every rank's count vector to every rank, then the one synchronisation.
  const EpExchange counts{ws.count_send, ws.count_recv, sizeof(int64_t) * P};
  transport->all_to_all(&counts, 1, stream);
  MOE_CUDA_CHECK(
      cudaMemcpyAsync(host_counts, ws.count_recv, sizeof(int64_t) * P * P, cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  // Every rank checks the same matrix: all throw together (no collective left waiting), before any
  // row moves. The state's device part was rewritten above: it is left empty.
  try {
    ep::check_counts(host_counts, P, S, M);
  } catch (...) {
    SavedState headers = state;  // a copy shares the caller's headers
    headers.reset();
    throw;
  }
  const ep::PeerRows rows = ep::peer_rows_of(host_counts, P, transport->rank());
  store_peer_rows(state, rows);

  // 3. The rows into the send buffer (all of its first send_total rows are used), then the rows,
  //    their local experts and their probs to their destinations.
  kernels::launch_permute_rows(x.data, ws.send, row_bytes, nullptr, nullptr, 0, s.send_row_slot, slots,
                               static_cast<int32_t>(rows.send_total), stream);
  exchange_v({{ws.send, ws.recv, row_bytes},
              {ws.send_expert, ws.recv_expert, int64_t{sizeof(int32_t)}},
              {s.send_probs, ws.recv_probs, int64_t{sizeof(float)}}},
             rows, /*back=*/false, stream);

  // 4. The local stage over exactly the received rows.
  RoutingView recv;
  recv.form = RoutingForm::kTopK;
  recv.indices = TensorView(ws.recv_expert, DType::kInt32, {rows.recv_total, 1});
  recv.probs = TensorView(ws.recv_probs, DType::kFP32, {rows.recv_total, 1});
  const SavedState plan = local_state(state, 0);
  local->plan(recv, error_word, plan, stream);
  local->permute(plan, rows_view(ws.recv, rows.recv_total), x_perm, stream);
}

void EpDispatcher::Impl::return_Y_dropless(const SavedState& state, const ep::PeerRows& rows, const TensorView& Y,
                                           cudaStream_t stream) const {
  kernels::launch_permute_rows(Y.data, ws.recv, row_bytes, nullptr, nullptr, 0,
                               local->slot_rows(local_state(state, 0)).ptr<int32_t>(), 1,
                               static_cast<int32_t>(rows.recv_total), stream);
  exchange_v({{ws.recv, ws.send, row_bytes}}, rows, /*back=*/true, stream);
}

void EpDispatcher::Impl::combine_backward_dropless(const SavedState& state, const EpStateLayout& s, int64_t T,
                                                   const TensorView& dy, const TensorView& dY, const float* by_row,
                                                   const float* by_slot, bool merging, const TensorView* Y,
                                                   const TensorView* dprobs, cudaStream_t stream) const {
  const ep::PeerRows rows = peer_rows(state);
  // The Y rows travel back to the source again, as in the forward.
  if (Y) return_Y_dropless(state, rows, *Y, stream);
  scale_grads(s, T, rows.send_total, dy, by_row, by_slot, merging, dprobs, Y != nullptr, stream);
  exchange_v({{ws.recv, ws.send, row_bytes}}, rows, /*back=*/false, stream);
  local->permute(local_state(state, 0), rows_view(ws.send, rows.recv_total), dY, stream);
}

void EpDispatcher::Impl::dispatch_backward_dropless(const SavedState& state, const EpStateLayout& s, int64_t T,
                                                    const TensorView& d_x_perm, const TensorView& dx,
                                                    const TensorView* d_probs_perm, const TensorView* dprobs,
                                                    cudaStream_t stream) const {
  const ep::PeerRows rows = peer_rows(state);
  const TensorView d_recv_probs(ws.recv_probs, DType::kFP32, {rows.recv_total, 1});
  local->permute_backward(local_state(state, 0), d_x_perm, rows_view(ws.recv, rows.recv_total), stream, d_probs_perm,
                          &d_recv_probs);
  exchange_v({{ws.recv, ws.send, row_bytes}, {ws.recv_probs, ws.back_probs, int64_t{sizeof(float)}}}, rows,
             /*back=*/true, stream);
  sum_grads(s, T, dx, d_probs_perm != nullptr, dprobs, stream);
}

}  // namespace moe
