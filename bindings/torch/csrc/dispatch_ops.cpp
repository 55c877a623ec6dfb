// TORCH_LIBRARY operators of token dispatch: a moe::Dispatcher per handle (its workspace holds the
// plan of the last permute, which unpermute and both backwards use), permute + pad, unpermute +
// unpad and their backwards.
#include <torch/library.h>

#include <string>

#include "csrc/handle_registry.h"
#include "csrc/torch_interop.h"
#include "moe/dispatch.h"
#include "moe/error_word.h"

namespace moe::torch_ext {
namespace {

// A dispatcher and the device error word its plans report into.
struct DispatchState {
  explicit DispatchState(const DispatcherConfig& c) : d(c) {}
  Dispatcher d;
  ErrorWord errors;
};

HandleRegistry<DispatchState>& registry() {
  static HandleRegistry<DispatchState> r;
  return r;
}

int64_t dispatcher_create(int64_t max_tokens, int64_t experts, int64_t topk, int64_t hidden, bool map_routing,
                          int64_t align, bool pre_padded, int64_t row_bound, const std::string& dtype) {
  return translate_errors([&] {
    DispatcherConfig c;
    c.max_tokens = max_tokens;
    c.num_experts = static_cast<int>(experts);
    c.topk = static_cast<int>(topk);
    c.hidden = hidden;
    c.form = map_routing ? RoutingForm::kMap : RoutingForm::kTopK;
    c.options.align = static_cast<int>(align);
    c.options.pre_padded = pre_padded;
    c.options.row_bound = row_bound;
    c.row_dtype = dtype_from_name(dtype, "dtype");
    return registry().add(std::make_unique<DispatchState>(c));
  });
}

void dispatcher_destroy(int64_t handle) { registry().remove(handle); }

int64_t dispatcher_rows(int64_t handle) { return registry().get(handle).d.rows(); }

void dispatcher_check_errors(int64_t handle) {
  DispatchState& st = registry().get(handle);
  translate_errors([&] {
    st.errors.check(current_stream());
    return 0;
  });
}

// -> x_perm [R, H], probs_perm fp32 [R], group_offsets int32 [E + 1], tokens_per_expert int64 [E]
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> dispatch_permute(int64_t handle, const at::Tensor& x,
                                                                             const at::Tensor& routing,
                                                                             const at::Tensor& probs, int64_t rows,
                                                                             int64_t experts) {
  DispatchState& st = registry().get(handle);
  Dispatcher& d = st.d;
  return translate_errors([&] {
    MOE_CHECK(rows == d.rows() && experts == d.config().num_experts, "argument 'rows'/'experts': expected ", d.rows(),
              "/", d.config().num_experts, ", got ", rows, "/", experts);
    RoutingView r;
    r.form = d.config().form;
    (r.form == RoutingForm::kTopK ? r.indices : r.map) = view(routing);
    r.probs = view(probs);
    cudaStream_t s = current_stream();
    d.plan(r, st.errors.device_ptr(), s);
    at::Tensor x_perm = at::empty({d.rows(), x.size(1)}, x.options());
    d.permute(view(x), view(x_perm), s);
    // The plan's small outputs are copied out of the dispatcher's workspace so they stay valid.
    const int E = d.config().num_experts;
    auto opts = x.options();
    at::Tensor probs_perm = at::empty({d.rows()}, opts.dtype(at::kFloat));
    at::Tensor groups = at::empty({E + 1}, opts.dtype(at::kInt));
    at::Tensor counts = at::empty({E}, opts.dtype(at::kLong));
    cudaMemcpyAsync(probs_perm.data_ptr(), d.probs_perm().data, probs_perm.nbytes(), cudaMemcpyDeviceToDevice, s);
    cudaMemcpyAsync(groups.data_ptr(), d.group_offsets().data, groups.nbytes(), cudaMemcpyDeviceToDevice, s);
    cudaMemcpyAsync(counts.data_ptr(), d.counts(DType::kInt64).data, counts.nbytes(), cudaMemcpyDeviceToDevice, s);
    return std::make_tuple(x_perm, probs_perm, groups, counts);
  });
}

// d_x_perm [R, H], d_probs_perm fp32 [R] (may be undefined) -> dx [T, H], dprobs fp32 [T, slots]
std::tuple<at::Tensor, at::Tensor> dispatch_permute_backward(int64_t handle, const at::Tensor& d_x_perm,
                                                             const c10::optional<at::Tensor>& d_probs_perm,
                                                             int64_t tokens, int64_t slots) {
  Dispatcher& d = registry().get(handle).d;
  return translate_errors([&] {
    MOE_CHECK(tokens == d.tokens() && slots == d.slots_per_token(), "argument 'tokens'/'slots': expected ",
              d.tokens(), "/", d.slots_per_token(), " (the last permute), got ", tokens, "/", slots);
    at::Tensor dx = at::empty({d.tokens(), d_x_perm.size(1)}, d_x_perm.options());
    at::Tensor dprobs = at::empty({d.tokens(), d.slots_per_token()}, d_x_perm.options().dtype(at::kFloat));
    TensorView dpp = d_probs_perm ? view(*d_probs_perm) : TensorView();
    TensorView dp = view(dprobs);
    if (d_probs_perm)
      d.permute_backward(view(d_x_perm), view(dx), current_stream(), &dpp, &dp);
    else {
      d.permute_backward(view(d_x_perm), view(dx), current_stream());
      dprobs.zero_();
    }
    return std::make_tuple(dx, dprobs);
  });
}

at::Tensor dispatch_unpermute(int64_t handle, const at::Tensor& Y, bool merge_probs, int64_t tokens) {
  Dispatcher& d = registry().get(handle).d;
  return translate_errors([&] {
    MOE_CHECK(tokens == d.tokens(), "argument 'tokens': expected ", d.tokens(), " (the last permute), got ", tokens);
    at::Tensor y = at::empty({d.tokens(), Y.size(1)}, Y.options());
    d.unpermute(view(Y), view(y), merge_probs, current_stream());
    return y;
  });
}

// dy [T, H] (+ Y [R, H] when merging probs) -> dY [R, H], dprobs fp32 [T, slots]
std::tuple<at::Tensor, at::Tensor> dispatch_unpermute_backward(int64_t handle, const at::Tensor& dy,
                                                               const at::Tensor& Y, bool merge_probs, int64_t slots) {
  Dispatcher& d = registry().get(handle).d;
  return translate_errors([&] {
    MOE_CHECK(slots == d.slots_per_token(), "argument 'slots': expected ", d.slots_per_token(), ", got ", slots);
    at::Tensor dY = at::empty({d.rows(), dy.size(1)}, dy.options());
    at::Tensor dprobs = at::empty({d.tokens(), d.slots_per_token()}, dy.options().dtype(at::kFloat));
    TensorView Yv = view(Y), dp = view(dprobs);
    d.unpermute_backward(view(dy), view(dY), merge_probs, current_stream(), &Yv, &dp);
    return std::make_tuple(dY, dprobs);
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(moe_engine, m) {
  m.def("dispatcher_create(int max_tokens, int experts, int topk, int hidden, bool map_routing, int align, "
        "bool pre_padded, int row_bound, str dtype) -> int",
        &dispatcher_create);
  m.def("dispatcher_destroy(int handle) -> ()", &dispatcher_destroy);
  m.def("dispatcher_rows(int handle) -> int", &dispatcher_rows);
  m.def("dispatcher_check_errors(int handle) -> ()", &dispatcher_check_errors);
  m.def("dispatch_permute(int handle, Tensor x, Tensor routing, Tensor probs, int rows, int experts) "
        "-> (Tensor, Tensor, Tensor, Tensor)");
  m.def("dispatch_permute_backward(int handle, Tensor d_x_perm, Tensor? d_probs_perm, int tokens, int slots) "
        "-> (Tensor, Tensor)");
  m.def("dispatch_unpermute(int handle, Tensor Y, bool merge_probs, int tokens) -> Tensor");
  m.def("dispatch_unpermute_backward(int handle, Tensor dy, Tensor Y, bool merge_probs, int slots) "
        "-> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moe_engine, CUDA, m) {
  m.impl("dispatch_permute", &dispatch_permute);
  m.impl("dispatch_permute_backward", &dispatch_permute_backward);
  m.impl("dispatch_unpermute", &dispatch_unpermute);
  m.impl("dispatch_unpermute_backward", &dispatch_unpermute_backward);
}

}  // namespace moe::torch_ext
