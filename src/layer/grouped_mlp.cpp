// moe::GroupedMlp: the expert layer as the composition dispatcher -> experts -> combine. This file
// checks arguments, plans memory and orders the stages.
//
// Forward:  plan -> permute -> experts forward -> unpermute
//           (fuse_fc1: plan -> experts forward gathering the rows of x, writing x_perm on the way
//           unless save_x_perm is off -> unpermute; fp8: the experts quantize the rows of x
//           gathered through the dispatch map, no x_perm at all)
// Backward: [recompute: permute + experts recompute] -> unpermute_bwd -> experts backward
//           -> permute_bwd      (weight gradients deferred to backward_dw in delayed mode)
//           (fuse_fc2_dgrad, probs in the activation: no unpermute_bwd -- the experts' fused fc2
//           dgrad gathers the rows of dy through the dispatch map; so does fp8's quantize of dY,
//           probs in the activation, without bias)
//
// Saved state (caller-owned), device block: the dispatch plan, x_perm (not with save_x_perm off: the
// fc1 weight gradient then gathers the rows of the caller's x, whose address the state keeps), Y when
// probs are merged at the combine (its backward needs <Y, dy>), dY in delayed mode (backward_dw
// reads it; not where fp8 quantizes dy's rows: the experts' state keeps dY's FP8 copies), and the
// experts' state (h, act, ...). Recompute mode keeps only the plan and the
// address of the caller's x; x_perm, Y and the experts' activations then live in the layer's
// workspace and are rebuilt by the backward with the same kernels on the same inputs (bitwise the
// same gradients). The FP8 experts save their own columnwise copy of x_perm, quantized from the
// rows of x: with fp8 no bf16 x_perm exists (recompute aside).
//
// Workspace (shared by all states, used only while a call runs): `Y` is the experts' output when
// probs are applied in the activation, then dY (non-delayed) and dx_perm -- the experts read dY
// completely before they write dx_perm; d_probs_perm; x_perm (recompute).
//
// Token chunks (config.token_chunks = n > 1): `Y` holds one piece of consecutive tokens' rows. The
// forward runs the experts up to the activation, then per piece fc2 on the piece's windows of rows
// and the combine of its tokens; the backward runs the experts' backward without the fc1 dgrad
// (its dprobs partial sums in `Y`), then per piece the fc1 dgrad and the sum of its tokens' rows.
// The windows (Dispatcher::chunk_windows) are made again by each call from its plan.
#include "moe/grouped_mlp.h"

#include <algorithm>

#include "device/device_arena.h"
#include "device/state_check.h"
#include "layer/bound_ranges.h"
#include "moe/error.h"
#include "moe/error_word.h"

namespace moe {

namespace {

TensorView bf16_view(void* p, int64_t rows, int64_t cols) {
  return TensorView(p, DType::kBF16, {rows, cols}, Device::kCUDA);
}

// Headers of a layer state.
constexpr int kLayerHeader = 0, kPlanHeader = 1, kExpertsHeader = 2;

// Device block of a layer state.
struct StateLayout {
  size_t plan = 0, x_perm = 0, Y = 0, dY = 0, experts = 0, total = 0;  // offsets, total bytes
  bool has_x_perm = false, has_Y = false, has_dY = false, has_experts = false;
};

}  // namespace

struct GroupedMlp::Impl {
  GroupedMlpConfig cfg;
  uint64_t serial = next_op_serial();
  int64_t R = 0;
  Dispatcher dispatcher;
  GroupedExperts experts;
  ErrorWord errors;
  StateLayout layout;

  // Workspace.
  DeviceBuffer block;
  size_t block_bytes = 0;
  uint16_t* Y_ws = nullptr;
  int64_t Y_rows = 0;  // rows of Y_ws: R, or one token chunk's
  int32_t* windows_ws = nullptr;  // token chunks: Dispatcher::chunk_windows
  float* dpp_ws = nullptr;
  // Recompute mode: x_perm, the combine's Y and an experts state, all rebuilt by each backward.
  uint16_t *x_perm_ws = nullptr, *Ycomb_ws = nullptr;
  char* experts_ws = nullptr;
  StateHeader recompute_header[GroupedExperts::kStateHeaders];

