// moe::Router: argument checks, the one-time scratch, and the kernel launches (docs/router.md).
#include "moe/router.h"

#include <cmath>
#include <cstdint>
#include <iterator>
#include <utility>

#include "device/cuda_check.h"
#include "device/device_arena.h"
#include "moe/error.h"
#include "router/router_kernels.h"

namespace moe {

namespace {

// 16-byte vector access to rows of E elements at `data`: rows start 16-byte aligned and every lane's
// NJ experts lie inside the row.
bool vector_rows(const void* data, int E) {
  return E % kernels::router_experts_per_lane(E) == 0 && reinterpret_cast<uintptr_t>(data) % 16 == 0;
}

bool needs_select_pass(const RouterConfig& c) {
  return c.capacity_factor != 0.0 || c.rounding != TokenRounding::kNone;
}

int64_t sequences(const RouterConfig& c, int64_t T) { return c.seq_aux_loss_coeff != 0.0f ? T / c.seq_length : 0; }

// A CUDA, contiguous tensor of this dtype and shape, aligned to its element.
void check_tensor(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape) {
  check_device_tensor(t, name, dtype, shape, std::max(1, dtype_bits(dtype) / 8));
}

void check_scalar(const TensorView& t, const char* name) { check_tensor(t, name, DType::kFP32, {1}); }

}  // namespace

struct Router::Impl {
  RouterConfig cfg;
  int W = 0;
  char* block = nullptr;
  size_t bytes = 0;
  int32_t *count_acc = nullptr, *cand_acc = nullptr;
  unsigned long long *aux_acc = nullptr, *count_arrivals = nullptr;
  uint32_t* tickets = nullptr;
  float* z_partials = nullptr;
  double* seq_partials = nullptr;
  float *slot_prob = nullptr, *slot_key = nullptr;
  uint8_t* kept = nullptr;
  int32_t *cand_count = nullptr, *cand_offset = nullptr, *cand_cursor = nullptr, *list_slot = nullptr;
  uint64_t* list_key = nullptr;

  size_t carve(char* base) {
    const int E = cfg.num_experts;
    const int64_t slots = cfg.max_tokens * W;
    DeviceArena a(base);
    // Accumulators and tickets: zero from the constructor on; each kernel's last block clears them.
    count_acc = a.take<int32_t>(E);
    cand_acc = a.take<int32_t>(E);
    aux_acc = a.take<unsigned long long>(E);
    count_arrivals = a.take<unsigned long long>(int64_t{E} * kernels::kRouterArrivalStride);
    tickets = a.take<uint32_t>(2);
    z_partials = a.take<float>(kernels::kRouterMaxBlocks);
    seq_partials = a.take<double>(cfg.seq_aux_loss_coeff != 0.0f ? cfg.max_tokens / cfg.seq_length : 0);
    const int64_t sel = needs_select_pass(cfg) ? slots : 0;
    slot_prob = a.take<float>(sel);
    slot_key = a.take<float>(sel);
    kept = a.take<uint8_t>(sel);
    cand_count = a.take<int32_t>(E);
    cand_offset = a.take<int32_t>(E);
    cand_cursor = a.take<int32_t>(E);
    list_key = a.take<uint64_t>(sel);
    list_slot = a.take<int32_t>(sel);
    return a.used();
  }

  kernels::RouterRowParams row_params(const TensorView& logits, const float* bias) const {
    kernels::RouterRowParams p;
    p.T = static_cast<int32_t>(logits.shape[0]);
    p.E = cfg.num_experts;
    p.k = cfg.topk;
    p.W = W;
    p.G = kernels::router_lanes_per_row(cfg.num_experts);
    p.bf16 = logits.dtype == DType::kBF16;
    p.vec = vector_rows(logits.data, cfg.num_experts);
    p.logits = logits.data;
    p.bias = bias;
    p.score = cfg.score;
    p.softmax_after = cfg.softmax_after_topk;
    p.normalize = cfg.normalize_topk && !cfg.softmax_after_topk;
    p.alpha = cfg.scaling_factor;
    p.groups = cfg.num_groups;
    p.topk_groups = cfg.topk_groups;
    p.aux_coeff = cfg.aux_loss_coeff;
    p.seq_coeff = cfg.seq_aux_loss_coeff;
    p.z_coeff = cfg.z_loss_coeff;
    p.seq_length = static_cast<int32_t>(cfg.seq_length);
    return p;
  }

  // logits: bf16 / fp32 [T, E] on the device, T <= max_tokens; returns T.
  int64_t check_logits(const TensorView& logits, const char* name) const {
    MOE_CHECK(logits.dtype == DType::kBF16 || logits.dtype == DType::kFP32, "argument '", name,
              "': expected dtype bf16 or fp32, got ", dtype_name(logits.dtype));
    MOE_CHECK(logits.ndim == 2, "argument '", name, "': expected shape [T, ", cfg.num_experts, "], got ",
              logits.shape_string());
    const int64_t T = logits.shape[0];
    MOE_CHECK(T <= cfg.max_tokens, "argument '", name, "': T = ", T, " exceeds max_tokens = ", cfg.max_tokens);
    check_tensor(logits, name, logits.dtype, {T, cfg.num_experts});
    if (cfg.seq_aux_loss_coeff != 0.0f)
      MOE_CHECK(T % cfg.seq_length == 0, "argument '", name, "': T = ", T, " is not a multiple of seq_length = ",
                cfg.seq_length, " (the sequence aux loss needs whole sequences)");
    return T;
  }

