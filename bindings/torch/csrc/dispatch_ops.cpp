// TORCH_LIBRARY operators of token dispatch: a moe::Dispatcher per handle (configuration only),
// permute + pad, unpermute + unpad and their backwards. permute returns its plan as two tensors
// (device memory and a CPU header) that the other operators take: several plans may be alive.
#include <torch/library.h>

#include <string>

#include "csrc/handle_registry.h"
#include "csrc/torch_interop.h"
#include "moe/dispatch.h"
#include "moe/error_word.h"
#include <c10/cuda/CUDAException.h>

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
    c.num_experts = to_int(experts, "experts");
    c.topk = to_int(topk, "topk");
    c.hidden = hidden;
    c.form = map_routing ? RoutingForm::kMap : RoutingForm::kTopK;
    c.options.align = to_int(align, "align");
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

constexpr int kHeaders = Dispatcher::kPlanHeaders;

int64_t dispatcher_plan_bytes(int64_t handle) { return static_cast<int64_t>(registry().get(handle).d.plan_bytes()); }

// -> x_perm [R, H], probs_perm fp32 [R], group_offsets int32 [E + 1], tokens_per_expert int64 [E],
//    the plan (CUDA uint8 [plan_bytes]) and its header (CPU uint8). The small outputs are copies, so
//    they stay valid on their own.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> dispatch_permute(
    int64_t handle, const at::Tensor& x, const at::Tensor& routing, const at::Tensor& probs, int64_t rows,
    int64_t experts, int64_t plan_bytes) {
  DispatchState& st = registry().get(handle);
  const Dispatcher& d = st.d;
  return translate_errors([&] {
    MOE_CHECK(rows == d.rows() && experts == d.config().num_experts, "argument 'rows'/'experts': expected ", d.rows(),
              "/", d.config().num_experts, ", got ", rows, "/", experts);
    MOE_CHECK(plan_bytes == static_cast<int64_t>(d.plan_bytes()), "argument 'plan_bytes': expected ", d.plan_bytes(),
              ", got ", plan_bytes);
    require_dims(x, "x", 2);
    RoutingView r;
    r.form = d.config().form;
    (r.form == RoutingForm::kTopK ? r.indices : r.map) = view(routing, "routing");
    r.probs = view(probs, "probs");
    cudaStream_t s = current_stream();
    auto [dev, host] = new_state_tensors(d.plan_bytes(), kHeaders, x);
    const SavedState plan = state_of(dev, host, kHeaders);
    // Every argument is checked before the plan is written.
    check_device_tensor(view(x, "x"), "x", d.config().row_dtype, {x.size(0), d.config().hidden});
    MOE_CHECK(r.probs.ndim == 2 && r.probs.shape[0] == x.size(0), "argument 'probs': expected ", x.size(0),
              " rows (one per token of x), got shape ", r.probs.shape_string());
    d.plan(r, st.errors.device_ptr(), plan, s);
    at::Tensor x_perm = at::empty({d.rows(), x.size(1)}, x.options());
    d.permute(plan, view(x, "x"), view(x_perm, "x_perm"), s);
    const int E = d.config().num_experts;
    auto opts = x.options();
    at::Tensor probs_perm = at::empty({d.rows()}, opts.dtype(at::kFloat));
    at::Tensor groups = at::empty({E + 1}, opts.dtype(at::kInt));
    at::Tensor counts = at::empty({E}, opts.dtype(at::kLong));
    C10_CUDA_CHECK(cudaMemcpyAsync(probs_perm.data_ptr(), d.probs_perm(plan).data, probs_perm.nbytes(),
                                   cudaMemcpyDeviceToDevice, s));
    C10_CUDA_CHECK(cudaMemcpyAsync(groups.data_ptr(), d.group_offsets(plan).data, groups.nbytes(),
                                   cudaMemcpyDeviceToDevice, s));
    C10_CUDA_CHECK(cudaMemcpyAsync(counts.data_ptr(), d.counts(plan, DType::kInt64).data, counts.nbytes(),
                                   cudaMemcpyDeviceToDevice, s));
    return std::make_tuple(x_perm, probs_perm, groups, counts, dev, host);
  });
}