  explicit Impl(const GroupedMlpConfig& c)
      : cfg((c.validate(), c)), R(c.row_bound()), dispatcher(c.dispatcher_config()), experts(c.experts_config()) {
    layout = plan_state();
    plan_workspace(nullptr);
    block = cuda_malloc_allocator().allocate(block_bytes);
    plan_workspace(static_cast<char*>(block.get()));
  }

  bool probs_in_act() const { return cfg.probs == ProbsPlacement::kInActivation; }
  // No x_perm: the fc1 weight gradient gathers the rows of x.
  bool gathered() const { return !cfg.save_x_perm; }
  bool fp8() const { return cfg.fp8 != Fp8Recipe::kNone; }
  // x_perm in a state: not rebuilt by the backward (recompute), not gathered again (save_x_perm
  // off), not replaced by the experts' saved FP8 copy (fp8, which never writes a bf16 x_perm).
  bool x_perm_saved() const { return !gathered() && !cfg.recompute && !fp8(); }
  // The experts' FP8 backward quantizes dY from the rows of dy (no dY_perm): dY's bf16 rows are read
  // by nothing else (no bias gradient; delayed weight gradients read the quantized copies the state
  // keeps) and are dy's rows unscaled.
  bool fp8_gathers_dy() const { return fp8() && probs_in_act() && !cfg.bias; }

  StateLayout plan_state() const {
    const int64_t H = cfg.hidden;
    StateLayout l;
    DeviceArena a(nullptr);
    auto at = [&a](int64_t bytes) {
      const size_t off = a.used();
      a.take<char>(bytes);
      return off;
    };
    l.plan = at(static_cast<int64_t>(dispatcher.plan_bytes()));
    if (!cfg.recompute) {
      l.has_x_perm = x_perm_saved();
      if (l.has_x_perm) l.x_perm = at(R * H * 2);
      l.has_Y = !probs_in_act();
      if (l.has_Y) l.Y = at(R * H * 2);
      l.has_dY = cfg.delay_wgrad && !fp8_gathers_dy();
      if (l.has_dY) l.dY = at(R * H * 2);
      l.has_experts = true;
      l.experts = at(static_cast<int64_t>(experts.state_bytes()));
    }
    l.total = a.used();
    return l;
  }

  int chunks() const { return cfg.token_chunks; }

  void plan_workspace(char* base) {
    const int64_t H = cfg.hidden;
    DeviceArena a(base);
    Y_rows = R;
    if (chunks() > 1) {
      Y_rows = cfg.chunk_row_bound();
      // The backward's dx_perm scratch also holds the fused fc2 dgrad's dprobs partial sums: one
      // float per row of the plan and block of 256 features.
      if (experts.config().dprobs_partials_in_dx_perm && cfg.ffn > 256) {
        const int64_t partial_bytes = R * ((cfg.ffn + 255) / 256) * 4;
        Y_rows = std::max(Y_rows, (partial_bytes + 2 * H - 1) / (2 * H));
      }
      windows_ws = a.take<int32_t>(dispatcher.chunk_windows_size(chunks()));
    }
    Y_ws = a.take<uint16_t>(Y_rows * H);
    if (probs_in_act()) dpp_ws = a.take<float>(R);
    if (cfg.recompute) {
      x_perm_ws = a.take<uint16_t>(R * H);
      if (!probs_in_act()) Ycomb_ws = a.take<uint16_t>(R * H);
      experts_ws = a.take<char>(static_cast<int64_t>(experts.state_bytes()));
    }
    block_bytes = a.used();
  }