  // The routing tensors forward writes and backward reads.
  void check_routing(const RouterOutputs& o, int64_t T, bool need_probs) const {
    const int E = cfg.num_experts, k = cfg.topk;
    if (cfg.output_form == RoutingForm::kTopK) {
      check_tensor(o.indices, "indices", DType::kInt32, {T, k});
      if (need_probs) check_tensor(o.probs, "probs", DType::kFP32, {T, k});
    } else {
      check_tensor(o.map, "map", o.map.dtype == DType::kBool ? DType::kBool : DType::kUInt8, {T, E});
      if (need_probs) check_tensor(o.probs, "probs", DType::kFP32, {T, E});
    }
    check_tensor(o.selected, "selected", DType::kInt32, {T, W});
    if (cfg.seq_aux_loss_coeff != 0.0f) check_tensor(o.seq_counts, "seq_counts", DType::kInt32, {sequences(cfg, T), E});
  }

  // No two outputs the forward writes share a byte: one buffer given as two would hold whichever the
  // kernels wrote last (the counts before and after a capacity's drops, indices and selected, ...).
  // Outputs the configuration does not write are not looked at.
  void check_outputs_disjoint(const RouterOutputs& o) const {
    const bool top_k = cfg.output_form == RoutingForm::kTopK;
    const std::pair<const char*, const TensorView*> written[] = {
        {top_k ? "indices" : "map", top_k ? &o.indices : &o.map},
        {"probs", &o.probs},
        {"selected", &o.selected},
        {"selection_counts", &o.selection_counts},
        {"counts", &o.counts},
        {"counts_int64", &o.counts_int64},
        {"seq_counts", cfg.seq_aux_loss_coeff != 0.0f ? &o.seq_counts : nullptr},
        {"aux_loss", cfg.aux_loss_coeff != 0.0f ? &o.aux_loss : nullptr},
        {"seq_aux_loss", cfg.seq_aux_loss_coeff != 0.0f ? &o.seq_aux_loss : nullptr},
        {"z_loss", cfg.z_loss_coeff != 0.0f ? &o.z_loss : nullptr},
    };
    for (size_t j = 0; j < std::size(written); ++j)
      for (size_t i = 0; i < j; ++i)
        MOE_CHECK(!written[i].second || !written[j].second || !bytes_overlap(*written[j].second, *written[i].second),
                  "argument '", written[j].first, "': overlaps '", written[i].first,
                  "'; the router writes each of its outputs");
  }
};

Router::Router(const RouterConfig& config) : impl_(std::make_unique<Impl>()) {
  validate_router_config(config);
  Impl& m = *impl_;
  m.cfg = config;
  m.W = router_selection_width(config);
  m.bytes = m.carve(nullptr);
  MOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&m.block), m.bytes));
  m.carve(m.block);
  MOE_CUDA_CHECK(cudaMemset(m.block, 0, m.bytes));
  MOE_CUDA_CHECK(cudaDeviceSynchronize());  // the memset is ordered before calls on any stream
}

Router::~Router() {
  if (impl_ && impl_->block) cudaFree(impl_->block);
}

const RouterConfig& Router::config() const { return impl_->cfg; }
int Router::selection_width() const { return impl_->W; }
size_t Router::workspace_bytes() const { return impl_->bytes; }
int64_t Router::capacity(int64_t T) const { return router_capacity(impl_->cfg, T); }

