// TORCH_LIBRARY operators of the experts alone (moe::GroupedExperts): rows already dispatched into
// ragged expert groups by any dispatcher -> expert outputs, forward, backward, backward_dw. As for
// the layer, each forward returns its saved state as two tensors that autograd keeps; x_perm,
// group_offsets and probs_perm (and dY in delayed mode) are read again by address, so the Python
// side keeps those tensors alive with the state.
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/fp8_weight_views.h"
#include "csrc/handle_registry.h"
#include "csrc/param_binding.h"
#include "csrc/torch_interop.h"
#include "moe/grouped_experts.h"

namespace moe::torch_ext {
namespace {

using ExpertsState = Bound<GroupedExperts>;
constexpr int kHeaders = GroupedExperts::kStateHeaders;

HandleRegistry<ExpertsState>& registry() {
  static HandleRegistry<ExpertsState> r;
  return r;
}

int64_t experts_create(int64_t hidden, int64_t ffn, int64_t experts, int64_t max_rows, const std::string& activation,
                       int64_t glu_interleave, double alpha, double limit, double offset, bool bias,
                       bool probs_at_combine, bool per_expert, bool accumulate, bool fp32_wgrad, bool delay_wgrad,
                       bool fuse_fc1, bool fuse_fc2_dgrad, const std::string& fp8,
                       const std::string& fp8_weight_refresh) {
  return translate_errors([&] {
    ExpertsConfig c;
    c.hidden = hidden;
    c.ffn = ffn;
    c.experts = to_int(experts, "experts");
    c.max_rows = max_rows;
    set_expert_options(c, activation, glu_interleave, alpha, limit, offset, bias, probs_at_combine, per_expert,
                       accumulate, fp32_wgrad, delay_wgrad);
    c.fuse_fc1 = fuse_fc1;
    c.fuse_fc2_dgrad = fuse_fc2_dgrad;
    set_fp8_options(c, fp8, fp8_weight_refresh);
    return registry().add(std::make_unique<ExpertsState>(c));
  });
}

void experts_destroy(int64_t handle) { registry().remove(handle); }
int64_t experts_state_bytes(int64_t handle) { return static_cast<int64_t>(registry().get(handle).op.state_bytes()); }

// x_perm [rows, H], group_offsets int32 [E + 1], probs_perm fp32 [rows] or None -> Y [rows, H], state, header.
std::tuple<at::Tensor, at::Tensor, at::Tensor> experts_forward(
    int64_t handle, const at::Tensor& x_perm, const at::Tensor& group_offsets, const c10::optional<at::Tensor>& probs_perm,
    const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1, const std::vector<at::Tensor>& w2,
    const std::vector<at::Tensor>& b2, int64_t state_bytes) {
  ExpertsState& s = registry().get(handle);
  return translate_errors([&] {
    GroupedExperts& ex = s.op;
    require_dims(x_perm, "x_perm", 2);
    MOE_CHECK(state_bytes == static_cast<int64_t>(ex.state_bytes()), "argument 'state_bytes': expected ",
              ex.state_bytes(), ", got ", state_bytes);
    s.bind_weights(w1, b1, w2, b2);
    at::Tensor Y = at::empty_like(x_perm, at::MemoryFormat::Contiguous);
    auto [dev, host] = new_state_tensors(ex.state_bytes(), kHeaders, x_perm);
    ex.forward(view(x_perm, "x_perm"), view(group_offsets, "group_offsets"),
               probs_perm ? view(*probs_perm, "probs_perm") : TensorView(), view(Y, "Y"), state_of(dev, host, kHeaders),
               current_stream());
    return std::make_tuple(Y, dev, host);
  });
}

// The inputs the forward read (x_perm, group_offsets, probs_perm) are passed again: autograd may
// have moved them (offloading), so the state is pointed at their current addresses first.
void relocate(const GroupedExperts& ex, const SavedState& st, const at::Tensor* x_perm, const at::Tensor& group_offsets,
              const c10::optional<at::Tensor>& probs_perm, const at::Tensor* dY) {
  const TensorView d = dY ? view(*dY, "dY") : TensorView();
  ex.relocate(st, x_perm ? view(*x_perm, "x_perm") : TensorView(), view(group_offsets, "group_offsets"),
              probs_perm ? view(*probs_perm, "probs_perm") : TensorView(), dY ? &d : nullptr);
}

// backward_dw's saved inputs: an empty 1-D tensor stands for one the module did not keep because
// the FP8 backward_dw never reads it (x_perm, and dY without bias: the state holds their FP8
// copies). Rows of zero tokens arrive as [0, H], so they are never mistaken for it.
bool kept(const at::Tensor& t) { return !(t.dim() == 1 && t.numel() == 0); }

// dY [rows, H] -> dx_perm [rows, H], d_probs_perm fp32 [rows] (empty [0] without probs).
std::tuple<at::Tensor, at::Tensor> experts_backward(int64_t handle, const at::Tensor& state, const at::Tensor& header,
                                                     const at::Tensor& x_perm, const at::Tensor& group_offsets,
                                                     const c10::optional<at::Tensor>& probs_perm, const at::Tensor& dY,
                                                     bool with_probs, const std::vector<at::Tensor>& gw1,
                                                     const std::vector<at::Tensor>& gb1,
                                                     const std::vector<at::Tensor>& gw2,
                                                     const std::vector<at::Tensor>& gb2) {
  ExpertsState& s = registry().get(handle);
  return translate_errors([&] {
    GroupedExperts& ex = s.op;
    const SavedState st = state_of(state, header, kHeaders);
    require_dims(dY, "dY", 2);
    const bool probs = ex.config().probs == ProbsPlacement::kInActivation;
    MOE_CHECK(with_probs == probs, "argument 'with_probs': expected ", probs ? "true" : "false",
              " (the experts' probs placement)");
    relocate(ex, st, &x_perm, group_offsets, probs_perm, nullptr);
    const WeightGrads weight_grads = s.bind_backward_grads(ex.config().delay_wgrad, gw1, gb1, gw2, gb2);
    at::Tensor dx_perm = at::empty_like(dY, at::MemoryFormat::Contiguous);
    at::Tensor dpp = at::empty({probs ? dY.size(0) : 0}, dY.options().dtype(at::kFloat));
    ex.backward(view(dY, "dY"), view(dx_perm, "dx_perm"), probs ? view(dpp, "d_probs_perm") : TensorView(), st,
                current_stream(), weight_grads);
    return std::make_tuple(dx_perm, dpp);
  });
}

void experts_backward_dw(int64_t handle, const at::Tensor& state, const at::Tensor& header, const at::Tensor& x_perm,
                         const at::Tensor& group_offsets, const c10::optional<at::Tensor>& probs_perm,
                         const at::Tensor& dY, const std::vector<at::Tensor>& gw1, const std::vector<at::Tensor>& gb1,
                         const std::vector<at::Tensor>& gw2, const std::vector<at::Tensor>& gb2) {
  ExpertsState& s = registry().get(handle);
  translate_errors([&] {
    const SavedState st = state_of(state, header, kHeaders);
    relocate(s.op, st, kept(x_perm) ? &x_perm : nullptr, group_offsets, probs_perm, kept(dY) ? &dY : nullptr);
    s.bind_grads(gw1, gb1, gw2, gb2);
    s.op.backward_dw(st, current_stream());
    return 0;
  });
}

// FP8 with weights quantized on request (or from fp32 master weights): binds the weights (as a
// forward would) and quantizes them.
void experts_refresh_fp8_weights(int64_t handle, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                                 const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  ExpertsState& s = registry().get(handle);
  translate_errors([&] {
    s.bind_weights(w1, b1, w2, b2);
    s.op.refresh_fp8_weights(current_stream());
    return 0;
  });
}

// FP8 or emulated: the parts of the quantized weight copies the format stores (fp8_weight_views),
// for the Python side to clone or to copy loaded bytes into right away.
std::tuple<std::vector<int64_t>, std::vector<at::Tensor>> experts_fp8_weight_views(int64_t handle) {
  ExpertsState& s = registry().get(handle);
  return translate_errors([&] { return fp8_weight_views(s.op); });
}

// Binds the weights (as a forward would: parameters that moved are a new binding) and tells whether
// the copies were made for them (GroupedExperts::fp8_weights_current).
bool experts_fp8_weights_current(int64_t handle, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                                 const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  ExpertsState& s = registry().get(handle);
  return translate_errors([&] {
    s.bind_weights(w1, b1, w2, b2);
    return s.op.fp8_weights_current();
  });
}

// The copies were written through the views: binds the weights (as a forward would) and accepts the
// copies for them (GroupedExperts::accept_fp8_weights), on the current stream.
void experts_accept_fp8_weights(int64_t handle, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                                const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  ExpertsState& s = registry().get(handle);
  translate_errors([&] {
    s.bind_weights(w1, b1, w2, b2);
    s.op.accept_fp8_weights(current_stream());
    return 0;
  });
}

// The same weights at new addresses between forwards and their backwards (Bound::rebind_weights).
void experts_rebind_weights(int64_t handle, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                            const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  ExpertsState& s = registry().get(handle);
  translate_errors([&] {
    s.rebind_weights(w1, b1, w2, b2);
    return 0;
  });
}

void experts_check_errors(int64_t handle) {
  ExpertsState& s = registry().get(handle);
  translate_errors([&] {
    s.op.check_errors(current_stream());
    return 0;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_engine, m) {
  m.def("experts_create(int hidden, int ffn, int experts, int max_rows, str activation, int glu_interleave, "
        "float alpha, float limit, float offset, bool bias, bool probs_at_combine, bool per_expert, "
        "bool accumulate, bool fp32_wgrad, bool delay_wgrad, bool fuse_fc1=False, bool fuse_fc2_dgrad=False, "
        "str fp8=\"none\", str fp8_weight_refresh=\"every_forward\") -> int",
        &experts_create);
  m.def("experts_refresh_fp8_weights(int handle, Tensor[] fc1_weight, Tensor[] fc1_bias, Tensor[] fc2_weight, "
        "Tensor[] fc2_bias) -> ()",
        &experts_refresh_fp8_weights);
  m.def("experts_fp8_weight_views(int handle) -> (int[], Tensor[])", &experts_fp8_weight_views);
  m.def("experts_fp8_weights_current(int handle, Tensor[] fc1_weight, Tensor[] fc1_bias, Tensor[] fc2_weight, "
        "Tensor[] fc2_bias) -> bool",
        &experts_fp8_weights_current);
  m.def("experts_accept_fp8_weights(int handle, Tensor[] fc1_weight, Tensor[] fc1_bias, Tensor[] fc2_weight, "
        "Tensor[] fc2_bias) -> ()",
        &experts_accept_fp8_weights);
  m.def("experts_rebind_weights(int handle, Tensor[] fc1_weight, Tensor[] fc1_bias, Tensor[] fc2_weight, "
        "Tensor[] fc2_bias) -> ()",
        &experts_rebind_weights);
  m.def("experts_check_errors(int handle) -> ()", &experts_check_errors);
  m.def("experts_destroy(int handle) -> ()", &experts_destroy);
  m.def("experts_state_bytes(int handle) -> int", &experts_state_bytes);
  m.def("experts_forward(int handle, Tensor x_perm, Tensor group_offsets, Tensor? probs_perm, Tensor[] fc1_weight, "
        "Tensor[] fc1_bias, Tensor[] fc2_weight, Tensor[] fc2_bias, int state_bytes) -> (Tensor, Tensor, Tensor)");
  m.def("experts_backward(int handle, Tensor(t!) state, Tensor(s!) state_header, Tensor x_perm, Tensor group_offsets, "
        "Tensor? probs_perm, Tensor dY, bool with_probs, Tensor(a!)[] fc1_weight_grad, Tensor(b!)[] fc1_bias_grad, "
        "Tensor(c!)[] fc2_weight_grad, Tensor(d!)[] fc2_bias_grad) -> (Tensor, Tensor)");
  m.def("experts_backward_dw(int handle, Tensor state, Tensor(s!) state_header, Tensor x_perm, Tensor group_offsets, "
        "Tensor? probs_perm, Tensor dY, Tensor(a!)[] fc1_weight_grad, Tensor(b!)[] fc1_bias_grad, "
        "Tensor(c!)[] fc2_weight_grad, Tensor(d!)[] fc2_bias_grad) -> ()");
}

TORCH_LIBRARY_IMPL(moe_engine, CUDA, m) {
  m.impl("experts_forward", &experts_forward);
  m.impl("experts_backward", &experts_backward);
  m.impl("experts_backward_dw", &experts_backward_dw);
}

}  // namespace moe::torch_ext
