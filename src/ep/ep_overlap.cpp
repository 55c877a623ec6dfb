// The overlapped pipeline of moe::EpDispatcher (docs/expert_parallel.md, Overlapped pipeline):
// the stages of ep_dispatcher_impl.h split over two streams, the caller's compute `stream` and
// `comm_stream`, ordered by the dispatcher's events only (no host synchronisation):
//
//   stream:       pack | wait(arrived 0) local 0, experts 0, gather 0 | wait(arrived 1) ... | wait(done) sum
//   comm_stream:  wait(packed) | chunk 0 -> | chunk 1 -> | ... | wait(gathered 0) <- 0 | ... <- n-1 | done
//
// Every forward exchange is enqueued before the first return: the comm stream then never idles
// behind a chunk's experts while a later chunk could move. Each chunk's buffers are its own rows of
// the send and receive buffers (chunk layout), so a return never overwrites rows a later forward
// exchange still reads, and the final sum reads the send buffer once every return has landed.
// The same kernels run on the same rows as in the stage-by-stage methods: the results are bitwise
// theirs. Every rank must make the same calls (each exchange is a collective).
#include "device/cuda_check.h"
#include "device/state_check.h"
#include "ep/ep_dispatcher_impl.h"
#include "kernels/routing_args.h"
#include "moe/error.h"