  // Views of a (correctly sized) layer state.
  SavedState plan_of(const SavedState& st) const {
    return st.slice(layout.plan, dispatcher.plan_bytes(), kPlanHeader, Dispatcher::kPlanHeaders);
  }
  SavedState experts_of(const SavedState& st) {
    if (cfg.recompute)
      return SavedState::borrow(experts_ws, experts.state_bytes(), recompute_header, GroupedExperts::kStateHeaders);
    return st.slice(layout.experts, experts.state_bytes(), kExpertsHeader, GroupedExperts::kStateHeaders);
  }
  void* at(const SavedState& st, size_t off) const { return static_cast<char*>(st.device()) + off; }
  void* x_perm_of(const SavedState& st) const {
    MOE_CHECK(cfg.recompute || layout.has_x_perm, "GroupedMlp: no x_perm in this mode (internal error)");
    return cfg.recompute ? x_perm_ws : at(st, layout.x_perm);
  }
  // The Y the combine merges with probs (probs at combine only).
  void* Ycomb_of(const SavedState& st) const { return cfg.recompute ? Ycomb_ws : at(st, layout.Y); }
  TensorView pp_or_none(const SavedState& plan) const {
    return probs_in_act() ? dispatcher.probs_perm(plan) : TensorView();
  }
  TensorView dpp() const { return TensorView(dpp_ws, DType::kFP32, {R}, Device::kCUDA); }

  // The experts' forward into `es`: x_perm -> Y (the combine's input).
  void run_experts(const SavedState& plan, void* x_perm, void* Y, const SavedState& es, cudaStream_t s) {
    experts.forward(bf16_view(x_perm, R, cfg.hidden), dispatcher.group_offsets(plan), pp_or_none(plan),
                    bf16_view(Y, R, cfg.hidden), es, s);
  }
  // The same with the rows of x gathered inside the fused fc1, which writes x_perm on the way (none:
  // recompute mode, where the backward permutes again, and save_x_perm off, where the fc1 weight
  // gradient gathers the rows of x again), or by the FP8 quantize of x (never an x_perm).
  void run_experts_gathered(const SavedState& plan, const TensorView& x, void* x_perm, void* Y, const SavedState& es,
                            cudaStream_t s) {
    experts.forward_gathered(x, dispatcher.row_slots(plan), dispatcher.slots_per_token(),
                             dispatcher.group_offsets(plan), pp_or_none(plan), bf16_view(Y, R, cfg.hidden),
                             x_perm ? bf16_view(x_perm, R, cfg.hidden) : TensorView(), es, s);
  }
  TensorView windows() const {
    return TensorView(windows_ws, DType::kInt32, {dispatcher.chunk_windows_size(chunks())}, Device::kCUDA);
  }
  // Token chunks, forward: per piece, fc2 on its windows of rows into Y_ws, then its tokens' combine.
  void fc2_and_combine_by_chunk(const SavedState& plan, const SavedState& es, const TensorView& y, cudaStream_t s) {
    const TensorView w = windows(), Y = bf16_view(Y_ws, Y_rows, cfg.hidden);
    dispatcher.chunk_windows(plan, chunks(), w, s);
    for (int c = 0; c < chunks(); ++c) {
      experts.fc2_rows(es, dispatcher.chunk_row_begin(w, chunks(), c), dispatcher.chunk_offsets(w, chunks(), c), Y, s);
      dispatcher.unpermute_chunk(plan, w, chunks(), c, Y, y, s);
    }
  }
  // Token chunks, backward: per piece, the fc1 dgrad on its windows of dh into Y_ws, then the sum of
  // its tokens' rows (and their dprobs).
  void dgrad_and_sum_by_chunk(const SavedState& plan, const SavedState& es, const TensorView& dx,
                              const TensorView& dprobs, cudaStream_t s) {
    const TensorView w = windows(), dX = bf16_view(Y_ws, Y_rows, cfg.hidden), pp_grad = dpp();
    dispatcher.chunk_windows(plan, chunks(), w, s);
    for (int c = 0; c < chunks(); ++c) {
      experts.fc1_dgrad_rows(es, dispatcher.chunk_row_begin(w, chunks(), c), dispatcher.chunk_offsets(w, chunks(), c),
                             dX, s);
      dispatcher.permute_backward_chunk(plan, w, chunks(), c, dX, dx, s, &pp_grad, &dprobs);
    }
  }