// d_x_perm [R, H], d_probs_perm fp32 [R] (may be None) -> dx [T, H], dprobs fp32 [T, slots]
std::tuple<at::Tensor, at::Tensor> dispatch_permute_backward(int64_t handle, const at::Tensor& plan_t,
                                                             const at::Tensor& header, const at::Tensor& d_x_perm,
                                                             const c10::optional<at::Tensor>& d_probs_perm,
                                                             int64_t tokens, int64_t slots) {
  const Dispatcher& d = registry().get(handle).d;
  return translate_errors([&] {
    const SavedState plan = state_of(plan_t, header, kHeaders, "plan", "plan_header");
    require_dims(d_x_perm, "d_x_perm", 2);
    const int64_t T = d.tokens(plan);
    MOE_CHECK(tokens == T && slots == d.slots_per_token(), "argument 'tokens'/'slots': expected ", T, "/",
              d.slots_per_token(), " (the plan's), got ", tokens, "/", slots);
    at::Tensor dx = at::empty({T, d_x_perm.size(1)}, d_x_perm.options());
    at::Tensor dprobs = at::empty({T, d.slots_per_token()}, d_x_perm.options().dtype(at::kFloat));
    TensorView dpp = d_probs_perm ? view(*d_probs_perm, "d_probs_perm") : TensorView();
    TensorView dp = view(dprobs, "dprobs");
    if (d_probs_perm) {
      d.permute_backward(plan, view(d_x_perm, "d_x_perm"), view(dx, "dx"), current_stream(), &dpp, &dp);
    } else {
      d.permute_backward(plan, view(d_x_perm, "d_x_perm"), view(dx, "dx"), current_stream());
      dprobs.zero_();
    }
    return std::make_tuple(dx, dprobs);
  });
}

// Y [R, H] -> y [T, H]; merged with probs fp32 [T, slots] when given (the probs passed here, not
// those of the plan), unweighted otherwise.
at::Tensor dispatch_unpermute(int64_t handle, const at::Tensor& plan_t, const at::Tensor& header, const at::Tensor& Y,
                              const c10::optional<at::Tensor>& probs, int64_t tokens) {
  const Dispatcher& d = registry().get(handle).d;
  return translate_errors([&] {
    const SavedState plan = state_of(plan_t, header, kHeaders, "plan", "plan_header");
    require_dims(Y, "Y", 2);
    const int64_t T = d.tokens(plan);
    MOE_CHECK(tokens == T, "argument 'tokens': expected ", T, " (the plan's), got ", tokens);
    at::Tensor y = at::empty({T, Y.size(1)}, Y.options());
    const TensorView pv = probs ? view(*probs, "probs") : TensorView();
    d.unpermute(plan, view(Y, "Y"), view(y, "y"), probs ? MergeProbs::kGiven : MergeProbs::kNone, current_stream(),
                &pv);
    return y;
  });
}

// dy [T, H] (+ Y [R, H] and probs when merging) -> dY [R, H], dprobs fp32 [T, slots]
std::tuple<at::Tensor, at::Tensor> dispatch_unpermute_backward(int64_t handle, const at::Tensor& plan_t,
                                                               const at::Tensor& header, const at::Tensor& dy,
                                                               const at::Tensor& Y,
                                                               const c10::optional<at::Tensor>& probs, int64_t slots) {
  const Dispatcher& d = registry().get(handle).d;
  return translate_errors([&] {
    const SavedState plan = state_of(plan_t, header, kHeaders, "plan", "plan_header");
    require_dims(dy, "dy", 2);
    MOE_CHECK(slots == d.slots_per_token(), "argument 'slots': expected ", d.slots_per_token(), ", got ", slots);
    at::Tensor dY = at::empty({d.rows(), dy.size(1)}, dy.options());
    at::Tensor dprobs = at::empty({d.tokens(plan), d.slots_per_token()}, dy.options().dtype(at::kFloat));
    const TensorView Yv = view(Y, "Y"), dp = view(dprobs, "dprobs");
    const TensorView pv = probs ? view(*probs, "probs") : TensorView();
    d.unpermute_backward(plan, view(dy, "dy"), view(dY, "dY"), probs ? MergeProbs::kGiven : MergeProbs::kNone,
                         current_stream(), &pv, &Yv, &dp);
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
  m.def("dispatcher_plan_bytes(int handle) -> int", &dispatcher_plan_bytes);
  m.def("dispatcher_check_errors(int handle) -> ()", &dispatcher_check_errors);
  m.def("dispatch_permute(int handle, Tensor x, Tensor routing, Tensor probs, int rows, int experts, int plan_bytes) "
        "-> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  m.def("dispatch_permute_backward(int handle, Tensor plan, Tensor plan_header, Tensor d_x_perm, "
        "Tensor? d_probs_perm, int tokens, int slots) -> (Tensor, Tensor)");
  m.def("dispatch_unpermute(int handle, Tensor plan, Tensor plan_header, Tensor Y, Tensor? probs, int tokens) "
        "-> Tensor");
  m.def("dispatch_unpermute_backward(int handle, Tensor plan, Tensor plan_header, Tensor dy, Tensor Y, "
        "Tensor? probs, int slots) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(moe_engine, CUDA, m) {
  m.impl("dispatch_permute", &dispatch_permute);
  m.impl("dispatch_permute_backward", &dispatch_permute_backward);
  m.impl("dispatch_unpermute", &dispatch_unpermute);
  m.impl("dispatch_unpermute_backward", &dispatch_unpermute_backward);
}

}  // namespace moe::torch_ext