void Router::forward(const TensorView& logits, const TensorView& bias, const RouterOutputs& out, uint32_t* error_word,
                     cudaStream_t stream) const {
  const Impl& m = *impl_;
  const RouterConfig& c = m.cfg;
  const int E = c.num_experts;
  const int64_t T = m.check_logits(logits, "logits");
  MOE_CHECK(error_word != nullptr, "argument 'error_word': expected a device pointer, got null");
  if (c.expert_bias)
    check_tensor(bias, "bias", DType::kFP32, {E});
  else
    MOE_CHECK(bias.data == nullptr, "argument 'bias': given, but the router was built with expert_bias = false");
  m.check_routing(out, T, true);
  check_tensor(out.selection_counts, "selection_counts", DType::kInt32, {E});
  check_tensor(out.counts, "counts", DType::kInt32, {E});
  if (out.counts_int64.data) check_tensor(out.counts_int64, "counts_int64", DType::kInt64, {E});
  if (c.aux_loss_coeff != 0.0f) check_scalar(out.aux_loss, "aux_loss");
  if (c.seq_aux_loss_coeff != 0.0f) check_scalar(out.seq_aux_loss, "seq_aux_loss");
  if (c.z_loss_coeff != 0.0f) check_scalar(out.z_loss, "z_loss");
  m.check_outputs_disjoint(out);

  kernels::RouterForwardArgs a;
  a.p = m.row_params(logits, c.expert_bias ? bias.ptr<float>() : nullptr);
  a.form = c.output_form;
  a.out_vec = c.output_form == RoutingForm::kMap && vector_rows(out.map.data, E) && vector_rows(out.probs.data, E);
  if (c.capacity_factor != 0.0)
    a.select = c.drop_policy == CapacityDropPolicy::kProb ? kernels::SelectKey::kProb : kernels::SelectKey::kPosition;
  else if (c.rounding != TokenRounding::kNone)
    a.select = kernels::SelectKey::kScore;
  a.capacity = router_capacity(c, T);
  a.rounding = c.rounding;
  a.rounding_tile = c.rounding_tile;
  a.indices = out.indices.ptr<int32_t>();
  a.map = out.map.ptr<uint8_t>();
  a.probs = out.probs.ptr<float>();
  a.selected = out.selected.ptr<int32_t>();
  a.selection_counts = out.selection_counts.ptr<int32_t>();
  a.counts32 = out.counts.ptr<int32_t>();
  a.counts64 = out.counts_int64.ptr<int64_t>();
  a.seq_counts = out.seq_counts.ptr<int32_t>();
  a.aux_loss = out.aux_loss.ptr<float>();
  a.seq_loss = out.seq_aux_loss.ptr<float>();
  a.z_loss = out.z_loss.ptr<float>();
  a.error_word = error_word;
  a.count_acc = m.count_acc;
  a.count_arrivals = m.count_arrivals;
  a.cand_acc = m.cand_acc;
  a.aux_acc = m.aux_acc;
  a.tickets = m.tickets;
  a.z_partials = m.z_partials;
  a.seq_partials = m.seq_partials;
  a.slot_prob = m.slot_prob;
  a.slot_key = m.slot_key;
  a.kept = m.kept;
  a.cand_count = m.cand_count;
  a.cand_offset = m.cand_offset;
  a.cand_cursor = m.cand_cursor;
  a.list_key = m.list_key;
  a.list_slot = m.list_slot;
  kernels::launch_router_forward(a, stream);
}

void Router::backward(const TensorView& logits, const RouterOutputs& saved, const RouterGrads& grads,
                      const TensorView& d_logits, cudaStream_t stream) const {
  const Impl& m = *impl_;
  const RouterConfig& c = m.cfg;
  const int E = c.num_experts;
  const int64_t T = m.check_logits(logits, "logits");
  m.check_routing(saved, T, false);
  if (c.aux_loss_coeff != 0.0f) check_tensor(saved.selection_counts, "selection_counts", DType::kInt32, {E});
  check_tensor(d_logits, "d_logits", logits.dtype, {T, E});
  const bool topk = c.output_form == RoutingForm::kTopK;
  if (grads.d_probs.data || grads.d_probs.ndim)
    check_tensor(grads.d_probs, "d_probs", DType::kFP32, {T, topk ? c.topk : E});
  for (auto [t, name] : {std::pair{&grads.d_aux_loss, "d_aux_loss"}, std::pair{&grads.d_seq_aux_loss, "d_seq_aux_loss"},
                         std::pair{&grads.d_z_loss, "d_z_loss"}})
    if (t->data) check_scalar(*t, name);

  kernels::RouterBackwardArgs a;
  a.p = m.row_params(logits, nullptr);
  a.form = c.output_form;
  a.out_vec = vector_rows(d_logits.data, E);
  a.indices = saved.indices.ptr<int32_t>();
  a.map = saved.map.ptr<uint8_t>();
  a.selected = saved.selected.ptr<int32_t>();
  a.selection_counts = saved.selection_counts.ptr<int32_t>();
  a.seq_counts = saved.seq_counts.ptr<int32_t>();
  a.d_probs = grads.d_probs.ptr<float>();
  a.d_aux = grads.d_aux_loss.ptr<float>();
  a.d_seq = grads.d_seq_aux_loss.ptr<float>();
  a.d_z = grads.d_z_loss.ptr<float>();
  a.d_logits = d_logits.data;
  kernels::launch_router_backward(a, stream);
}

void update_expert_bias(const TensorView& counts, const TensorView& bias, float rate, cudaStream_t stream) {
  MOE_CHECK(counts.dtype == DType::kInt32 || counts.dtype == DType::kInt64,
            "argument 'counts': expected dtype int32 or int64, got ", dtype_name(counts.dtype));
  MOE_CHECK(counts.ndim == 1, "argument 'counts': expected shape [E], got ", counts.shape_string());
  const int64_t E = counts.shape[0];
  check_tensor(counts, "counts", counts.dtype, {E});
  check_tensor(bias, "bias", DType::kFP32, {E});
  MOE_CHECK(std::isfinite(rate), "argument 'rate': expected a finite value, got ", rate);
  kernels::launch_update_expert_bias(counts.data, counts.dtype == DType::kInt64, bias.ptr<float>(),
                                     static_cast<int>(E), rate, stream);
}

}  // namespace moe
