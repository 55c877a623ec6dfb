// moe::GroupedMlp: the expert layer composed from the dispatch, grouped GEMM, activation and bias
// kernels (SPEC 2-5, 7). This file only plans memory and orders the stages; the math lives in the
// kernels it calls.
//
// Forward:  plan -> permute -> fc1 (+b1) -> act x p -> fc2 (+b2 p) -> unpermute
// Backward: unpermute_bwd -> [fc2 wgrad] -> fc2 dgrad -> act bwd (+dp) -> fc1 dgrad -> permute_bwd
//           -> [fc1 wgrad]      (weight gradients deferred to backward_dw in delayed mode)
//
// Buffer reuse (static, decided at construction):
//  - dact is written into `act`'s buffer once fc2's wgrad has consumed act (non-delayed mode);
//  - dx_perm is written into `dY`'s buffer once fc2's dgrad and wgrad have consumed dY
//    (non-delayed); delayed mode keeps dY, act, dh and x_perm until backward_dw, so it needs own
//    buffers for dact and dx_perm;
//  - with probs applied in the activation, Y is not needed by backward, so dY reuses Y's buffer.
#include "moe/grouped_mlp.h"

#include <array>

#include "kernels/cuda_check.h"
#include "kernels/device_arena.h"
#include "moe/activation_ops.h"
#include "moe/bias_ops.h"
#include "moe/dispatch.h"
#include "moe/error.h"
#include "moe/error_word.h"
#include "moe/grouped_gemm.h"

namespace moe {

namespace {

constexpr std::array<Param, 4> kHookOrder = {Param::kFc2Weight, Param::kFc2Bias, Param::kFc1Weight, Param::kFc1Bias};

TensorView device_view(void* p, DType t, std::initializer_list<int64_t> shape) {
  return TensorView(p, t, shape, Device::kCUDA);
}

DispatcherConfig dispatcher_config(const GroupedMlpConfig& c) {
  DispatcherConfig d;
  d.max_tokens = c.max_tokens;
  d.num_experts = c.experts;
  d.topk = c.topk;
  d.hidden = c.hidden;
  d.form = c.routing_form;
  d.options = c.dispatch;
  d.options.row_bound = c.row_bound();
  d.row_dtype = c.dtype;
  return d;
}

// The views of one parameter in the config's layout, checked.
void check_param_views(const std::vector<TensorView>& views, const char* name, const GroupedMlpConfig& c,
                       WeightLayout layout, std::initializer_list<int64_t> expert_shape, DType dtype) {
  const int64_t E = c.experts;
  if (layout == WeightLayout::kSingleGrouped) {
    MOE_CHECK(views.size() == 1, "argument '", name, "': single-grouped layout expects 1 tensor, got ", views.size());
    std::vector<int64_t> s{E};
    s.insert(s.end(), expert_shape);
    const TensorView& v = views[0];
    check_device(v, name, Device::kCUDA);
    check_dtype(v, name, dtype);
    MOE_CHECK(v.ndim == static_cast<int>(s.size()), "argument '", name, "': expected ", s.size(), " dims, got ",
              v.shape_string());
    for (size_t d = 0; d < s.size(); ++d)
      MOE_CHECK(v.shape[d] == s[d], "argument '", name, "': expected dimension ", d, " of size ", s[d], ", got ",
                v.shape_string());
    check_contiguous(v, name);
    check_pointer(v, name, 16);
  } else {
    MOE_CHECK(static_cast<int64_t>(views.size()) == E, "argument '", name, "': per-expert layout expects ", E,
              " tensors, got ", views.size());
    for (const TensorView& v : views) check_device_tensor(v, name, dtype, expert_shape);
  }
}

// Gradients may be bound in either layout, independently of the weights' layout (e.g. one grouped
// gradient buffer for per-expert weights): a single view with the extra leading E dimension is
// single grouped.
WeightLayout layout_of(const std::vector<TensorView>& views, size_t expert_ndim, int experts) {
  return views.size() == 1 && experts >= 1 && views[0].ndim == static_cast<int>(expert_ndim) + 1
             ? WeightLayout::kSingleGrouped
             : WeightLayout::kPerExpert;
}

}  // namespace

struct GroupedMlp::Impl {
  GroupedMlpConfig cfg;
  int64_t R = 0;
  Dispatcher dispatcher;
  GroupedGemm gemm;
  std::array<std::vector<Hook>, 4> hooks;

