// moe::EpDispatcher: argument checks, workspaces and state layout, and the stages of each op
// (docs/expert_parallel.md). The single-GPU moe::Dispatcher does two of the stages:
//  - the pack plan: the flat slots i = t * slots + s of this source, seen as a top-k routing with
//    k = 1 over P "experts" (their destination ranks), so a destination's entries are ranked in
//    pack order (token, then slot) deterministically; ep_capacity.cu maps those ranks to the
//    capacity layout (d * C + rank, drops past C);
//  - the local stage: the receive buffer seen as a top-k routing with k = 1 over the E_local local
//    experts (expert-major, then receive order), and its permute / backward.
// Everything between them is row movement (permute_rows with a row map) and the all-to-alls.
#include <limits>

#include "device/cuda_check.h"
#include "device/device_arena.h"
#include "device/state_check.h"
#include "ep/ep_kernels.h"
#include "kernels/dispatch_kernels.h"
#include "kernels/routing_args.h"
#include "moe/error.h"
#include "moe/expert_parallel.h"

namespace moe {

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int kMaxRanks = 1024;  // the pack plan's "experts" (moe::Dispatcher's limit)
constexpr int kMaxLocalExperts = 1024;  // the local plan's experts (the same limit)

bool is_arith_dtype(DType t) { return t == DType::kBF16 || t == DType::kFP16 || t == DType::kFP32; }

}  // namespace

// The dispatcher's own part of a state (the local plan follows it).
struct EpStateLayout {
  int32_t* send_slot_row = nullptr;  // [T_max * slots]
  int32_t* send_row_slot = nullptr;  // [P * C]
  float* send_probs = nullptr;       // [P * C]
  int64_t* dropped = nullptr;        // [P]
};

// Per-dispatcher workspaces (shared by all states: calls are stream-ordered).
struct EpWorkspace {
  void* send = nullptr;          // [P * C, H]: the source side of every exchange
  void* recv = nullptr;          // [P * C, H]: the destination side
  int32_t* send_expert = nullptr;  // [P * C]
  int32_t* recv_expert = nullptr;  // [P * C]
  float* recv_probs = nullptr;     // [P * C]
  float* back_probs = nullptr;     // [P * C]: d_probs of the dispatch backward at the source
  int32_t* slot_dest = nullptr;    // [T_max * slots]
};

struct EpDispatcher::Impl {
  EpDispatcherConfig cfg;
  EpTransport* transport = nullptr;
  uint64_t serial = next_op_serial();
  int P = 0, slots = 0;
  int64_t C = 0, PC = 0, R = 0, row_bytes = 0;
  std::unique_ptr<Dispatcher> pack, local;
  SavedState pack_plan;
  DeviceBuffer ws_memory;
  EpWorkspace ws;
  size_t own_bytes = 0, local_bytes = 0;

  EpStateLayout carve_state(char* base, size_t* bytes = nullptr) const {
    DeviceArena a(base);
    EpStateLayout s;
    s.send_slot_row = a.take<int32_t>(cfg.max_tokens * slots);
    s.send_row_slot = a.take<int32_t>(PC);
    s.send_probs = a.take<float>(PC);
    s.dropped = a.take<int64_t>(P);
    if (bytes) *bytes = a.used();
    return s;
  }
  EpWorkspace carve_workspace(char* base, size_t* bytes = nullptr) const {
    DeviceArena a(base);
    EpWorkspace w;
    w.send = a.take<char>(PC * row_bytes);
    w.recv = a.take<char>(PC * row_bytes);
    w.send_expert = a.take<int32_t>(PC);
    w.recv_expert = a.take<int32_t>(PC);
    w.recv_probs = a.take<float>(PC);
    w.back_probs = a.take<float>(PC);
    w.slot_dest = a.take<int32_t>(cfg.max_tokens * slots);
    if (bytes) *bytes = a.used();
    return w;
  }

  SavedState local_state(const SavedState& state) const { return state.slice(own_bytes, local_bytes, 1, 1); }

  // The layout of a filled state of this dispatcher, and its T.
  EpStateLayout filled(const SavedState& state, const char* call, int64_t* T) const {
    check_state_capacity(state, "state", own_bytes + local_bytes, kStateHeaders);
    check_state(state, "state", serial, StateKind::kDispatchPlan, {StateStatus::kFilled}, call);
    *T = state.header(0).tokens;
    return carve_state(static_cast<char*>(state.device()));
  }