  // Points the experts' state at the inputs its backward reads, where they are now (the state may
  // have moved; x may be the caller's view of the forward's x).
  void relocate_experts(const SavedState& state, const SavedState& plan, const SavedState& es, const TensorView& x,
                        const TensorView* dY) const {
    if (fp8()) {  // the FP8 backward reads no x_perm (and fp8 keeps save_x_perm on: no fused fc1)
      experts.relocate(es, TensorView(), dispatcher.group_offsets(plan), pp_or_none(plan), dY);
    } else if (gathered()) {
      experts.relocate_gathered(es, x, dispatcher.row_slots(plan), dispatcher.slots_per_token(),
                                dispatcher.group_offsets(plan), pp_or_none(plan), dY);
    } else {
      experts.relocate(es, bf16_view(x_perm_of(state), R, cfg.hidden), dispatcher.group_offsets(plan),
                       pp_or_none(plan), dY);
    }
  }
  // x read again in backward (recompute mode, save_x_perm off): the forward's x, or the caller's view of it.
  TensorView x_of(const SavedState& st, const TensorView* x_in) const {
    const StateHeader& h = st.header(kLayerHeader);
    return x_in ? *x_in : bf16_view(reinterpret_cast<void*>(h.pointer), h.tokens, cfg.hidden);
  }
};

GroupedMlp::GroupedMlp(const GroupedMlpConfig& config) : impl_(std::make_unique<Impl>(config)) {}
GroupedMlp::~GroupedMlp() = default;

const GroupedMlpConfig& GroupedMlp::config() const { return impl_->cfg; }
const Dispatcher& GroupedMlp::dispatcher() const { return impl_->dispatcher; }
GroupedExperts& GroupedMlp::experts() { return impl_->experts; }
const GroupedExperts& GroupedMlp::experts() const { return impl_->experts; }

void GroupedMlp::set_weights(const ExpertTensors& w) { impl_->experts.set_weights(w); }
void GroupedMlp::rebind_weights(const ExpertTensors& w) { impl_->experts.rebind_weights(w); }
void GroupedMlp::set_grads(const ExpertTensors& g) { impl_->experts.set_grads(g); }
void GroupedMlp::register_hook(Param param, Hook hook) { impl_->experts.register_hook(param, std::move(hook)); }

size_t GroupedMlp::state_bytes() const { return impl_->layout.total; }
SavedState GroupedMlp::new_state(DeviceAllocator& allocator) const {
  return SavedState::allocate(impl_->layout.total, kStateHeaders, allocator);
}

void GroupedMlp::forward(const TensorView& x, const RoutingView& routing, const TensorView& y, const SavedState& state,
                         cudaStream_t s) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  MOE_CHECK(routing.form == c.routing_form, "argument 'routing': expected the config's routing form");
  MOE_CHECK(x.ndim == 2 && x.shape[1] == c.hidden, "argument 'x': expected shape [T, ", c.hidden, "], got ",
            x.shape_string());
  const int64_t T = x.shape[0];
  MOE_CHECK(T <= c.max_tokens, "argument 'x': T = ", T, " exceeds config.max_tokens = ", c.max_tokens);
  check_device_tensor(x, "x", c.dtype, {T, c.hidden});
  MOE_CHECK(routing.probs.ndim == 2 && routing.probs.shape[0] == T, "argument 'probs': expected ", T,
            " rows (one per token of x), got shape ", routing.probs.shape_string());
  check_device_tensor(y, "y", c.dtype, {T, c.hidden});
  check_state_fillable(state, "state", m.layout.total, kStateHeaders, "GroupedMlp::forward");
  MOE_CHECK(m.experts.weight_binding() != 0, "GroupedMlp::forward: no weights bound (call set_weights first)");
  MOE_CHECK(!(c.recompute || m.gathered()) || y.data != x.data || T == 0, "argument 'y': ",
            c.recompute ? "recompute mode" : "save_x_perm = false", " reads x again in backward, so y must not ",
            "overwrite it");
  // The routing itself is checked by the plan before anything is enqueued.
  const SavedState plan = m.plan_of(state);
  m.dispatcher.plan(routing, m.errors.device_ptr(), plan, s);
  SavedState es = m.experts_of(state);
  if (c.recompute) es.reset();  // the workspace state only serves this call
  // With token chunks the experts stop after the activation (no Y: fc2 runs piece by piece below).
  void* Y = m.chunks() > 1 ? nullptr : m.probs_in_act() ? m.Y_ws : m.Ycomb_of(state);
  if (c.fuse_fc1 || m.fp8()) {
    m.run_experts_gathered(plan, x, m.x_perm_saved() ? m.x_perm_of(state) : nullptr, Y, es, s);
  } else {
    void* x_perm = m.x_perm_of(state);
    m.dispatcher.permute(plan, x, bf16_view(x_perm, m.R, c.hidden), s);
    m.run_experts(plan, x_perm, Y, es, s);
  }
  if (m.chunks() > 1) {
    m.fc2_and_combine_by_chunk(plan, es, y, s);
    if (c.recompute) es.reset();
  } else {
    if (c.recompute) es.reset();
    m.dispatcher.unpermute(plan, bf16_view(Y, m.R, c.hidden), y,
                           m.probs_in_act() ? MergeProbs::kNone : MergeProbs::kPlanned, s);
  }
  mark_filled(state, m.serial, StateKind::kLayer, T);
  state.header(kLayerHeader).pointer = reinterpret_cast<uint64_t>(x.data);
  state.header(kLayerHeader).binding = m.experts.weight_binding();
}

