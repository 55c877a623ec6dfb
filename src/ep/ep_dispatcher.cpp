// moe::EpDispatcher: argument checks, workspaces and state layout, the stages of each op
// (ep_dispatcher_impl.h) and the stage-by-stage methods, all on the caller's one stream
// (docs/expert_parallel.md). The overlapped pipeline over the same stages is ep_overlap.cpp; the
// dropless mode's ops, which the methods here hand over to after their argument checks, are
// ep_dropless.cpp.
#include <algorithm>
#include <limits>

#include "device/cuda_check.h"
#include "device/device_arena.h"
#include "device/state_check.h"
#include "ep/ep_dispatcher_impl.h"
#include "ep/ep_kernels.h"
#include "kernels/dispatch_kernels.h"
#include "kernels/routing_args.h"
#include "moe/error.h"

namespace moe {

namespace {

constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();
constexpr int kMaxRanks = 1024;  // the pack plan's "experts" (moe::Dispatcher's limit)
constexpr int kMaxLocalExperts = 1024;  // the local plan's experts (the same limit)

bool is_arith_dtype(DType t) { return t == DType::kBF16 || t == DType::kFP16 || t == DType::kFP32; }

}  // namespace

// ---- Impl: layout ----

EpDispatcher::Impl::~Impl() {
  for (cudaEvent_t e : events) cudaEventDestroy(e);  // no throw from a destructor
  if (host_counts) cudaFreeHost(host_counts);
}

EpStateLayout EpDispatcher::Impl::carve_state(char* base, size_t* bytes) const {
  DeviceArena a(base);
  EpStateLayout s;
  s.send_slot_row = a.take<int32_t>(cfg.max_tokens * slots);
  s.send_row_slot = a.take<int32_t>(S);
  s.send_probs = a.take<float>(S);
  s.dropped = a.take<int64_t>(P);
  if (bytes) *bytes = a.used();
  return s;
}

EpWorkspace EpDispatcher::Impl::carve_workspace(char* base, size_t* bytes) const {
  DeviceArena a(base);
  EpWorkspace w;
  w.send = a.take<char>(B * row_bytes);
  w.recv = a.take<char>(B * row_bytes);
  w.send_expert = a.take<int32_t>(B);
  w.recv_expert = a.take<int32_t>(B);
  w.recv_probs = a.take<float>(B);
  w.back_probs = a.take<float>(B);
  w.slot_dest = a.take<int32_t>(cfg.max_tokens * slots);
  if (dropless) {
    w.count_send = a.take<int64_t>(int64_t{P} * P);
    w.count_recv = a.take<int64_t>(int64_t{P} * P);
  }
  if (bytes) *bytes = a.used();
  return w;
}

EpStateLayout EpDispatcher::Impl::filled(const SavedState& state, const char* call, int64_t* T) const {
  check_state_capacity(state, "state", state_bytes(), state_headers());
  check_state(state, "state", serial, StateKind::kDispatchPlan, {StateStatus::kFilled}, call);
  *T = state.header(0).tokens;
  return carve_state(static_cast<char*>(state.device()));
}

void EpDispatcher::Impl::check_chunk(int chunk) const {
  MOE_CHECK(chunk >= 0 && chunk < n, "argument 'chunk': expected 0..", n - 1, " (config.chunks = ", n, "), got ",
            chunk);
}

void EpDispatcher::Impl::exchange(std::initializer_list<Lane> lanes, int j0, int j1, cudaStream_t stream) const {
  std::array<EpExchange, 3 * kEpMaxChunks> xs;
  int count = 0;
  for (int j = j0; j < j1; ++j)
    for (const Lane& l : lanes) {
      const int64_t first = layout.first_row(j) * l.bytes;
      xs[count++] = {static_cast<const char*>(l.send) + first, static_cast<char*>(l.recv) + first,
                     static_cast<size_t>(layout.size(j) * l.bytes)};
    }
  transport->all_to_all(xs.data(), count, stream);
}

// ---- Impl: stages ----

kernels::EpRouting EpDispatcher::Impl::ep_routing(const RoutingView& routing, int64_t T) const {
  kernels::EpRouting r;
  r.form = cfg.form;
  r.T = static_cast<int32_t>(T);
  r.slots = slots;
  r.E = cfg.ranks * cfg.local_experts;
  r.indices = cfg.form == RoutingForm::kTopK ? routing.indices.ptr<int32_t>() : nullptr;
  r.map = cfg.form == RoutingForm::kMap ? routing.map.ptr<uint8_t>() : nullptr;
  r.probs = routing.probs.ptr<float>();
  return r;
}

void EpDispatcher::Impl::plan_pack(const kernels::EpRouting& r, const RoutingView& routing, uint32_t* error_word,
                                   cudaStream_t stream) const {
  const int64_t n_slots = int64_t{r.T} * slots;
  kernels::launch_ep_slot_destinations(r, cfg.local_experts, ws.slot_dest, error_word, stream);
  RoutingView flat;
  flat.form = RoutingForm::kTopK;
  flat.indices = TensorView(ws.slot_dest, DType::kInt32, {n_slots, 1});
  flat.probs = TensorView(routing.probs.data, DType::kFP32, {n_slots, 1});
  pack->plan(flat, error_word, pack_plan, stream);
}

void EpDispatcher::Impl::pack_rows(const RoutingView& routing, int64_t T, const TensorView& x, uint32_t* error_word,
                                   const EpStateLayout& s, cudaStream_t stream) const {
  const kernels::EpRouting r = ep_routing(routing, T);
  plan_pack(r, routing, error_word, stream);
  kernels::EpCapacityArgs a;
  a.routing = r;
  a.P = P;
  a.E_local = cfg.local_experts;
  a.C = static_cast<int32_t>(C);
  a.chunks = n;
  a.slot_dest = ws.slot_dest;
  a.pack_slot_row = pack->slot_rows(pack_plan).ptr<int32_t>();
  a.pack_offset = pack->offsets(pack_plan, DType::kInt32).ptr<int32_t>();
  a.pack_count = pack->counts(pack_plan, DType::kInt64).ptr<int64_t>();
  a.send_slot_row = s.send_slot_row;
  a.send_row_slot = s.send_row_slot;
  a.send_probs = s.send_probs;
  a.send_expert = ws.send_expert;
  a.dropped = s.dropped;
  a.error_word = error_word;
  kernels::launch_ep_capacity(a, stream);
  kernels::launch_permute_rows(x.data, ws.send, row_bytes, nullptr, nullptr, 0, s.send_row_slot, slots,
                               static_cast<int32_t>(PC), stream);
}

void EpDispatcher::Impl::exchange_forward(const EpStateLayout& s, int j0, int j1, cudaStream_t stream) const {
  exchange({{ws.send, ws.recv, row_bytes},
            {ws.send_expert, ws.recv_expert, int64_t{sizeof(int32_t)}},
            {s.send_probs, ws.recv_probs, int64_t{sizeof(float)}}},
           j0, j1, stream);
}

void EpDispatcher::Impl::receive_chunk(const SavedState& state, int j, uint32_t* error_word, const TensorView& x_perm,
                                       cudaStream_t stream) const {
  const int64_t rows = chunk_exchange_rows(j), first = layout.first_row(j);
  RoutingView recv;
  recv.form = RoutingForm::kTopK;
  recv.indices = TensorView(ws.recv_expert + first, DType::kInt32, {rows, 1});
  recv.probs = TensorView(ws.recv_probs + first, DType::kFP32, {rows, 1});
  const SavedState plan = local_state(state, j);
  local->plan(recv, error_word, plan, stream);
  local->permute(plan, rows_view(chunk_rows(ws.recv, j), rows), block(x_perm, j), stream);
}

void EpDispatcher::Impl::gather_chunk(const SavedState& state, int j, const TensorView& Y, cudaStream_t stream) const {
  kernels::launch_permute_rows(block(Y, j).data, chunk_rows(ws.recv, j), row_bytes, nullptr, nullptr, 0,
                               local->slot_rows(local_state(state, j)).ptr<int32_t>(), 1,
                               static_cast<int32_t>(chunk_exchange_rows(j)), stream);
}

void EpDispatcher::Impl::sum_slots(const EpStateLayout& s, int64_t T, const TensorView& y, const float* by_row,
                                   const float* by_slot, cudaStream_t stream) const {
  kernels::launch_combine(cfg.row_dtype, ws.send, y.data, cfg.hidden, s.send_slot_row, slots,
                          static_cast<int32_t>(T), by_row, by_slot, nullptr, nullptr, stream);
}

void EpDispatcher::Impl::scale_grads(const EpStateLayout& s, int64_t T, int64_t send_rows, const TensorView& dy,
                                     const float* by_row,
                                     const float* by_slot, bool merging, const TensorView* dprobs, bool read_Y,
                                     cudaStream_t stream) const {
  if (dprobs && T > 0) MOE_CUDA_CHECK(cudaMemsetAsync(dprobs->data, 0, sizeof(float) * T * slots, stream));
  kernels::launch_scale_rows_backward(cfg.row_dtype, dy.data, read_Y ? ws.send : nullptr, ws.recv, cfg.hidden,
                                      s.send_row_slot, slots, static_cast<int32_t>(send_rows), by_row, by_slot, merging,
                                      read_Y ? dprobs->ptr<float>() : nullptr, stream);
}

void EpDispatcher::Impl::grads_to_rows(const SavedState& state, int j, const TensorView& dY,
                                       cudaStream_t stream) const {
  local->permute(local_state(state, j), rows_view(chunk_rows(ws.send, j), chunk_exchange_rows(j)), block(dY, j),
                 stream);
}

void EpDispatcher::Impl::grads_to_receive_order(const SavedState& state, int j, const TensorView& d_x_perm,
                                                const TensorView* d_probs_perm, cudaStream_t stream) const {
  const int64_t rows = chunk_exchange_rows(j);
  const TensorView d_recv_probs(ws.recv_probs + layout.first_row(j), DType::kFP32, {rows, 1});
  const TensorView dpp = d_probs_perm ? probs_block(*d_probs_perm, j) : TensorView();
  local->permute_backward(local_state(state, j), block(d_x_perm, j), rows_view(chunk_rows(ws.recv, j), rows), stream,
                          d_probs_perm ? &dpp : nullptr, &d_recv_probs);
}

void EpDispatcher::Impl::exchange_grads_back(int j0, int j1, cudaStream_t stream) const {
  exchange({{ws.recv, ws.send, row_bytes}, {ws.recv_probs, ws.back_probs, int64_t{sizeof(float)}}}, j0, j1, stream);
}

void EpDispatcher::Impl::sum_grads(const EpStateLayout& s, int64_t T, const TensorView& dx, bool with_probs,
                                   const TensorView* dprobs, cudaStream_t stream) const {
  kernels::launch_combine(cfg.row_dtype, ws.send, dx.data, cfg.hidden, s.send_slot_row, slots,
                          static_cast<int32_t>(T), nullptr, nullptr, with_probs ? ws.back_probs : nullptr,
                          dprobs ? dprobs->ptr<float>() : nullptr, stream);
}

// ---- construction ----

EpDispatcher::EpDispatcher(const EpDispatcherConfig& config, EpTransport& transport)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  const EpDispatcherConfig& c = config;
  m.cfg = c;
  m.transport = &transport;
  m.serial = next_op_serial();
  MOE_CHECK(c.mode == EpMode::kCapacity || c.mode == EpMode::kDroplessEager,
            "argument 'mode': expected EpMode::kCapacity or EpMode::kDroplessEager, got ", static_cast<int>(c.mode));
  MOE_CHECK(c.ranks >= 1 && c.ranks <= kMaxRanks, "argument 'ranks': expected 1..", kMaxRanks, ", got ", c.ranks);
  MOE_CHECK(transport.ranks() == c.ranks, "argument 'transport': expected a group of ranks = ", c.ranks,
            ", got one of ", transport.ranks());
  MOE_CHECK(c.local_experts >= 1 && c.local_experts <= kMaxLocalExperts, "argument 'local_experts': expected 1..",
            kMaxLocalExperts, ", got ", c.local_experts);
  const int64_t E = int64_t{c.ranks} * c.local_experts;
  MOE_CHECK(E <= kInt32Max, "argument 'local_experts': ranks * local_experts = ", E, " does not fit int32");
  MOE_CHECK(is_arith_dtype(c.row_dtype), "argument 'row_dtype': expected bf16, fp16 or fp32, got ",
            dtype_name(c.row_dtype));
  MOE_CHECK(c.hidden > 0 && c.hidden <= kInt32Max && dtype_bytes(c.row_dtype, c.hidden) % 16 == 0,
            "argument 'hidden': expected a row of ",
            "a multiple of 16 bytes, got H = ", c.hidden, " of ", dtype_name(c.row_dtype));
  if (c.form == RoutingForm::kTopK)
    MOE_CHECK(c.topk >= 1 && c.topk <= 1024, "argument 'topk': expected 1..1024, got ", c.topk);
  MOE_CHECK(is_valid_alignment(c.align), "argument 'align': expected one of 0, 16, 32, 64, 128, 256, got ", c.align);
  MOE_CHECK(c.capacity >= 0, "argument 'capacity': expected >= 0 rows per (source, destination) pair, got ",
            c.capacity);
  MOE_CHECK(c.max_tokens >= 0, "argument 'max_tokens': expected >= 0, got ", c.max_tokens);
  MOE_CHECK(c.row_bound >= -1, "argument 'row_bound': expected >= 0, or -1 for the default, got ", c.row_bound);
  // Every chunk carries at least one row of each pair (an empty chunk would be an exchange of
  // nothing); at most kEpMaxChunks, far past any useful overlap, so one exchange list of all chunks
  // fits on the stack.
  m.dropless = c.mode == EpMode::kDroplessEager;
  m.P = c.ranks;
  m.slots = c.form == RoutingForm::kTopK ? c.topk : static_cast<int>(E);
  // Every product below is bounded by division first, so that none can wrap into a small buffer.
  MOE_CHECK(c.max_tokens <= kInt32Max / 2 / m.slots, "argument 'max_tokens': expected at most ",
            kInt32Max / 2 / m.slots, " (T_max x ", m.slots, " slots must fit the int32 row indices), got ",
            c.max_tokens);
  if (m.dropless) {
    MOE_CHECK(c.chunks == 1, "argument 'chunks': the overlapped pipeline is capacity mode only, expected 1 with ",
              "mode = EpMode::kDroplessEager, got ", c.chunks);
    MOE_CHECK(c.dropless_max_rows >= -1, "argument 'dropless_max_rows': expected >= 0 rows, or -1 for the worst ",
              "case, got ", c.dropless_max_rows);
    // A token reaches a rank at most once per local expert, so P * T_max * min(slots, E_local) rows
    // is what one rank can receive at most.
    const int64_t per_token = m.P * std::min<int64_t>(m.slots, c.local_experts);
    MOE_CHECK(c.dropless_max_rows >= 0 || c.max_tokens <= kInt32Max / 2 / per_token, "argument ",
              "'dropless_max_rows': its default, the most a rank can receive, ranks x T_max x min(slots, ",
              "local_experts) = ", m.P, " x ", c.max_tokens, " x ", per_token / m.P, ", does not fit the int32 row ",
              "indices; give a bound");
    m.M = c.dropless_max_rows >= 0 ? c.dropless_max_rows : c.max_tokens * per_token;
    m.S = c.max_tokens * m.slots;
    m.B = std::max(m.S, m.M);
    MOE_CHECK(m.B <= kInt32Max / 2, "argument 'dropless_max_rows': max(T_max * slots, dropless_max_rows) = ", m.B,
              " does not fit the int32 row indices");
  } else {
    const int64_t max_chunks = std::min<int64_t>(kEpMaxChunks, std::max<int64_t>(c.capacity, 1));
    MOE_CHECK(c.chunks >= 1 && c.chunks <= max_chunks, "argument 'chunks': expected 1..", max_chunks,
              " (at most 64 and at most capacity = ", c.capacity, "), got ", c.chunks);
    MOE_CHECK(c.capacity <= kInt32Max / 2 / m.P, "argument 'capacity': expected at most ", kInt32Max / 2 / m.P,
              " rows per pair (ranks x capacity must fit the int32 row indices), got ", c.capacity);
    m.C = c.capacity;
    m.PC = m.P * m.C;
    MOE_CHECK(m.PC <= kInt32Max / 2, "argument 'capacity': ranks * capacity = ", m.PC,
              " does not fit the int32 row indices");
    m.S = m.B = m.PC;
  }
  m.n = c.chunks;
  m.row_bytes = dtype_bytes(c.row_dtype, c.hidden);
  m.layout = ep::ChunkLayout{m.P, m.C, m.n};