  TensorView rows_view(void* p, int64_t rows) const { return TensorView(p, cfg.row_dtype, {rows, cfg.hidden}); }
  void check_rows(const TensorView& t, const char* name, int64_t rows) const {
    check_device_tensor(t, name, cfg.row_dtype, {rows, cfg.hidden});
  }

  void exchange_rows(const void* send, void* recv, cudaStream_t stream) const {
    const EpExchange x{send, recv, static_cast<size_t>(C * row_bytes)};
    transport->all_to_all(&x, 1, stream);
  }

  // Each received row's expert output Y (in receive order, zero for empty rows) back to its source:
  // on return the send buffer holds them in send-row order.
  void return_rows(const TensorView& Y, const SavedState& local_plan, cudaStream_t stream) const {
    kernels::launch_permute_rows(Y.data, ws.recv, row_bytes, nullptr, nullptr, 0,
                                 local->slot_rows(local_plan).ptr<int32_t>(), 1, static_cast<int32_t>(PC), stream);
    exchange_rows(ws.recv, ws.send, stream);
  }
};

EpDispatcher::EpDispatcher(const EpDispatcherConfig& config, EpTransport& transport)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  const EpDispatcherConfig& c = config;
  m.cfg = c;
  m.transport = &transport;
  MOE_CHECK(c.ranks >= 1 && c.ranks <= kMaxRanks, "argument 'ranks': expected 1..", kMaxRanks, ", got ", c.ranks);
  MOE_CHECK(transport.ranks() == c.ranks, "argument 'transport': expected a group of ranks = ", c.ranks,
            ", got one of ", transport.ranks());
  MOE_CHECK(c.local_experts >= 1 && c.local_experts <= kMaxLocalExperts, "argument 'local_experts': expected 1..",
            kMaxLocalExperts, ", got ", c.local_experts);
  const int64_t E = int64_t{c.ranks} * c.local_experts;
  MOE_CHECK(E <= kInt32Max, "argument 'local_experts': ranks * local_experts = ", E, " does not fit int32");
  MOE_CHECK(is_arith_dtype(c.row_dtype), "argument 'row_dtype': expected bf16, fp16 or fp32, got ",
            dtype_name(c.row_dtype));
  MOE_CHECK(c.hidden > 0 && dtype_bytes(c.row_dtype, c.hidden) % 16 == 0, "argument 'hidden': expected a row of ",
            "a multiple of 16 bytes, got H = ", c.hidden, " of ", dtype_name(c.row_dtype));
  if (c.form == RoutingForm::kTopK)
    MOE_CHECK(c.topk >= 1 && c.topk <= 1024, "argument 'topk': expected 1..1024, got ", c.topk);
  MOE_CHECK(is_valid_alignment(c.align), "argument 'align': expected one of 0, 16, 32, 64, 128, 256, got ", c.align);
  MOE_CHECK(c.capacity >= 0, "argument 'capacity': expected >= 0 rows per (source, destination) pair, got ",
            c.capacity);
  MOE_CHECK(c.max_tokens >= 0, "argument 'max_tokens': expected >= 0, got ", c.max_tokens);
  MOE_CHECK(c.row_bound >= -1, "argument 'row_bound': expected >= 0, or -1 for the default, got ", c.row_bound);
  m.P = c.ranks;
  m.slots = c.form == RoutingForm::kTopK ? c.topk : static_cast<int>(E);
  m.C = c.capacity;
  m.PC = m.P * m.C;
  MOE_CHECK(m.PC <= kInt32Max / 2, "argument 'capacity': ranks * capacity = ", m.PC,
            " does not fit the int32 row indices");
  m.row_bytes = dtype_bytes(c.row_dtype, c.hidden);

  // Pack plan: T_max * slots one-slot "tokens" over P destination ranks, dropless (R = T_max * slots).
  DispatcherConfig pc;
  pc.max_tokens = c.max_tokens * m.slots;
  pc.num_experts = m.P;
  pc.topk = 1;
  pc.hidden = 4;  // rows never move through this plan
  pc.row_dtype = DType::kFP32;
  pc.form = RoutingForm::kTopK;
  m.pack = std::make_unique<Dispatcher>(pc);
  // Local stage: the P * C received rows, one slot each, over the E_local local experts.
  DispatcherConfig lc;
  lc.max_tokens = m.PC;
  lc.num_experts = c.local_experts;
  lc.topk = 1;
  lc.hidden = c.hidden;
  lc.row_dtype = c.row_dtype;
  lc.form = RoutingForm::kTopK;
  lc.options.align = c.align;
  lc.options.row_bound = c.row_bound;
  m.local = std::make_unique<Dispatcher>(lc);
  m.R = m.local->rows();

  m.carve_state(nullptr, &m.own_bytes);
  m.local_bytes = m.local->plan_bytes();
  size_t ws_bytes = 0;
  m.carve_workspace(nullptr, &ws_bytes);
  m.ws_memory = cuda_malloc_allocator().allocate(ws_bytes);
  m.ws = m.carve_workspace(static_cast<char*>(m.ws_memory.get()));
  m.pack_plan = m.pack->new_plan();
}