void GroupedMlp::backward(const TensorView& dy, const TensorView& dx, const TensorView& dprobs, const SavedState& state,
                          cudaStream_t s, const TensorView* x_in, WeightGrads weight_grads) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  // Everything is checked before anything is enqueued: a refused call changes nothing.
  check_state_capacity(state, "state", m.layout.total, kStateHeaders);
  check_state(state, "state", m.serial, StateKind::kLayer, {StateStatus::kFilled}, "GroupedMlp::backward");
  MOE_CHECK(state.header(kLayerHeader).binding == m.experts.weight_binding(), "argument 'state' of ",
            "GroupedMlp::backward: the weights were rebound since its forward (set_weights between a forward and ",
            "its backward)");
  MOE_CHECK(weight_grads == WeightGrads::kCompute || !c.delay_wgrad, "argument 'weight_grads' of ",
            "GroupedMlp::backward: kSkip is refused with config.delay_wgrad (backward_dw owes the weight gradients)");
  MOE_CHECK(c.delay_wgrad || weight_grads == WeightGrads::kSkip || m.experts.grads_bound(),
            "GroupedMlp::backward: no gradient tensors bound (call set_grads first)");
  const int64_t T = state.header(kLayerHeader).tokens, H = c.hidden;
  const int slots = m.dispatcher.slots_per_token();
  check_device_tensor(dy, "dy", c.dtype, {T, H});
  check_device_tensor(dx, "dx", c.dtype, {T, H});
  check_device_tensor(dprobs, "dprobs", DType::kFP32, {T, slots}, 4);
  const TensorView x = m.x_of(state, x_in);
  if (x_in) check_device_tensor(*x_in, "x", c.dtype, {T, H});
  // Without x_perm the fc1 weight gradient gathers the rows of x after dx is written when it is delayed
  // (backward_dw) or when the backward runs in token chunks (the weight gradient follows the last one).
  MOE_CHECK(!(m.gathered() && (c.delay_wgrad || c.token_chunks > 1)) || !bytes_overlap(dx, x) || T == 0,
            "argument 'dx': with save_x_perm = false and delay_wgrad or token_chunks > 1, the fc1 weight gradient ",
            "gathers the rows of x after dx is written, so dx must not overwrite it");
  const SavedState plan = m.plan_of(state);
  SavedState es = m.experts_of(state);
  if (!c.recompute) {
    // The experts' state records the addresses of x_perm (or x), the group offsets and probs_perm,
    // which live in this state: point it at where they are now (the state may have been moved).
    m.relocate_experts(state, plan, es, x, nullptr);
  } else {
    // Rebuild x_perm and the activations (and Y for the probs' gradient at the combine) exactly as
    // the forward computed them.
    m.dispatcher.permute(plan, x, bf16_view(m.x_perm_ws, m.R, H), s);
    es.reset();
    if (m.probs_in_act())
      m.experts.recompute(bf16_view(m.x_perm_ws, m.R, H), m.dispatcher.group_offsets(plan), m.pp_or_none(plan), es, s);
    else
      m.run_experts(plan, m.x_perm_ws, m.Ycomb_ws, es, s);
  }
  void* dY = m.layout.has_dY ? m.at(state, m.layout.dY) : m.Y_ws;  // not read when FP8 gathers dy
  // With token chunks Y_ws holds one piece's rows: dx_perm is then the experts' scratch only (the
  // fc1 dgrad runs piece by piece below), and no dY_perm lives there (config: the fused fc2 dgrad
  // gathers dy, or delay_wgrad keeps dY in the state).
  const TensorView dYv = bf16_view(dY, m.R, H), dx_perm = bf16_view(m.Y_ws, m.Y_rows, H);
  if (m.probs_in_act() && c.fuse_fc2_dgrad) {
    // The fused fc2 dgrad gathers the rows of dy itself; dY_perm is written (on the way) only where
    // a later stage reads it: bias gradients, backward_dw, the fc2 weight gradient beside a saved
    // x_perm. Otherwise the fc2 weight gradient gathers the rows of dy too.
    // (GroupedMlpConfig::experts_config decides it once: without dY_perm the dprobs partials live
    // in dx_perm, which then must not be dY_perm's buffer.)
    const bool keep_dY = !m.experts.config().dprobs_partials_in_dx_perm;
    // Token chunks: Y_ws holds one piece, so a dY_perm kept there would not fit (the config allows
    // chunks only where none is kept there: without one, or in the state with delay_wgrad).
    MOE_CHECK(m.chunks() == 1 || !keep_dY || c.delay_wgrad, "GroupedMlp::backward: token chunks with a dY_perm in ",
              "the workspace (internal error)");
    // Frozen experts without bias read no dY_perm (no weight or bias gradient): none is written.
    const bool write_dY = keep_dY && (weight_grads == WeightGrads::kCompute || c.bias);
    m.experts.backward_gathered(dy, m.dispatcher.row_slots(plan), slots, write_dY ? dYv : TensorView(), dx_perm,
                                m.dpp(), es, s, weight_grads);
  } else if (m.fp8_gathers_dy()) {
    m.experts.backward_gathered(dy, m.dispatcher.row_slots(plan), slots, TensorView(), dx_perm, m.dpp(), es, s,
                                weight_grads);
  } else if (m.probs_in_act()) {
    m.dispatcher.unpermute_backward(plan, dy, dYv, MergeProbs::kNone, s);
    m.experts.backward(dYv, dx_perm, m.dpp(), es, s, weight_grads);
  } else {
    // Probs merged at combine: their gradient <Y[row], dy[t]> comes from the combine's backward.
    const TensorView Yv = bf16_view(m.Ycomb_of(state), m.R, H);
    m.dispatcher.unpermute_backward(plan, dy, dYv, MergeProbs::kPlanned, s, nullptr, &Yv, &dprobs);
    m.experts.backward(dYv, dx_perm, TensorView(), es, s, weight_grads);
  }
  if (m.chunks() > 1) {
    m.dgrad_and_sum_by_chunk(plan, es, dx, dprobs, s);
    // fc1's weight gradients, the hooks (frozen experts: none; the experts' state is consumed already).
    if (!c.delay_wgrad && weight_grads == WeightGrads::kCompute) m.experts.finish_row_windows(es, s);
  } else if (m.probs_in_act()) {
    const TensorView dpp = m.dpp();
    m.dispatcher.permute_backward(plan, dx_perm, dx, s, &dpp, &dprobs);
  } else {
    m.dispatcher.permute_backward(plan, dx_perm, dx, s);
  }
  // A later backward_dw without x reads the x this backward was given.
  if (x_in) state.header(kLayerHeader).pointer = reinterpret_cast<uint64_t>(x_in->data);
  state.header(kLayerHeader).status =
      static_cast<int32_t>(c.delay_wgrad ? StateStatus::kAwaitingWgrad : StateStatus::kConsumed);
}