  // Bound parameters and gradients.
  bool have_weights = false, have_grads = false;
  ExpertMatrices w1, w2, dw1, dw2;
  ExpertRows b1, b2, db1, db2;
  // Device tables of per-expert bias row pointers (b1, b2, db1, db2): a new table per binding, the
  // old one freed (cudaFree waits for kernels in flight), never rewritten in place.
  std::shared_ptr<void> bias_tables[4];

  // Planned device memory.
  char* block = nullptr;
  size_t block_bytes = 0;
  uint16_t *x_perm = nullptr, *h = nullptr, *act = nullptr, *Y = nullptr, *dY = nullptr, *dact = nullptr,
           *dh = nullptr, *dx_perm = nullptr;
  float* d_probs_perm = nullptr;
  uint8_t* bias_ws = nullptr;
  size_t bias_ws_bytes = 0;
  ErrorWord errors;

  // Per-step state.
  int64_t T = 0;
  bool forward_done = false, wgrad_pending = false;

  explicit Impl(const GroupedMlpConfig& c)
      : cfg((c.validate(), c)), R(c.row_bound()), dispatcher(dispatcher_config(c)), gemm(c.experts, c.row_bound()) {
    plan_memory(nullptr);
    MOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&block), block_bytes));
    plan_memory(block);
  }
  ~Impl() { cudaFree(block); }

  bool probs_in_act() const { return cfg.probs == ProbsPlacement::kInActivation; }

  void plan_memory(char* base) {
    const int64_t H = cfg.hidden, F = cfg.ffn, F1 = cfg.fc1_out();
    DeviceArena a(base);
    x_perm = a.take<uint16_t>(R * H);
    h = a.take<uint16_t>(R * F1);
    act = a.take<uint16_t>(R * F);
    Y = a.take<uint16_t>(R * H);
    dY = probs_in_act() ? Y : a.take<uint16_t>(R * H);
    dh = a.take<uint16_t>(R * F1);
    dact = cfg.delay_wgrad ? a.take<uint16_t>(R * F) : act;
    dx_perm = cfg.delay_wgrad ? a.take<uint16_t>(R * H) : dY;
    d_probs_perm = a.take<float>(R);
    if (cfg.bias) {
      bias_ws_bytes = std::max(bias_grad_workspace_bytes(R, cfg.experts, H), bias_grad_workspace_bytes(R, cfg.experts, F1));
      bias_ws = a.take<uint8_t>(static_cast<int64_t>(bias_ws_bytes));
    }
    block_bytes = a.used();
  }

  // Views of the planned buffers.
  TensorView v(uint16_t* p, int64_t cols) const { return device_view(p, DType::kBF16, {R, cols}); }
  TensorView group_offsets() const { return dispatcher.group_offsets(); }
  TensorView probs_perm_or_none() const { return probs_in_act() ? dispatcher.probs_perm() : TensorView(); }

  static ExpertMatrices matrices(const std::vector<TensorView>& views, WeightLayout layout, const char* name) {
    return layout == WeightLayout::kSingleGrouped ? ExpertMatrices::grouped(views[0], name)
                                                  : ExpertMatrices::per_expert(views, name);
  }
  // Bias rows; per-expert layout uploads the E row pointers into table slot `slot` (synchronously:
  // this happens when parameters are bound, never inside forward/backward).
  ExpertRows rows(const std::vector<TensorView>& views, WeightLayout layout, int slot) {
    if (layout == WeightLayout::kSingleGrouped) return ExpertRows::single_grouped(views[0]);
    std::vector<void*> ptrs;
    for (const TensorView& t : views) ptrs.push_back(t.data);
    void* table = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&table, ptrs.size() * sizeof(void*)));
    bias_tables[slot] = std::shared_ptr<void>(table, [](void* p) { cudaFree(p); });
    MOE_CUDA_CHECK(cudaMemcpy(table, ptrs.data(), ptrs.size() * sizeof(void*), cudaMemcpyHostToDevice));
    return ExpertRows::per_expert(static_cast<void* const*>(table), views[0].dtype, cfg.experts,
                                  views[0].shape[views[0].ndim - 1]);
  }

  void check_bias_views(const std::vector<TensorView>& views, const char* name, WeightLayout layout, int64_t n,
                        DType dtype) const {
    if (!cfg.bias) {
      MOE_CHECK(views.empty(), "argument '", name, "': the layer has no biases (config.bias = false)");
      return;
    }
    check_param_views(views, name, cfg, layout, {n}, dtype);
  }

  void fire_hooks(Param p) {
    if (!cfg.bias && (p == Param::kFc1Bias || p == Param::kFc2Bias)) return;
    for (auto& hook : hooks[static_cast<int>(p)]) hook(p);
  }

  void wgrad_fc2(cudaStream_t s) {
    const bool acc = cfg.wgrad == WgradMode::kAccumulate;
    gemm.wgrad(v(dY, cfg.hidden), v(act, cfg.ffn), group_offsets(), dw2, acc, s);
    if (cfg.bias) {
      TensorView ws = device_view(bias_ws, DType::kUInt8, {static_cast<int64_t>(bias_ws_bytes)});
      bias_grad(v(dY, cfg.hidden), probs_perm_or_none(), group_offsets(), db2, acc, ws, s);
    }
  }
  void wgrad_fc1(cudaStream_t s) {
    const bool acc = cfg.wgrad == WgradMode::kAccumulate;
    gemm.wgrad(v(dh, cfg.fc1_out()), v(x_perm, cfg.hidden), group_offsets(), dw1, acc, s);
    if (cfg.bias) {
      TensorView ws = device_view(bias_ws, DType::kUInt8, {static_cast<int64_t>(bias_ws_bytes)});
      bias_grad(v(dh, cfg.fc1_out()), TensorView(), group_offsets(), db1, acc, ws, s);
    }
  }
};