EpDispatcher::~EpDispatcher() = default;

const EpDispatcherConfig& EpDispatcher::config() const { return impl_->cfg; }
int EpDispatcher::rank() const { return impl_->transport->rank(); }
int64_t EpDispatcher::rows() const { return impl_->R; }
int64_t EpDispatcher::exchange_rows() const { return impl_->PC; }
int EpDispatcher::slots_per_token() const { return impl_->slots; }
size_t EpDispatcher::state_bytes() const { return impl_->own_bytes + impl_->local_bytes; }

SavedState EpDispatcher::new_state(DeviceAllocator& allocator) const {
  return SavedState::allocate(state_bytes(), kStateHeaders, allocator);
}

void EpDispatcher::plan_and_dispatch(const RoutingView& routing, const TensorView& x, uint32_t* error_word,
                                     const SavedState& state, const TensorView& x_perm, cudaStream_t stream) const {
  const Impl& m = *impl_;
  const EpDispatcherConfig& c = m.cfg;
  const int64_t T = kernels::check_routing_args(routing, error_word, c.form, m.slots, c.max_tokens);
  kernels::EpRouting r;
  r.form = c.form;
  r.T = static_cast<int32_t>(T);
  r.slots = m.slots;
  r.E = c.ranks * c.local_experts;
  r.indices = c.form == RoutingForm::kTopK ? routing.indices.ptr<int32_t>() : nullptr;
  r.map = c.form == RoutingForm::kMap ? routing.map.ptr<uint8_t>() : nullptr;
  r.probs = routing.probs.ptr<float>();
  m.check_rows(x, "x", T);
  m.check_rows(x_perm, "x_perm", m.R);
  check_state_capacity(state, "state", state_bytes(), kStateHeaders);
  const EpStateLayout s = m.carve_state(static_cast<char*>(state.device()));
  const EpWorkspace& w = m.ws;
  const int64_t n = T * m.slots;

  // 1. Pack: destinations (validation on this source), their ranks in pack order, the capacity
  //    layout, then the rows into the send buffer.
  kernels::launch_ep_slot_destinations(r, c.local_experts, w.slot_dest, error_word, stream);
  RoutingView flat;
  flat.form = RoutingForm::kTopK;
  flat.indices = TensorView(w.slot_dest, DType::kInt32, {n, 1});
  flat.probs = TensorView(routing.probs.data, DType::kFP32, {n, 1});
  m.pack->plan(flat, error_word, m.pack_plan, stream);
  kernels::EpCapacityArgs a;
  a.routing = r;
  a.P = m.P;
  a.E_local = c.local_experts;
  a.C = static_cast<int32_t>(m.C);
  a.slot_dest = w.slot_dest;
  a.pack_slot_row = m.pack->slot_rows(m.pack_plan).ptr<int32_t>();
  a.pack_offset = m.pack->offsets(m.pack_plan, DType::kInt32).ptr<int32_t>();
  a.pack_count = m.pack->counts(m.pack_plan, DType::kInt64).ptr<int64_t>();
  a.send_slot_row = s.send_slot_row;
  a.send_row_slot = s.send_row_slot;
  a.send_probs = s.send_probs;
  a.send_expert = w.send_expert;
  a.dropped = s.dropped;
  a.error_word = error_word;
  kernels::launch_ep_capacity(a, stream);
  kernels::launch_permute_rows(x.data, w.send, m.row_bytes, nullptr, nullptr, 0, s.send_row_slot, m.slots,
                               static_cast<int32_t>(m.PC), stream);

  // 2. Exchange: rows, their local experts and their probs.
  const EpExchange xs[3] = {{w.send, w.recv, static_cast<size_t>(m.C * m.row_bytes)},
                            {w.send_expert, w.recv_expert, static_cast<size_t>(m.C) * sizeof(int32_t)},
                            {s.send_probs, w.recv_probs, static_cast<size_t>(m.C) * sizeof(float)}};
  m.transport->all_to_all(xs, 3, stream);

  // 3. Local permute over this rank's experts.
  RoutingView recv;
  recv.form = RoutingForm::kTopK;
  recv.indices = TensorView(w.recv_expert, DType::kInt32, {m.PC, 1});
  recv.probs = TensorView(w.recv_probs, DType::kFP32, {m.PC, 1});
  const SavedState local = m.local_state(state);
  m.local->plan(recv, error_word, local, stream);
  m.local->permute(local, m.rows_view(w.recv, m.PC), x_perm, stream);
  mark_filled(state, m.serial, StateKind::kDispatchPlan, T);
}

