// TORCH_LIBRARY operators of the fused router: a moe::Router per handle (config and scratch; no
// per-call state: what backward needs is returned by forward and saved by autograd), forward,
// backward, and the expert-bias update.
#include <torch/library.h>

#include <algorithm>
#include <string>

#include "csrc/handle_registry.h"
#include "csrc/torch_interop.h"
#include "moe/error_word.h"
#include "moe/router.h"

namespace moe::torch_ext {
namespace {

struct RouterState {
  explicit RouterState(const RouterConfig& c) : r(c) {}
  Router r;
  ErrorWord errors;
};

HandleRegistry<RouterState>& registry() {
  static HandleRegistry<RouterState> r;
  return r;
}

int64_t router_create(int64_t experts, int64_t topk, int64_t max_tokens, const std::string& score,
                      bool softmax_after_topk, bool normalize_topk, double scaling_factor, bool expert_bias,
                      int64_t num_groups, int64_t topk_groups, double aux_loss_coeff, double seq_aux_loss_coeff,
                      int64_t seq_length, double z_loss_coeff, double capacity_factor, const std::string& drop_policy,
                      const std::string& rounding, int64_t rounding_tile, int64_t rounding_candidates,
                      bool map_output) {
  return translate_errors([&] {
    RouterConfig c;
    c.num_experts = to_int(experts, "experts");
    c.topk = to_int(topk, "topk");
    c.max_tokens = max_tokens;
    MOE_CHECK(score == "softmax" || score == "sigmoid", "argument 'score': expected softmax or sigmoid, got ", score);
    c.score = score == "softmax" ? ScoreFunction::kSoftmax : ScoreFunction::kSigmoid;
    c.softmax_after_topk = softmax_after_topk;
    c.normalize_topk = normalize_topk;
    c.scaling_factor = to_float(scaling_factor, "scaling_factor");
    c.expert_bias = expert_bias;
    c.num_groups = to_int(num_groups, "num_groups");
    c.topk_groups = to_int(topk_groups, "topk_groups");
    c.aux_loss_coeff = to_float(aux_loss_coeff, "aux_loss_coeff");
    c.seq_aux_loss_coeff = to_float(seq_aux_loss_coeff, "seq_aux_loss_coeff");
    c.seq_length = seq_length;
    c.z_loss_coeff = to_float(z_loss_coeff, "z_loss_coeff");
    c.capacity_factor = capacity_factor;
    MOE_CHECK(drop_policy == "prob" || drop_policy == "position",
              "argument 'drop_policy': expected prob or position, got ", drop_policy);
    c.drop_policy = drop_policy == "prob" ? CapacityDropPolicy::kProb : CapacityDropPolicy::kPosition;
    if (rounding == "none")
      c.rounding = TokenRounding::kNone;
    else if (rounding == "down")
      c.rounding = TokenRounding::kDown;
    else if (rounding == "up")
      c.rounding = TokenRounding::kUp;
    else if (rounding == "nearest")
      c.rounding = TokenRounding::kNearest;
    else
      MOE_CHECK(false, "argument 'rounding': expected none, down, up or nearest, got ", rounding);
    c.rounding_tile = to_int(rounding_tile, "rounding_tile");
    c.rounding_candidates = to_int(rounding_candidates, "rounding_candidates");
    c.output_form = map_output ? RoutingForm::kMap : RoutingForm::kTopK;
    return registry().add(std::make_unique<RouterState>(c));
  });
}

void router_destroy(int64_t handle) { registry().remove(handle); }

int64_t router_selection_width(int64_t handle) { return registry().get(handle).r.selection_width(); }

void router_check_errors(int64_t handle) {
  RouterState& st = registry().get(handle);
  translate_errors([&] {
    st.errors.check(current_stream());
    return 0;
  });
}

// -> routing (indices int32 [T, k] or map bool [T, E]), probs fp32, selected int32 [T, W],
//    selection_counts int32 [E], counts int64 [E], seq_counts int32 [B, E], losses fp32 [3]
//    (aux, seq aux, z; 0 when off).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> router_forward(
    int64_t handle, const at::Tensor& logits, const c10::optional<at::Tensor>& bias, int64_t experts, int64_t topk,
    int64_t width, bool map_output, int64_t sequences) {
  RouterState& st = registry().get(handle);
  return translate_errors([&] {
    const RouterConfig& c = st.r.config();
    MOE_CHECK(experts == c.num_experts && topk == c.topk && width == st.r.selection_width() &&
                  map_output == (c.output_form == RoutingForm::kMap),
              "argument 'experts'/'topk'/'width'/'map_output': do not match the router");
    const int64_t T = logits.size(0);
    MOE_CHECK(sequences == (c.seq_aux_loss_coeff != 0.0f ? T / std::max<int64_t>(c.seq_length, 1) : 0),
              "argument 'sequences': expected T / seq_length");
    auto opts = logits.options();
    at::Tensor routing = map_output ? at::empty({T, experts}, opts.dtype(at::kBool))
                                    : at::empty({T, topk}, opts.dtype(at::kInt));
    at::Tensor probs = at::empty({T, map_output ? experts : topk}, opts.dtype(at::kFloat));
    at::Tensor selected = at::empty({T, width}, opts.dtype(at::kInt));
    at::Tensor selection_counts = at::empty({experts}, opts.dtype(at::kInt));
    at::Tensor counts32 = at::empty({experts}, opts.dtype(at::kInt));
    at::Tensor counts = at::empty({experts}, opts.dtype(at::kLong));
    at::Tensor seq_counts = at::empty({sequences, experts}, opts.dtype(at::kInt));
    at::Tensor losses = at::zeros({3}, opts.dtype(at::kFloat));
    RouterOutputs o;
    (map_output ? o.map : o.indices) = view(routing, "routing");
    o.probs = view(probs, "probs");
    o.selected = view(selected, "selected");
    o.selection_counts = view(selection_counts, "selection_counts");
    o.counts = view(counts32, "counts32");
    o.counts_int64 = view(counts, "counts");
    if (c.seq_aux_loss_coeff != 0.0f) o.seq_counts = view(seq_counts, "seq_counts");
    if (c.aux_loss_coeff != 0.0f) o.aux_loss = view(losses.narrow(0, 0, 1), "losses");
    if (c.seq_aux_loss_coeff != 0.0f) o.seq_aux_loss = view(losses.narrow(0, 1, 1), "losses");
    if (c.z_loss_coeff != 0.0f) o.z_loss = view(losses.narrow(0, 2, 1), "losses");
    st.r.forward(view(logits, "logits"), bias ? view(*bias, "bias") : TensorView(), o, st.errors.device_ptr(), current_stream());
    return std::make_tuple(routing, probs, selected, selection_counts, counts, seq_counts, losses);
  });
}

at::Tensor router_backward(int64_t handle, const at::Tensor& logits, const at::Tensor& routing,
                           const at::Tensor& selected, const at::Tensor& selection_counts,
                           const at::Tensor& seq_counts, const c10::optional<at::Tensor>& d_probs,
                           const c10::optional<at::Tensor>& d_losses) {
  RouterState& st = registry().get(handle);
  return translate_errors([&] {
    const RouterConfig& c = st.r.config();
    at::Tensor d_logits = at::empty_like(logits);
    RouterOutputs saved;
    (c.output_form == RoutingForm::kMap ? saved.map : saved.indices) = view(routing, "routing");
    saved.selected = view(selected, "selected");
    saved.selection_counts = view(selection_counts, "selection_counts");
    if (c.seq_aux_loss_coeff != 0.0f) saved.seq_counts = view(seq_counts, "seq_counts");
    RouterGrads g;
    if (d_probs) g.d_probs = view(*d_probs, "d_probs");
    if (d_losses) {
      MOE_CHECK(d_losses->numel() == 3 && d_losses->scalar_type() == at::kFloat,
                "argument 'd_losses': expected fp32 [3]");
      g.d_aux_loss = view(d_losses->narrow(0, 0, 1), "d_losses");
      g.d_seq_aux_loss = view(d_losses->narrow(0, 1, 1), "d_losses");
      g.d_z_loss = view(d_losses->narrow(0, 2, 1), "d_losses");
    }
    st.r.backward(view(logits, "logits"), saved, g, view(d_logits, "d_logits"), current_stream());
    return d_logits;
  });
}

void router_update_bias(const at::Tensor& counts, const at::Tensor& bias, double rate) {
  translate_errors([&] {
    update_expert_bias(view(counts, "counts"), view(bias, "bias"), to_float(rate, "rate"), current_stream());
    return 0;
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_engine, m) {
  m.def("router_create(int experts, int topk, int max_tokens, str score, bool softmax_after_topk, "
        "bool normalize_topk, float scaling_factor, bool expert_bias, int num_groups, int topk_groups, "
        "float aux_loss_coeff, float seq_aux_loss_coeff, int seq_length, float z_loss_coeff, float capacity_factor, "
        "str drop_policy, str rounding, int rounding_tile, int rounding_candidates, bool map_output) -> int",
        &router_create);
  m.def("router_destroy(int handle) -> ()", &router_destroy);
  m.def("router_selection_width(int handle) -> int", &router_selection_width);
  m.def("router_check_errors(int handle) -> ()", &router_check_errors);
  m.def("router_forward(int handle, Tensor logits, Tensor? bias, int experts, int topk, int width, bool map_output, "
        "int sequences) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("router_backward(int handle, Tensor logits, Tensor routing, Tensor selected, Tensor selection_counts, "
        "Tensor seq_counts, Tensor? d_probs, Tensor? d_losses) -> Tensor");
  m.def("router_update_bias(Tensor counts, Tensor(a!) bias, float rate) -> ()");
}

TORCH_LIBRARY_IMPL(moe_engine, CUDA, m) {
  m.impl("router_forward", &router_forward);
  m.impl("router_backward", &router_backward);
  m.impl("router_update_bias", &router_update_bias);
}

}  // namespace moe::torch_ext