void GroupedMlp::backward_dw(const SavedState& state, cudaStream_t s, const TensorView* x_in) {
  Impl& m = *impl_;
  MOE_CHECK(m.cfg.delay_wgrad, "GroupedMlp::backward_dw: only for config.delay_wgrad = true");
  check_state_capacity(state, "state", m.layout.total, kStateHeaders);
  check_state(state, "state", m.serial, StateKind::kLayer, {StateStatus::kAwaitingWgrad}, "GroupedMlp::backward_dw");
  MOE_CHECK(m.experts.grads_bound(), "GroupedMlp::backward_dw: no gradient tensors bound (call set_grads first)");
  const SavedState plan = m.plan_of(state), es = m.experts_of(state);
  const TensorView dY = bf16_view(m.at(state, m.layout.dY), m.R, m.cfg.hidden);
  if (x_in) check_device_tensor(*x_in, "x", m.cfg.dtype, {state.header(kLayerHeader).tokens, m.cfg.hidden});
  // No dY in the state where the FP8 backward quantized dy's rows straight into the experts' state.
  m.relocate_experts(state, plan, es, m.x_of(state, x_in), m.layout.has_dY ? &dY : nullptr);
  m.experts.backward_dw(es, s);
  state.header(kLayerHeader).status = static_cast<int32_t>(StateStatus::kConsumed);
}