void EpDispatcher::combine(const SavedState& state, const TensorView& Y, const TensorView& y, MergeProbs merge,
                           cudaStream_t stream, const TensorView* probs) const {
  const Impl& m = *impl_;
  int64_t T = 0;
  const EpStateLayout s = m.filled(state, "EpDispatcher::combine", &T);
  m.check_rows(Y, "Y", m.R);
  m.check_rows(y, "y", T);
  const float *by_row, *by_slot;
  // Merging weights of the source's sum: the routing probs by send row, or the given ones by slot.
  kernels::merge_weights(merge, probs, s.send_probs, T, m.slots, "EpDispatcher::combine", &by_row, &by_slot);
  const SavedState local = m.local_state(state);
  m.return_rows(Y, local, stream);
  // On the source: the token's slots in slot order, fp32, exactly the single-GPU combine.
  kernels::launch_combine(m.cfg.row_dtype, m.ws.send, y.data, m.cfg.hidden, s.send_slot_row, m.slots,
                          static_cast<int32_t>(T), by_row, by_slot, nullptr, nullptr, stream);
}

void EpDispatcher::combine_backward(const SavedState& state, const TensorView& dy, const TensorView& dY,
                                    MergeProbs merge, cudaStream_t stream, const TensorView* probs,
                                    const TensorView* Y, const TensorView* dprobs) const {
  const Impl& m = *impl_;
  int64_t T = 0;
  const EpStateLayout s = m.filled(state, "EpDispatcher::combine_backward", &T);
  m.check_rows(dy, "dy", T);
  m.check_rows(dY, "dY", m.R);
  const bool merging = merge != MergeProbs::kNone;
  const bool want_dot = merging && dprobs != nullptr;
  MOE_CHECK(!want_dot || Y != nullptr,
            "argument 'Y' of EpDispatcher::combine_backward: the combine's input is needed for dprobs when merging");
  if (want_dot) m.check_rows(*Y, "Y", m.R);
  if (dprobs) check_device_tensor(*dprobs, "dprobs", DType::kFP32, {T, m.slots}, 4);
  const float *by_row, *by_slot;
  kernels::merge_weights(merge, probs, s.send_probs, T, m.slots, "EpDispatcher::combine_backward", &by_row,
                         &by_slot);
  const SavedState local = m.local_state(state);
  // The Y rows travel back to the source again, as in the forward.
  if (want_dot) m.return_rows(*Y, local, stream);
  if (dprobs && T > 0) MOE_CUDA_CHECK(cudaMemsetAsync(dprobs->data, 0, sizeof(float) * T * m.slots, stream));
  // On the source: each send row's gradient w * dy[t] (and <Y row, dy[t]>), zero on unused rows.
  kernels::launch_scale_rows_backward(m.cfg.row_dtype, dy.data, want_dot ? m.ws.send : nullptr, m.ws.recv,
                                      m.cfg.hidden, s.send_row_slot, m.slots, static_cast<int32_t>(m.PC), by_row,
                                      by_slot, merging, want_dot ? dprobs->ptr<float>() : nullptr, stream);
  m.exchange_rows(m.ws.recv, m.ws.send, stream);
  // On the destination: each received row's gradient onto its x_perm row (pad rows zero).
  m.local->permute(local, m.rows_view(m.ws.send, m.PC), dY, stream);
}

