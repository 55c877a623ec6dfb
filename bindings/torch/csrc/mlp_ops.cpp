// TORCH_LIBRARY operators of the expert layer: create/destroy a moe::GroupedMlp, forward,
// backward, backward_dw. Parameters and gradients arrive as tensor lists (one grouped tensor or E
// per-expert tensors) and are (re)bound only when their addresses change, so steady-state calls
// -- and CUDA-graph replays -- do no host work beyond enqueueing kernels.
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <vector>

#include "csrc/handle_registry.h"
#include "csrc/torch_interop.h"
#include "moe/grouped_mlp.h"

namespace moe::torch_ext {
namespace {

struct MlpState {
  explicit MlpState(const GroupedMlpConfig& c) : layer(c) {}
  GroupedMlp layer;
  std::vector<const void*> weight_ptrs, grad_ptrs;  // addresses bound last
};

HandleRegistry<MlpState>& registry() {
  static HandleRegistry<MlpState> r;
  return r;
}

std::vector<const void*> addresses(std::initializer_list<const std::vector<at::Tensor>*> lists) {
  std::vector<const void*> out;
  for (const auto* l : lists) {
    out.push_back(nullptr);  // list separator: distinguishes ([a], []) from ([], [a])
    for (const auto& t : *l) out.push_back(t.data_ptr());
  }
  return out;
}

bool capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(current_stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone;
}

// Binding per-expert tensors uploads a pointer table (a synchronous copy): never inside a capture.
void check_rebind_allowed(const char* what) {
  TORCH_CHECK(!capturing(), "moe_engine: the ", what,
              " tensors changed address during CUDA graph capture; run one eager step with the same tensors "
              "before capturing (binding per-expert tensors needs a synchronous upload)");
}

ExpertTensors expert_tensors(const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                             const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  return ExpertTensors{views(w1), views(b1), views(w2), views(b2)};
}

void bind_grads(MlpState& s, const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  auto ptrs = addresses({&w1, &b1, &w2, &b2});
  if (ptrs == s.grad_ptrs) return;
  const bool grouped_only = w1.size() <= 1 && b1.size() <= 1 && w2.size() <= 1 && b2.size() <= 1;
  if (!grouped_only) check_rebind_allowed("gradient");
  s.layer.set_grads(expert_tensors(w1, b1, w2, b2));
  s.grad_ptrs = std::move(ptrs);
}

int64_t mlp_create(int64_t hidden, int64_t ffn, int64_t experts, int64_t topk, int64_t max_tokens,
                   const std::string& activation, int64_t glu_interleave, double alpha, double limit, double offset,
                   bool bias, bool probs_at_combine, int64_t align, bool pre_padded, int64_t row_bound,
                   bool map_routing, bool per_expert, bool accumulate, bool fp32_wgrad, bool delay_wgrad) {
  return translate_errors([&] {
    GroupedMlpConfig c;
    c.hidden = hidden;
    c.ffn = ffn;
    c.experts = static_cast<int>(experts);
    c.topk = static_cast<int>(topk);
    c.max_tokens = max_tokens;
    c.routing_form = map_routing ? RoutingForm::kMap : RoutingForm::kTopK;
    c.dispatch.align = static_cast<int>(align);
    c.dispatch.pre_padded = pre_padded;
    c.dispatch.row_bound = row_bound;
    c.activation.kind = activation_from_name(activation);
    c.activation.glu_interleave = static_cast<int>(glu_interleave);
    c.activation.alpha = static_cast<float>(alpha);
    c.activation.limit = static_cast<float>(limit);
    c.activation.offset = static_cast<float>(offset);
    c.bias = bias;
    c.probs = probs_at_combine ? ProbsPlacement::kAtCombine : ProbsPlacement::kInActivation;
    c.layout = per_expert ? WeightLayout::kPerExpert : WeightLayout::kSingleGrouped;
    c.wgrad = accumulate ? WgradMode::kAccumulate : WgradMode::kWrite;
    c.wgrad_dtype = fp32_wgrad ? DType::kFP32 : DType::kBF16;
    c.delay_wgrad = delay_wgrad;
    return registry().add(std::make_unique<MlpState>(c));
  });
}

void mlp_destroy(int64_t handle) { registry().remove(handle); }

at::Tensor mlp_forward(int64_t handle, const at::Tensor& x, const at::Tensor& routing, const at::Tensor& probs,
                       const std::vector<at::Tensor>& w1, const std::vector<at::Tensor>& b1,
                       const std::vector<at::Tensor>& w2, const std::vector<at::Tensor>& b2) {
  MlpState& s = registry().get(handle);
  return translate_errors([&] {
    auto ptrs = addresses({&w1, &b1, &w2, &b2});
    if (ptrs != s.weight_ptrs) {
      check_rebind_allowed("weight");
      s.layer.set_weights(expert_tensors(w1, b1, w2, b2));
      s.weight_ptrs = std::move(ptrs);
    }
    RoutingView r;
    r.form = s.layer.config().routing_form;
    (r.form == RoutingForm::kTopK ? r.indices : r.map) = view(routing);
    r.probs = view(probs);
    at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
    s.layer.forward(view(x), r, view(y), current_stream());
    return y;
  });
}

std::tuple<at::Tensor, at::Tensor> mlp_backward(int64_t handle, const at::Tensor& dy, int64_t slots,
                                                 const std::vector<at::Tensor>& gw1, const std::vector<at::Tensor>& gb1,
                                                 const std::vector<at::Tensor>& gw2, const std::vector<at::Tensor>& gb2) {
  MlpState& s = registry().get(handle);
  return translate_errors([&] {
    if (!s.layer.config().delay_wgrad) bind_grads(s, gw1, gb1, gw2, gb2);
    at::Tensor dx = at::empty_like(dy, at::MemoryFormat::Contiguous);
    at::Tensor dprobs = at::empty({dy.size(0), slots}, dy.options().dtype(at::kFloat));
    s.layer.backward(view(dy), view(dx), view(dprobs), current_stream());
    return std::make_tuple(dx, dprobs);
  });
}

void mlp_backward_dw(int64_t handle, const std::vector<at::Tensor>& gw1, const std::vector<at::Tensor>& gb1,
                     const std::vector<at::Tensor>& gw2, const std::vector<at::Tensor>& gb2) {
  MlpState& s = registry().get(handle);
  translate_errors([&] {
    bind_grads(s, gw1, gb1, gw2, gb2);
    s.layer.backward_dw(current_stream());
    return 0;
  });
}

void mlp_check_errors(int64_t handle) {
  MlpState& s = registry().get(handle);
  translate_errors([&] {
    s.layer.check_errors(current_stream());
    return 0;
  });
}

int64_t mlp_workspace_bytes(int64_t handle) { return static_cast<int64_t>(registry().get(handle).layer.workspace_bytes()); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_engine, m) {
  m.def("mlp_create(int hidden, int ffn, int experts, int topk, int max_tokens, str activation, int glu_interleave, "
        "float alpha, float limit, float offset, bool bias, bool probs_at_combine, int align, bool pre_padded, "
        "int row_bound, bool map_routing, bool per_expert, bool accumulate, bool fp32_wgrad, bool delay_wgrad) -> int",
        &mlp_create);
  m.def("mlp_destroy(int handle) -> ()", &mlp_destroy);
  m.def("mlp_check_errors(int handle) -> ()", &mlp_check_errors);
  m.def("mlp_workspace_bytes(int handle) -> int", &mlp_workspace_bytes);
  m.def("mlp_forward(int handle, Tensor x, Tensor routing, Tensor probs, Tensor[] fc1_weight, Tensor[] fc1_bias, "
        "Tensor[] fc2_weight, Tensor[] fc2_bias) -> Tensor");
  m.def("mlp_backward(int handle, Tensor dy, int slots, Tensor(a!)[] fc1_weight_grad, Tensor(b!)[] fc1_bias_grad, "
        "Tensor(c!)[] fc2_weight_grad, Tensor(d!)[] fc2_bias_grad) -> (Tensor, Tensor)");
  m.def("mlp_backward_dw(int handle, Tensor(a!)[] fc1_weight_grad, Tensor(b!)[] fc1_bias_grad, "
        "Tensor(c!)[] fc2_weight_grad, Tensor(d!)[] fc2_bias_grad) -> ()");
}

TORCH_LIBRARY_IMPL(moe_engine, CUDA, m) {
  m.impl("mlp_forward", &mlp_forward);
  m.impl("mlp_backward", &mlp_backward);
  m.impl("mlp_backward_dw", &mlp_backward_dw);
}

}  // namespace moe::torch_ext
