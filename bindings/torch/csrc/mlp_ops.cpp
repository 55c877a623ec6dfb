// TORCH_LIBRARY operators of the expert layer: create/destroy a moe::GroupedMlp, forward,
// backward, backward_dw. The layer object holds configuration and workspaces only; each forward
// returns its saved state as two tensors (device memory from PyTorch's allocator and a CPU header
// tensor) that autograd keeps for the backward, so any number of micro-batches may be in flight.
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/fp8_weight_views.h"
#include "csrc/handle_registry.h"
#include "csrc/param_binding.h"
#include "csrc/torch_interop.h"
#include "moe/grouped_mlp.h"

namespace moe::torch_ext {
namespace {

using MlpState = Bound<GroupedMlp>;

HandleRegistry<MlpState>& registry() {
  static HandleRegistry<MlpState> r;
  return r;
}

int64_t mlp_create(int64_t hidden, int64_t ffn, int64_t experts, int64_t topk, int64_t max_tokens,
                   const std::string& activation, int64_t glu_interleave, double alpha, double limit, double offset,
                   bool bias, bool probs_at_combine, int64_t align, bool pre_padded, int64_t row_bound,
                   bool map_routing, bool per_expert, bool accumulate, bool fp32_wgrad, bool delay_wgrad,
                   bool recompute, bool fuse_fc1, bool save_x_perm, bool fuse_fc2_dgrad,
                   bool transposed_weights, const std::string& fp8, const std::string& fp8_weight_refresh,
                   int64_t token_chunks) {
  return translate_errors([&] {
    GroupedMlpConfig c;
    c.hidden = hidden;
    c.ffn = ffn;
    c.experts = to_int(experts, "experts");
    c.topk = to_int(topk, "topk");
    c.max_tokens = max_tokens;
    c.routing_form = map_routing ? RoutingForm::kMap : RoutingForm::kTopK;
    c.dispatch.align = to_int(align, "align");
    c.dispatch.pre_padded = pre_padded;
    c.dispatch.row_bound = row_bound;
    set_expert_options(c, activation, glu_interleave, alpha, limit, offset, bias, probs_at_combine, per_expert,
                       accumulate, fp32_wgrad, delay_wgrad);
    c.recompute = recompute;
    c.fuse_fc1 = fuse_fc1;
    c.save_x_perm = save_x_perm;
    c.fuse_fc2_dgrad = fuse_fc2_dgrad;
    c.transposed_weights = transposed_weights;
    set_fp8_options(c, fp8, fp8_weight_refresh);
    c.token_chunks = to_int(token_chunks, "token_chunks");
    return registry().add(std::make_unique<MlpState>(c));
  });
}

void mlp_destroy(int64_t handle) { registry().remove(handle); }

constexpr int kHeaders = GroupedMlp::kStateHeaders;

int64_t mlp_state_bytes(int64_t handle) { return static_cast<int64_t>(registry().get(handle).op.state_bytes()); }

// -> y [T, H], the saved state (CUDA uint8 [state_bytes]) and its headers (CPU uint8).
std::tuple<at::Tensor, at::Tensor, at::Tensor> mlp_forward(
    int64_t handle, const at::Tensor& x, const at::Tensor& routing, const at::Tensor& probs,
    const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
    const std::vector<at::Tensor>& b2, int64_t state_bytes) {
  MlpState& s = registry().get(handle);
  return translate_errors([&] {
    GroupedMlp& layer = s.op;
    require_dims(x, "x", 2);
    MOE_CHECK(state_bytes == static_cast<int64_t>(layer.state_bytes()), "argument 'state_bytes': expected ",
              layer.state_bytes(), ", got ", state_bytes);
    s.bind_weights(w1, b1, w2, b2);
    RoutingView r;
    r.form = layer.config().routing_form;
    (r.form == RoutingForm::kTopK ? r.indices : r.map) = view(routing, "routing");
    r.probs = view(probs, "probs");
    at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
    auto [dev, host] = new_state_tensors(layer.state_bytes(), kHeaders, x);
    layer.forward(view(x, "x"), r, view(y, "y"), state_of(dev, host, kHeaders), current_stream());
    return std::make_tuple(y, dev, host);
  });
}

// Whether the layer reads the forward's x again in backward / backward_dw (recompute mode; fuse_fc1,
// whose fc1 weight gradient gathers the rows of x).
bool reads_x_again(const GroupedMlp& layer) { return layer.config().recompute || !layer.config().save_x_perm; }

// x: the forward's x when the layer reads it again (it may have moved, e.g. offloaded and back), else None.
std::tuple<at::Tensor, at::Tensor> mlp_backward(int64_t handle, const at::Tensor& state, const at::Tensor& header,
                                                 const c10::optional<at::Tensor>& x, const at::Tensor& dy,
                                                 int64_t slots, const std::vector<at::Tensor>& gw1,
                                                 const std::vector<at::Tensor>& gb1, const std::vector<at::Tensor>& gw2,
                                                 const std::vector<at::Tensor>& gb2) {
  MlpState& s = registry().get(handle);
  return translate_errors([&] {
    GroupedMlp& layer = s.op;
    const SavedState st = state_of(state, header, kHeaders);
    MOE_CHECK(x.has_value() == reads_x_again(layer), "argument 'x': expected ",
              reads_x_again(layer) ? "the forward's x (recompute mode or save_x_perm=False)"
                                   : "None (x is read again only in recompute mode or with save_x_perm=False)");
    require_dims(dy, "dy", 2);
    const WeightGrads weight_grads = s.bind_backward_grads(layer.config().delay_wgrad, gw1, gb1, gw2, gb2);
    at::Tensor dx = at::empty_like(dy, at::MemoryFormat::Contiguous);
    at::Tensor dprobs = at::empty({dy.size(0), slots}, dy.options().dtype(at::kFloat));
    const TensorView xv = x ? view(*x, "x") : TensorView();
    layer.backward(view(dy, "dy"), view(dx, "dx"), view(dprobs, "dprobs"), st, current_stream(), x ? &xv : nullptr,
                   weight_grads);
    return std::make_tuple(dx, dprobs);
  });
}

void mlp_backward_dw(int64_t handle, const at::Tensor& state, const at::Tensor& header,
                     const c10::optional<at::Tensor>& x, const std::vector<at::Tensor>& gw1, const std::vector<at::Tensor>& gb1,
                     const std::vector<at::Tensor>& gw2, const std::vector<at::Tensor>& gb2) {
  MlpState& s = registry().get(handle);
  translate_errors([&] {
    const SavedState st = state_of(state, header, kHeaders);
    const bool reads_x = !s.op.config().save_x_perm;
    MOE_CHECK(x.has_value() == reads_x, "argument 'x': expected ",
              reads_x ? "the forward's x (save_x_perm=False)" : "None (backward_dw reads x only with save_x_perm=False)");
    s.bind_grads(gw1, gb1, gw2, gb2);
    const TensorView xv = x ? view(*x, "x") : TensorView();
    s.op.backward_dw(st, current_stream(), x ? &xv : nullptr);
    return 0;
  });
}

// FP8 with weights quantized on request (or FP8 primary weights from fp32 master weights): binds the
// weights (as a forward would) and quantizes them.
void mlp_refresh_fp8_weights(int64_t handle, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                             const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  MlpState& s = registry().get(handle);
  translate_errors([&] {
    s.bind_weights(w1, b1, w2, b2);
    s.op.refresh_fp8_weights(current_stream());
    return 0;
  });
}

// FP8 or emulated: the parts of the quantized weight copies the format stores (fp8_weight_views),
// for the Python side to clone or to copy loaded bytes into right away.
std::tuple<std::vector<int64_t>, std::vector<at::Tensor>> mlp_fp8_weight_views(int64_t handle) {
  MlpState& s = registry().get(handle);
  return translate_errors([&] { return fp8_weight_views(s.op.experts()); });
}

// Binds the weights (as a forward would: parameters that moved are a new binding) and tells whether
// the copies were made for them (GroupedExperts::fp8_weights_current).
bool mlp_fp8_weights_current(int64_t handle, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                             const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  MlpState& s = registry().get(handle);
  return translate_errors([&] {
    s.bind_weights(w1, b1, w2, b2);
    return s.op.experts().fp8_weights_current();
  });
}

// The copies were written through the views: binds the weights (as a forward would) and accepts the
// copies for them (GroupedExperts::accept_fp8_weights), on the current stream.
void mlp_accept_fp8_weights(int64_t handle, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                            const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  MlpState& s = registry().get(handle);
  translate_errors([&] {
    s.bind_weights(w1, b1, w2, b2);
    s.op.experts().accept_fp8_weights(current_stream());
    return 0;
  });
}

// The same weights at new addresses between forwards and their backwards (Bound::rebind_weights).
void mlp_rebind_weights(int64_t handle, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                        const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  MlpState& s = registry().get(handle);
  translate_errors([&] {
    s.rebind_weights(w1, b1, w2, b2);
    return 0;
  });
}

void mlp_check_errors(int64_t handle) {
  MlpState& s = registry().get(handle);
  translate_errors([&] {
    s.op.check_errors(current_stream());
    return 0;
  });
}

// Host headers of each op's saved state (the fake implementations size their header tensors by it).
std::vector<int64_t> state_headers() {
  return {GroupedMlp::kStateHeaders, GroupedExperts::kStateHeaders, Dispatcher::kPlanHeaders};
}

int64_t mlp_workspace_bytes(int64_t handle) { return static_cast<int64_t>(registry().get(handle).op.workspace_bytes()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_engine, m) {
  m.def("mlp_create(int hidden, int ffn, int experts, int topk, int max_tokens, str activation, int glu_interleave, "
        "float alpha, float limit, float offset, bool bias, bool probs_at_combine, int align, bool pre_padded, "
        "int row_bound, bool map_routing, bool per_expert, bool accumulate, bool fp32_wgrad, bool delay_wgrad, "
        "bool recompute, bool fuse_fc1=False, bool save_x_perm=True, bool fuse_fc2_dgrad=False, "
        "bool transposed_weights=False, str fp8=\"none\", str fp8_weight_refresh=\"every_forward\", "
        "int token_chunks=1) -> int",
        &mlp_create);
  m.def("mlp_refresh_fp8_weights(int handle, Tensor[] fc1_weight, Tensor[] fc1_bias, Tensor[] fc2_weight, "
        "Tensor[] fc2_bias) -> ()",
        &mlp_refresh_fp8_weights);
  m.def("mlp_fp8_weight_views(int handle) -> (int[], Tensor[])", &mlp_fp8_weight_views);
  m.def("mlp_fp8_weights_current(int handle, Tensor[] fc1_weight, Tensor[] fc1_bias, Tensor[] fc2_weight, "
        "Tensor[] fc2_bias) -> bool",
        &mlp_fp8_weights_current);
  m.def("mlp_accept_fp8_weights(int handle, Tensor[] fc1_weight, Tensor[] fc1_bias, Tensor[] fc2_weight, "
        "Tensor[] fc2_bias) -> ()",
        &mlp_accept_fp8_weights);
  m.def("mlp_rebind_weights(int handle, Tensor[] fc1_weight, Tensor[] fc1_bias, Tensor[] fc2_weight, "
        "Tensor[] fc2_bias) -> ()",
        &mlp_rebind_weights);
  m.def("mlp_destroy(int handle) -> ()", &mlp_destroy);
  m.def("state_headers() -> int[]", &state_headers);
  m.def("mlp_check_errors(int handle) -> ()", &mlp_check_errors);
  m.def("mlp_workspace_bytes(int handle) -> int", &mlp_workspace_bytes);
  m.def("mlp_state_bytes(int handle) -> int", &mlp_state_bytes);
  m.def("mlp_forward(int handle, Tensor x, Tensor routing, Tensor probs, Tensor[] fc1_weight, Tensor[] fc1_bias, "
        "Tensor[] fc2_weight, Tensor[] fc2_bias, int state_bytes) -> (Tensor, Tensor, Tensor)");
  m.def("mlp_backward(int handle, Tensor(t!) state, Tensor(s!) state_header, Tensor? x, Tensor dy, int slots, "
        "Tensor(a!)[] fc1_weight_grad, Tensor(b!)[] fc1_bias_grad, Tensor(c!)[] fc2_weight_grad, "
        "Tensor(d!)[] fc2_bias_grad) -> (Tensor, Tensor)");
  m.def("mlp_backward_dw(int handle, Tensor state, Tensor(s!) state_header, Tensor? x, Tensor(a!)[] fc1_weight_grad, "
        "Tensor(b!)[] fc1_bias_grad, Tensor(c!)[] fc2_weight_grad, Tensor(d!)[] fc2_bias_grad) -> ()");
}

// The state header is a CPU tensor: dispatch on the CUDA tensors of the call (CompositeExplicit
// would also do; CUDA keeps the fake/meta path separate).
TORCH_LIBRARY_IMPL(moe_engine, CUDA, m) {
  m.impl("mlp_forward", &mlp_forward);
  m.impl("mlp_backward", &mlp_backward);
  m.impl("mlp_backward_dw", &mlp_backward_dw);
}

}  // namespace moe::torch_ext