GroupedMlp::GroupedMlp(const GroupedMlpConfig& config) : impl_(std::make_unique<Impl>(config)) {}
GroupedMlp::~GroupedMlp() = default;

const GroupedMlpConfig& GroupedMlp::config() const { return impl_->cfg; }

void GroupedMlp::set_weights(const ExpertTensors& w) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  const WeightLayout L = c.layout;
  check_param_views(w.fc1_weight, "fc1.weight", c, L, {c.fc1_out(), c.hidden}, c.dtype);
  check_param_views(w.fc2_weight, "fc2.weight", c, L, {c.hidden, c.ffn}, c.dtype);
  m.check_bias_views(w.fc1_bias, "fc1.bias", L, c.fc1_out(), c.dtype);
  m.check_bias_views(w.fc2_bias, "fc2.bias", L, c.hidden, c.dtype);
  m.w1 = Impl::matrices(w.fc1_weight, L, "fc1.weight");
  m.w2 = Impl::matrices(w.fc2_weight, L, "fc2.weight");
  if (c.bias) {
    m.b1 = m.rows(w.fc1_bias, L, 0);
    m.b2 = m.rows(w.fc2_bias, L, 1);
  }
  m.have_weights = true;
}

void GroupedMlp::set_grads(const ExpertTensors& g) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  const DType t = c.wgrad == WgradMode::kAccumulate ? DType::kFP32 : c.wgrad_dtype;
  const int E = c.experts;
  const WeightLayout L1 = layout_of(g.fc1_weight, 2, E), L2 = layout_of(g.fc2_weight, 2, E);
  const WeightLayout Lb1 = layout_of(g.fc1_bias, 1, E), Lb2 = layout_of(g.fc2_bias, 1, E);
  check_param_views(g.fc1_weight, "fc1.weight grad", c, L1, {c.fc1_out(), c.hidden}, t);
  check_param_views(g.fc2_weight, "fc2.weight grad", c, L2, {c.hidden, c.ffn}, t);
  m.check_bias_views(g.fc1_bias, "fc1.bias grad", Lb1, c.fc1_out(), t);
  m.check_bias_views(g.fc2_bias, "fc2.bias grad", Lb2, c.hidden, t);
  m.dw1 = Impl::matrices(g.fc1_weight, L1, "fc1.weight grad");
  m.dw2 = Impl::matrices(g.fc2_weight, L2, "fc2.weight grad");
  if (c.bias) {
    m.db1 = m.rows(g.fc1_bias, Lb1, 2);
    m.db2 = m.rows(g.fc2_bias, Lb2, 3);
  }
  m.have_grads = true;
}