  // Pack plan: T_max * slots one-slot "tokens" over P destination ranks, dropless (R = T_max * slots).
  DispatcherConfig pc;
  pc.max_tokens = c.max_tokens * m.slots;
  pc.num_experts = m.P;
  pc.topk = 1;
  pc.hidden = 4;  // rows never move through this plan
  pc.row_dtype = DType::kFP32;
  pc.form = RoutingForm::kTopK;
  m.pack = std::make_unique<Dispatcher>(pc);
  // Local stage: the received rows of one chunk (at most P * ceil(C / n); dropless: M), one slot
  // each, over the E_local local experts; one plan per chunk in the state.
  DispatcherConfig lc;
  lc.max_tokens = m.dropless ? m.M : m.P * m.layout.max_size();
  lc.num_experts = c.local_experts;
  lc.topk = 1;
  lc.hidden = c.hidden;
  lc.row_dtype = c.row_dtype;
  lc.form = RoutingForm::kTopK;
  lc.options.align = c.align;
  lc.options.row_bound = c.row_bound;
  m.local = std::make_unique<Dispatcher>(lc);
  m.Rc = m.local->rows();
  m.R = m.n * m.Rc;
  MOE_CHECK(m.R <= kInt32Max, "argument 'chunks': chunks * R_c = ", m.R, " rows of x_perm do not fit int32");