namespace moe {

namespace {

// Indices into Impl::events.
constexpr int kPacked = 0;    // compute -> comm: the send buffer is ready
constexpr int kDone = 1;      // comm -> compute: every return landed (the join)
constexpr int kGathered = 2;  // compute -> comm: Y rows gathered (backward with merging dprobs)
constexpr int kReturned = 3;  // comm -> compute: Y rows back on the source
int arrived(int j) { return 4 + 2 * j; }      // comm -> compute: chunk j received
int ready(int j) { return 4 + 2 * j + 1; }    // compute -> comm: chunk j's return gathered

// `to` waits for the work enqueued on `from` so far.
void order(cudaEvent_t e, cudaStream_t from, cudaStream_t to) {
  MOE_CUDA_CHECK(cudaEventRecord(e, from));
  MOE_CUDA_CHECK(cudaStreamWaitEvent(to, e, 0));
}

}  // namespace

EpChunk EpDispatcher::Impl::chunk(const SavedState& state, int j, const TensorView& in, const TensorView& out) const {
  EpChunk c;
  c.index = j;
  c.in = block(in, j);
  c.out = block(out, j);
  c.group_offsets = local->group_offsets(local_state(state, j));
  c.probs_perm = local->probs_perm(local_state(state, j));
  return c;
}

void EpDispatcher::forward_overlapped(const RoutingView& routing, const TensorView& x, uint32_t* error_word,
                                      const SavedState& state, const TensorView& x_perm, const TensorView& Y,
                                      const TensorView& y, MergeProbs merge, const EpChunkFn& experts,
                                      cudaStream_t stream, cudaStream_t comm_stream, const TensorView* probs) const {
  const Impl& m = *impl_;
  MOE_CHECK(!m.dropless, "argument 'mode' (config) of EpDispatcher::forward_overlapped: the overlapped pipeline is ",
            "capacity mode only, got EpMode::kDroplessEager");
  const int64_t T = kernels::check_routing_args(routing, error_word, m.cfg.form, m.slots, m.cfg.max_tokens);
  m.check_rows(x, "x", T);
  m.check_rows(x_perm, "x_perm", m.R);
  m.check_rows(Y, "Y", m.R);
  m.check_rows(y, "y", T);
  MOE_CHECK(static_cast<bool>(experts), "argument 'experts' of EpDispatcher::forward_overlapped: expected a function");
  check_state_capacity(state, "state", m.state_bytes(), m.state_headers());
  const EpStateLayout s = m.carve_state(static_cast<char*>(state.device()));
  const float *by_row, *by_slot;
  kernels::merge_weights(merge, probs, s.send_probs, T, m.slots, "EpDispatcher::forward_overlapped", &by_row,
                         &by_slot);
  const auto ev = [&](int i) { return m.events[i]; };

  m.pack_rows(routing, T, x, error_word, s, stream);
  order(ev(kPacked), stream, comm_stream);
  for (int j = 0; j < m.n; ++j) {
    m.exchange_forward(s, j, j + 1, comm_stream);
    MOE_CUDA_CHECK(cudaEventRecord(ev(arrived(j)), comm_stream));
  }
  mark_filled(state, m.serial, StateKind::kDispatchPlan, T);  // the views below read the state
  for (int j = 0; j < m.n; ++j) {
    MOE_CUDA_CHECK(cudaStreamWaitEvent(stream, ev(arrived(j)), 0));
    m.receive_chunk(state, j, error_word, x_perm, stream);
    experts(m.chunk(state, j, x_perm, Y), stream);
    m.gather_chunk(state, j, Y, stream);
    order(ev(ready(j)), stream, comm_stream);
    m.exchange({{m.ws.recv, m.ws.send, m.row_bytes}}, j, j + 1, comm_stream);
  }
  order(ev(kDone), comm_stream, stream);
  m.sum_slots(s, T, y, by_row, by_slot, stream);
}

void EpDispatcher::backward_overlapped(const SavedState& state, const TensorView& dy, const TensorView& dY,
                                       const TensorView& d_x_perm, const TensorView& dx, MergeProbs merge,
                                       const EpChunkFn& experts_backward, cudaStream_t stream,
                                       cudaStream_t comm_stream, const EpBackwardOptions& opt) const {
  const Impl& m = *impl_;
  MOE_CHECK(!m.dropless, "argument 'mode' (config) of EpDispatcher::backward_overlapped: the overlapped pipeline is ",
            "capacity mode only, got EpMode::kDroplessEager");
  int64_t T = 0;
  const EpStateLayout s = m.filled(state, "EpDispatcher::backward_overlapped", &T);
  m.check_rows(dy, "dy", T);
  m.check_rows(dY, "dY", m.R);
  m.check_rows(d_x_perm, "d_x_perm", m.R);
  m.check_rows(dx, "dx", T);
  MOE_CHECK(static_cast<bool>(experts_backward),
            "argument 'experts_backward' of EpDispatcher::backward_overlapped: expected a function");
  const bool merging = merge != MergeProbs::kNone;
  const bool want_dot = merging && opt.dprobs_combine != nullptr;
  MOE_CHECK(!want_dot || opt.Y != nullptr, "argument 'Y' of EpDispatcher::backward_overlapped: the combine's input ",
            "is needed for dprobs_combine when merging");
  if (want_dot) m.check_rows(*opt.Y, "Y", m.R);
  if (opt.dprobs_combine) check_device_tensor(*opt.dprobs_combine, "dprobs_combine", DType::kFP32, {T, m.slots}, 4);
  if (opt.d_probs_perm) check_device_tensor(*opt.d_probs_perm, "d_probs_perm", DType::kFP32, {m.R}, 4);
  if (opt.dprobs) check_device_tensor(*opt.dprobs, "dprobs", DType::kFP32, {T, m.slots}, 4);
  const float *by_row, *by_slot;
  kernels::merge_weights(merge, opt.probs, s.send_probs, T, m.slots, "EpDispatcher::backward_overlapped", &by_row,
                         &by_slot);
  const auto ev = [&](int i) { return m.events[i]; };

  // The Y rows back to the source for the dot products (all chunks: nothing to overlap them with).
  if (want_dot) {
    for (int j = 0; j < m.n; ++j) m.gather_chunk(state, j, *opt.Y, stream);
    order(ev(kGathered), stream, comm_stream);
    m.exchange({{m.ws.recv, m.ws.send, m.row_bytes}}, 0, m.n, comm_stream);
    order(ev(kReturned), comm_stream, stream);
  }
  // Combine backward on the source, then each chunk's gradients to the destinations.
  m.scale_grads(s, T, m.PC, dy, by_row, by_slot, merging, opt.dprobs_combine, want_dot, stream);
  order(ev(kPacked), stream, comm_stream);
  for (int j = 0; j < m.n; ++j) {
    m.exchange({{m.ws.recv, m.ws.send, m.row_bytes}}, j, j + 1, comm_stream);
    MOE_CUDA_CHECK(cudaEventRecord(ev(arrived(j)), comm_stream));
  }
  for (int j = 0; j < m.n; ++j) {
    MOE_CUDA_CHECK(cudaStreamWaitEvent(stream, ev(arrived(j)), 0));
    m.grads_to_rows(state, j, dY, stream);
    EpChunk c = m.chunk(state, j, dY, d_x_perm);
    if (opt.d_probs_perm) c.d_probs_perm = m.probs_block(*opt.d_probs_perm, j);
    experts_backward(c, stream);
    // Dispatch backward: chunk j's gradients (and d_probs) back to their sources.
    m.grads_to_receive_order(state, j, d_x_perm, opt.d_probs_perm, stream);
    order(ev(ready(j)), stream, comm_stream);
    m.exchange_grads_back(j, j + 1, comm_stream);
  }
  order(ev(kDone), comm_stream, stream);
  m.sum_grads(s, T, dx, opt.d_probs_perm != nullptr, opt.dprobs, stream);
}

}  // namespace moe