void GroupedMlp::register_hook(Param param, Hook hook) {
  MOE_CHECK(static_cast<bool>(hook), "argument 'hook': expected a callable");
  impl_->hooks[static_cast<int>(param)].push_back(std::move(hook));
}

void GroupedMlp::forward(const TensorView& x, const RoutingView& routing, const TensorView& y, cudaStream_t s) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  MOE_CHECK(m.have_weights, "GroupedMlp::forward: no weights bound (call set_weights first)");
  MOE_CHECK(!m.wgrad_pending, "GroupedMlp::forward: the previous step's backward_dw() has not run (delayed wgrad "
            "still needs the saved activations)");
  MOE_CHECK(routing.form == c.routing_form, "argument 'routing': expected the config's routing form");
  MOE_CHECK(x.ndim == 2 && x.shape[1] == c.hidden, "argument 'x': expected shape [T, ", c.hidden, "], got ",
            x.shape_string());
  const int64_t T = x.shape[0];
  MOE_CHECK(T <= c.max_tokens, "argument 'x': T = ", T, " exceeds config.max_tokens = ", c.max_tokens);
  // Everything the dispatcher will read is checked before its plan is replaced, so a rejected call
  // leaves the previous step's state intact.
  check_device_tensor(x, "x", c.dtype, {T, c.hidden});
  MOE_CHECK(routing.probs.ndim == 2 && routing.probs.shape[0] == T, "argument 'probs': expected ", T,
            " rows (one per token of x), got shape ", routing.probs.shape_string());
  check_device_tensor(y, "y", c.dtype, {T, c.hidden});
  m.forward_done = false;  // the saved activations are about to be replaced
  const int64_t H = c.hidden, F = c.ffn, F1 = c.fc1_out();
  TensorView g = m.group_offsets();

  m.dispatcher.plan(routing, m.errors.device_ptr(), s);
  m.dispatcher.permute(x, m.v(m.x_perm, H), s);
  m.gemm.fprop(m.v(m.x_perm, H), m.w1, g, m.v(m.h, F1), s);
  if (c.bias) bias_add(m.v(m.h, F1), m.b1, TensorView(), g, s);
  activation_forward(c.activation, m.v(m.h, F1), m.probs_perm_or_none(), g, m.v(m.act, F), s);
  m.gemm.fprop(m.v(m.act, F), m.w2, g, m.v(m.Y, H), s);
  if (c.bias) bias_add(m.v(m.Y, H), m.b2, m.probs_perm_or_none(), g, s);
  m.dispatcher.unpermute(m.v(m.Y, H), y, !m.probs_in_act(), s);
  m.T = T;
  m.forward_done = true;
}