  m.carve_state(nullptr, &m.own_bytes);
  m.local_bytes = (m.local->plan_bytes() + 255) / 256 * 256;  // each chunk's plan 256-byte aligned
  size_t ws_bytes = 0;
  m.carve_workspace(nullptr, &ws_bytes);
  m.ws_memory = cuda_malloc_allocator().allocate(ws_bytes);
  m.ws = m.carve_workspace(static_cast<char*>(m.ws_memory.get()));
  m.pack_plan = m.pack->new_plan();
  if (m.dropless) {
    // The count matrix lands here: pinned, so its copy is a plain DMA before the one synchronisation.
    void* h = nullptr;
    MOE_CUDA_CHECK(cudaMallocHost(&h, sizeof(int64_t) * m.P * m.P));
    m.host_counts = static_cast<int64_t*>(h);
  }
  // The overlapped pipeline's events: the pack, the join, the Y rows gathered and returned (its
  // backward), each chunk's arrival and each chunk's return.
  m.events.reserve(4 + 2 * m.n);
  for (int i = 0; i < 4 + 2 * m.n; ++i) {
    cudaEvent_t e = nullptr;
    MOE_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    m.events.push_back(e);
  }
}

EpDispatcher::~EpDispatcher() = default;

const EpDispatcherConfig& EpDispatcher::config() const { return impl_->cfg; }
int EpDispatcher::rank() const { return impl_->transport->rank(); }
int64_t EpDispatcher::rows() const { return impl_->R; }
int EpDispatcher::chunks() const { return impl_->n; }
int64_t EpDispatcher::chunk_rows() const { return impl_->Rc; }
int64_t EpDispatcher::exchange_rows() const { return impl_->B; }
int EpDispatcher::slots_per_token() const { return impl_->slots; }
EpMode EpDispatcher::mode() const { return impl_->cfg.mode; }
int64_t EpDispatcher::dropless_max_rows() const { return impl_->M; }
size_t EpDispatcher::state_bytes() const { return impl_->state_bytes(); }
int EpDispatcher::state_headers() const { return impl_->state_headers(); }