void EpDispatcher::dispatch_backward(const SavedState& state, const TensorView& d_x_perm, const TensorView& dx,
                                     cudaStream_t stream, const TensorView* d_probs_perm,
                                     const TensorView* dprobs) const {
  const Impl& m = *impl_;
  int64_t T = 0;
  const EpStateLayout s = m.filled(state, "EpDispatcher::dispatch_backward", &T);
  m.check_rows(d_x_perm, "d_x_perm", m.R);
  m.check_rows(dx, "dx", T);
  if (d_probs_perm) check_device_tensor(*d_probs_perm, "d_probs_perm", DType::kFP32, {m.R}, 4);
  if (dprobs) check_device_tensor(*dprobs, "dprobs", DType::kFP32, {T, m.slots}, 4);
  const SavedState local = m.local_state(state);
  // On the destination: each received row's gradient (its one x_perm row) in receive order.
  const TensorView d_recv_probs(m.ws.recv_probs, DType::kFP32, {m.PC, 1});
  m.local->permute_backward(local, d_x_perm, m.rows_view(m.ws.recv, m.PC), stream, d_probs_perm, &d_recv_probs);
  const EpExchange xs[2] = {{m.ws.recv, m.ws.send, static_cast<size_t>(m.C * m.row_bytes)},
                            {m.ws.recv_probs, m.ws.back_probs, static_cast<size_t>(m.C) * sizeof(float)}};
  m.transport->all_to_all(xs, 2, stream);
  // On the source: dx[t] = the token's rows summed in slot order; dprobs at each slot's row.
  kernels::launch_combine(m.cfg.row_dtype, m.ws.send, dx.data, m.cfg.hidden, s.send_slot_row, m.slots,
                          static_cast<int32_t>(T), nullptr, nullptr, d_probs_perm ? m.ws.back_probs : nullptr,
                          dprobs ? dprobs->ptr<float>() : nullptr, stream);
}

int64_t EpDispatcher::tokens(const SavedState& state) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::tokens", &T);
  return T;
}
TensorView EpDispatcher::group_offsets(const SavedState& state) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::group_offsets", &T);
  return impl_->local->group_offsets(impl_->local_state(state));
}
TensorView EpDispatcher::probs_perm(const SavedState& state) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::probs_perm", &T);
  return impl_->local->probs_perm(impl_->local_state(state));
}
TensorView EpDispatcher::local_counts(const SavedState& state, DType dtype) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::local_counts", &T);
  return impl_->local->counts(impl_->local_state(state), dtype);
}
TensorView EpDispatcher::dropped(const SavedState& state) const {
  int64_t T = 0;
  const EpStateLayout s = impl_->filled(state, "EpDispatcher::dropped", &T);
  return TensorView(s.dropped, DType::kInt64, {impl_->P});
}
TensorView EpDispatcher::slot_rows(const SavedState& state) const {
  int64_t T = 0;
  const EpStateLayout s = impl_->filled(state, "EpDispatcher::slot_rows", &T);
  return TensorView(s.send_slot_row, DType::kInt32, {T, impl_->slots});
}
TensorView EpDispatcher::send_probs(const SavedState& state) const {
  int64_t T = 0;
  const EpStateLayout s = impl_->filled(state, "EpDispatcher::send_probs", &T);
  return TensorView(s.send_probs, DType::kFP32, {impl_->PC});
}
TensorView EpDispatcher::send_buffer() const { return impl_->rows_view(impl_->ws.send, impl_->PC); }
TensorView EpDispatcher::recv_buffer() const { return impl_->rows_view(impl_->ws.recv, impl_->PC); }
TensorView EpDispatcher::recv_probs() const {
  return TensorView(impl_->ws.recv_probs, DType::kFP32, {impl_->PC});
}

}  // namespace moe