void GroupedMlp::backward(const TensorView& dy, const TensorView& dx, const TensorView& dprobs, cudaStream_t s) {
  Impl& m = *impl_;
  const auto& c = m.cfg;
  MOE_CHECK(m.forward_done, "GroupedMlp::backward: no forward to differentiate (call forward first; each forward has one backward)");
  MOE_CHECK(!m.wgrad_pending, "GroupedMlp::backward: the previous step's backward_dw() has not run");
  MOE_CHECK(c.delay_wgrad || m.have_grads, "GroupedMlp::backward: no gradient tensors bound (call set_grads first)");
  const int64_t T = m.T, H = c.hidden, F = c.ffn, F1 = c.fc1_out();
  const int slots = m.dispatcher.slots_per_token();
  check_shape(dy, "dy", {T, H});
  check_shape(dx, "dx", {T, H});
  check_shape(dprobs, "dprobs", {T, slots});
  check_dtype(dprobs, "dprobs", DType::kFP32);
  TensorView g = m.group_offsets();
  TensorView dpp = device_view(m.d_probs_perm, DType::kFP32, {m.R});

  if (m.probs_in_act()) {
    m.dispatcher.unpermute_backward(dy, m.v(m.dY, H), false, s);
  } else {
    // Probs merged at combine: their gradient <Y[row], dy[t]> comes from the combine's backward.
    TensorView Yv = m.v(m.Y, H);
    m.dispatcher.unpermute_backward(dy, m.v(m.dY, H), true, s, &Yv, &dprobs);
  }
  if (!c.delay_wgrad) m.wgrad_fc2(s);  // consumes act before dact overwrites it
  m.gemm.dgrad(m.v(m.dY, H), m.w2, g, m.v(m.dact, F), s);
  if (m.probs_in_act()) {
    activation_backward(c.activation, m.v(m.h, F1), m.dispatcher.probs_perm(), m.v(m.dact, F), g, m.v(m.dh, F1),
                        dpp, s);
    if (c.bias) bias_dprobs(m.v(m.dY, H), m.b2, g, dpp, /*accumulate=*/true, s);
  } else {
    activation_backward(c.activation, m.v(m.h, F1), TensorView(), m.v(m.dact, F), g, m.v(m.dh, F1), TensorView(), s);
  }
  m.gemm.dgrad(m.v(m.dh, F1), m.w1, g, m.v(m.dx_perm, H), s);
  if (m.probs_in_act()) {
    m.dispatcher.permute_backward(m.v(m.dx_perm, H), dx, s, &dpp, &dprobs);
  } else {
    m.dispatcher.permute_backward(m.v(m.dx_perm, H), dx, s);
  }
  if (c.delay_wgrad) {
    m.wgrad_pending = true;  // backward_dw consumes the saved activations, then clears forward_done
    return;
  }
  m.wgrad_fc1(s);
  m.forward_done = false;  // act now holds dact: a second backward of this forward would be wrong
  for (Param p : kHookOrder) m.fire_hooks(p);
}

void GroupedMlp::backward_dw(cudaStream_t s) {
  Impl& m = *impl_;
  MOE_CHECK(m.cfg.delay_wgrad, "GroupedMlp::backward_dw: only for config.delay_wgrad = true");
  MOE_CHECK(m.wgrad_pending, "GroupedMlp::backward_dw: no pending weight gradients (call backward first)");
  MOE_CHECK(m.have_grads, "GroupedMlp::backward_dw: no gradient tensors bound (call set_grads first)");
  m.wgrad_fc2(s);
  m.fire_hooks(Param::kFc2Weight);
  m.fire_hooks(Param::kFc2Bias);
  m.wgrad_fc1(s);
  m.fire_hooks(Param::kFc1Weight);
  m.fire_hooks(Param::kFc1Bias);
  m.wgrad_pending = false;
  m.forward_done = false;
}

uint32_t* GroupedMlp::device_error_word() const { return impl_->errors.device_ptr(); }
void GroupedMlp::check_errors(cudaStream_t stream) { impl_->errors.check(stream); }

size_t GroupedMlp::workspace_bytes() const {
  return impl_->block_bytes + impl_->dispatcher.workspace_bytes() + impl_->gemm.device_bytes();
}

const int32_t* GroupedMlp::group_offsets() const { return impl_->dispatcher.group_offsets().ptr<int32_t>(); }
const int64_t* GroupedMlp::tokens_per_expert() const {
  return impl_->dispatcher.counts(DType::kInt64).ptr<int64_t>();
}

}  // namespace moe