uint32_t* GroupedMlp::device_error_word() const { return impl_->errors.device_ptr(); }
void GroupedMlp::refresh_fp8_weights(cudaStream_t stream) { impl_->experts.refresh_fp8_weights(stream); }
QuantizedTensor GroupedMlp::fp8_weights(Param param) const { return impl_->experts.fp8_weights(param); }
void GroupedMlp::check_errors(cudaStream_t stream) {
  // Both words read and cleared, then one error for every bit: the dispatch's and the experts'
  // (FP8 weight gradients).
  ErrorWord::raise(impl_->errors.fetch_and_clear(stream) | impl_->experts.fetch_and_clear_errors(stream));
}

size_t GroupedMlp::workspace_bytes() const { return impl_->block_bytes + impl_->experts.workspace_bytes(); }

TensorView GroupedMlp::group_offsets(const SavedState& state) const {
  check_state_capacity(state, "state", impl_->layout.total, kStateHeaders);
  return impl_->dispatcher.group_offsets(impl_->plan_of(state));
}
TensorView GroupedMlp::tokens_per_expert(const SavedState& state) const {
  check_state_capacity(state, "state", impl_->layout.total, kStateHeaders);
  return impl_->dispatcher.counts(impl_->plan_of(state), DType::kInt64);
}

}  // namespace moe