SavedState EpDispatcher::new_state(DeviceAllocator& allocator) const {
  return SavedState::allocate(state_bytes(), state_headers(), allocator);
}

// ---- the stage-by-stage methods (one stream) ----

void EpDispatcher::plan_and_dispatch(const RoutingView& routing, const TensorView& x, uint32_t* error_word,
                                     const SavedState& state, const TensorView& x_perm, cudaStream_t stream) const {
  const Impl& m = *impl_;
  const int64_t T = kernels::check_routing_args(routing, error_word, m.cfg.form, m.slots, m.cfg.max_tokens);
  m.check_rows(x, "x", T);
  m.check_rows(x_perm, "x_perm", m.R);
  check_state_capacity(state, "state", m.state_bytes(), m.state_headers());
  const EpStateLayout s = m.carve_state(static_cast<char*>(state.device()));
  if (m.dropless) {
    m.check_eager(stream, "EpDispatcher::plan_and_dispatch");
    m.dispatch_dropless(routing, T, x, error_word, state, s, x_perm, stream);
    mark_filled(state, m.serial, StateKind::kDispatchPlan, T);
    return;
  }
  m.pack_rows(routing, T, x, error_word, s, stream);
  m.exchange_forward(s, 0, m.n, stream);
  for (int j = 0; j < m.n; ++j) m.receive_chunk(state, j, error_word, x_perm, stream);
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
  if (m.dropless) {
    m.check_eager(stream, "EpDispatcher::combine");
    m.return_Y_dropless(state, m.peer_rows(state), Y, stream);
    m.sum_slots(s, T, y, by_row, by_slot, stream);
    return;
  }
  for (int j = 0; j < m.n; ++j) m.gather_chunk(state, j, Y, stream);
  m.exchange({{m.ws.recv, m.ws.send, m.row_bytes}}, 0, m.n, stream);
  // On the source: the token's slots in slot order, fp32, exactly the single-GPU combine.
  m.sum_slots(s, T, y, by_row, by_slot, stream);
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
  if (m.dropless) {
    m.check_eager(stream, "EpDispatcher::combine_backward");
    m.combine_backward_dropless(state, s, T, dy, dY, by_row, by_slot, merging, want_dot ? Y : nullptr, dprobs,
                                stream);
    return;
  }
  // The Y rows travel back to the source again, as in the forward.
  if (want_dot) {
    for (int j = 0; j < m.n; ++j) m.gather_chunk(state, j, *Y, stream);
    m.exchange({{m.ws.recv, m.ws.send, m.row_bytes}}, 0, m.n, stream);
  }
  m.scale_grads(s, T, m.PC, dy, by_row, by_slot, merging, dprobs, want_dot, stream);
  m.exchange({{m.ws.recv, m.ws.send, m.row_bytes}}, 0, m.n, stream);
  // On the destination: each received row's gradient onto its x_perm row (pad rows zero).
  for (int j = 0; j < m.n; ++j) m.grads_to_rows(state, j, dY, stream);
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
  if (m.dropless) {
    m.check_eager(stream, "EpDispatcher::dispatch_backward");
    m.dispatch_backward_dropless(state, s, T, d_x_perm, dx, d_probs_perm, dprobs, stream);
    return;
  }
  // On the destination: each received row's gradient (its one x_perm row) in receive order.
  for (int j = 0; j < m.n; ++j) m.grads_to_receive_order(state, j, d_x_perm, d_probs_perm, stream);
  m.exchange_grads_back(0, m.n, stream);
  // On the source: dx[t] = the token's rows summed in slot order; dprobs at each slot's row.
  m.sum_grads(s, T, dx, d_probs_perm != nullptr, dprobs, stream);
}

// ---- views ----

int64_t EpDispatcher::tokens(const SavedState& state) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::tokens", &T);
  return T;
}
TensorView EpDispatcher::group_offsets(const SavedState& state, int chunk) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::group_offsets", &T);
  impl_->check_chunk(chunk);
  return impl_->local->group_offsets(impl_->local_state(state, chunk));
}
TensorView EpDispatcher::probs_perm(const SavedState& state, int chunk) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::probs_perm", &T);
  impl_->check_chunk(chunk);
  return impl_->local->probs_perm(impl_->local_state(state, chunk));
}
TensorView EpDispatcher::local_counts(const SavedState& state, DType dtype, int chunk) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::local_counts", &T);
  impl_->check_chunk(chunk);
  return impl_->local->counts(impl_->local_state(state, chunk), dtype);
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
  const int64_t rows = impl_->dropless ? impl_->peer_rows(state).send_total : impl_->PC;
  return TensorView(s.send_probs, DType::kFP32, {rows});
}
std::vector<int64_t> EpDispatcher::sent_rows(const SavedState& state) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::sent_rows", &T);
  return impl_->dropless ? impl_->peer_rows(state).send : std::vector<int64_t>(impl_->P, impl_->C);
}
std::vector<int64_t> EpDispatcher::received_rows(const SavedState& state) const {
  int64_t T = 0;
  impl_->filled(state, "EpDispatcher::received_rows", &T);
  return impl_->dropless ? impl_->peer_rows(state).recv : std::vector<int64_t>(impl_->P, impl_->C);
}
TensorView EpDispatcher::send_buffer() const { return impl_->rows_view(impl_->ws.send, impl_->B); }
TensorView EpDispatcher::recv_buffer() const { return impl_->rows_view(impl_->ws.recv, impl_->B); }
TensorView EpDispatcher::recv_probs() const { return TensorView(impl_->ws.recv_probs, DType::kFP32, {impl_->B}); }

}  // namespace moe
