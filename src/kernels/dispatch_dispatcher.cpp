// moe::Dispatcher: argument checks, the plan layout in caller-owned state, and the kernel launches.
#include <algorithm>
#include <limits>
#include <string>
#include <tuple>

#include "device/cuda_check.h"
#include "device/device_arena.h"
#include "kernels/dispatch_kernels.h"
#include "kernels/routing_args.h"
#include "moe/dispatch.h"
#include "moe/error.h"
#include "device/state_check.h"

namespace moe {

namespace {

constexpr int kMaxExperts = 1024;  // per-warp tables of E entries live in shared memory
constexpr int64_t kInt32Max = std::numeric_limits<int32_t>::max();

bool is_arith_dtype(DType t) { return t == DType::kBF16 || t == DType::kFP16 || t == DType::kFP32; }
// Rows permute moves as bytes: FP8 and packed FP4 (two values per byte) data as well as arithmetic types.
bool is_row_dtype(DType t) {
  return is_arith_dtype(t) || t == DType::kFP8E4M3 || t == DType::kFP8E5M2 || t == DType::kFP4E2M1;
}

}  // namespace

// Device memory of one plan, carved from the plan state's block.
struct PlanLayout {
  int32_t* chunk_count = nullptr;
  int32_t *count32 = nullptr, *padded32 = nullptr, *offset32 = nullptr, *group_offsets = nullptr;
  int64_t *count64 = nullptr, *padded64 = nullptr, *offset64 = nullptr;
  int32_t *slot_row = nullptr, *row_slot = nullptr;
  float* probs_perm = nullptr;
};

struct Dispatcher::Impl {
  DispatcherConfig cfg;
  uint64_t serial = next_op_serial();
  int slots = 0;
  int64_t R = 0;
  size_t plan_bytes = 0;

  PlanLayout carve(char* base, size_t* bytes = nullptr) const {
    const int E = cfg.num_experts;
    DeviceArena c(base);
    PlanLayout p;
    p.chunk_count = c.take<int32_t>(kernels::plan_num_chunks(cfg.form, cfg.max_tokens, slots, E) * E);
    p.count32 = c.take<int32_t>(E);
    p.padded32 = c.take<int32_t>(E);
    p.offset32 = c.take<int32_t>(E);
    p.group_offsets = c.take<int32_t>(E + 1);
    p.count64 = c.take<int64_t>(E);
    p.padded64 = c.take<int64_t>(E);
    p.offset64 = c.take<int64_t>(E);
    p.slot_row = c.take<int32_t>(cfg.max_tokens * slots);
    p.row_slot = c.take<int32_t>(R);
    p.probs_perm = c.take<float>(R);
    if (bytes) *bytes = c.used();
    return p;
  }

  // The layout of a filled plan of this dispatcher, and its T.
  PlanLayout filled(const SavedState& plan, const char* call, int64_t* T) const {
    check_state_capacity(plan, "plan", plan_bytes, kPlanHeaders);
    check_state(plan, "plan", serial, StateKind::kDispatchPlan, {StateStatus::kFilled}, call);
    *T = plan.header(0).tokens;
    return carve(static_cast<char*>(plan.device()));
  }

  void check_rows(const TensorView& t, const char* name, int64_t rows) const {
    check_device_tensor(t, name, cfg.row_dtype, {rows, cfg.hidden});
  }
  void require_arith(const char* op) const {
    MOE_CHECK(is_arith_dtype(cfg.row_dtype), "Dispatcher::", op, ": row dtype ", dtype_name(cfg.row_dtype),
              " moves through permute only; expected bf16, fp16 or fp32");
  }

  // Token chunks' windows: row_begin [chunks][E], offsets [chunks][E + 1], local rows [T_max, slots].
  int64_t windows_size(int chunks) const {
    MOE_CHECK(chunks >= 1, "argument 'chunks': expected >= 1, got ", chunks);
    return chunks * (2 * int64_t{cfg.num_experts} + 1) + cfg.max_tokens * slots;
  }
  // What a sum of one token chunk's rows (unpermute_chunk, permute_backward_chunk) checks and reads:
  // the plan, the windows, the piece's packed rows `rows` and the [T, H] output `out`.
  struct PieceSum {
    PlanLayout plan;
    int64_t T = 0;
    int64_t t0 = 0, n = 0;          // the piece's tokens [t0, t0 + n)
    const int32_t* local = nullptr;  // their slots' rows in the piece's packed rows
  };
  PieceSum piece_sum(const SavedState& plan, const TensorView& windows, int chunks, int chunk, const TensorView& rows,
                     const char* rows_name, const TensorView& out, const char* out_name, const char* op) const;
};

Dispatcher::Dispatcher(const DispatcherConfig& config) : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.cfg = config;
  const DispatcherConfig& c = config;
  MOE_CHECK(c.max_tokens >= 0, "argument 'max_tokens': expected >= 0, got ", c.max_tokens);
  MOE_CHECK(c.num_experts >= 1 && c.num_experts <= kMaxExperts, "argument 'num_experts': expected 1..", kMaxExperts,
            ", got ", c.num_experts);
  if (c.form == RoutingForm::kTopK)
    MOE_CHECK(c.topk >= 1 && c.topk <= kMaxExperts, "argument 'topk': expected 1..", kMaxExperts, ", got ", c.topk);
  MOE_CHECK(is_row_dtype(c.row_dtype), "argument 'row_dtype': expected bf16, fp16, fp32, fp8_e4m3, fp8_e5m2 or ",
            "fp4_e2m1, got ", dtype_name(c.row_dtype));
  MOE_CHECK(c.hidden > 0 && c.hidden <= kInt32Max && dtype_bytes(c.row_dtype, c.hidden) % 16 == 0,
            "argument 'hidden': expected a row of ",
            "a multiple of 16 bytes (H a multiple of ", 128 / dtype_bits(c.row_dtype), " for ",
            dtype_name(c.row_dtype), "), got H = ", c.hidden);
  MOE_CHECK(c.scale_bytes_per_row >= 0, "argument 'scale_bytes_per_row': expected >= 0, got ",
            c.scale_bytes_per_row);
  m.slots = ::moe::slots_per_token(c.form, c.topk, c.num_experts);
  // Row and slot indices are int32 on the device; offsets may run past R by up to E*(A-1). Checked by
  // division: T_max * slots must not wrap into a small plan.
  const int64_t slack = kernels::plan_chunk_slots(c.form, c.num_experts) + int64_t{c.num_experts} * 256;
  const int64_t max_tokens_bound = (kInt32Max - slack) / m.slots;
  MOE_CHECK(c.max_tokens <= max_tokens_bound, "argument 'max_tokens': expected at most ", max_tokens_bound,
            " (T_max x ", m.slots, " slots must fit the int32 row indices), got ", c.max_tokens);
  m.R = resolve_row_bound(c.options, c.form, c.max_tokens, c.topk, c.num_experts);
  MOE_CHECK(m.R >= 0 && m.R <= kInt32Max, "argument 'row_bound': expected R < 2^31, got ", m.R);
  m.carve(nullptr, &m.plan_bytes);
}

Dispatcher::~Dispatcher() = default;

const DispatcherConfig& Dispatcher::config() const { return impl_->cfg; }
int64_t Dispatcher::rows() const { return impl_->R; }
int Dispatcher::slots_per_token() const { return impl_->slots; }
size_t Dispatcher::plan_bytes() const { return impl_->plan_bytes; }

SavedState Dispatcher::new_plan(DeviceAllocator& allocator) const {
  return SavedState::allocate(impl_->plan_bytes, kPlanHeaders, allocator);
}

void Dispatcher::plan(const RoutingView& routing, uint32_t* error_word, const SavedState& plan,
                      cudaStream_t stream) const {
  const Impl& m = *impl_;
  const DispatcherConfig& c = m.cfg;
  const int64_t T = kernels::check_routing_args(routing, error_word, c.form, m.slots, c.max_tokens);
  check_state_capacity(plan, "plan", m.plan_bytes, kPlanHeaders);
  const PlanLayout p = m.carve(static_cast<char*>(plan.device()));
  kernels::PlanArgs a;
  a.form = c.form;
  a.T = static_cast<int32_t>(T);
  a.E = c.num_experts;
  a.slots = m.slots;
  a.indices = c.form == RoutingForm::kTopK ? routing.indices.ptr<int32_t>() : nullptr;
  a.map = c.form == RoutingForm::kMap ? routing.map.ptr<uint8_t>() : nullptr;
  a.probs = routing.probs.ptr<float>();
  a.R = static_cast<int32_t>(m.R);
  a.align = c.options.align;
  a.pre_padded = c.options.pre_padded;
  a.chunk_count = p.chunk_count;
  a.count32 = p.count32;
  a.padded32 = p.padded32;
  a.offset32 = p.offset32;
  a.count64 = p.count64;
  a.padded64 = p.padded64;
  a.offset64 = p.offset64;
  a.group_offsets = p.group_offsets;
  a.slot_row = p.slot_row;
  a.row_slot = p.row_slot;
  a.probs_perm = p.probs_perm;
  a.error_word = error_word;
  kernels::launch_plan(a, stream);
  mark_filled(plan, m.serial, StateKind::kDispatchPlan, T);
}

void Dispatcher::permute(const SavedState& plan, const TensorView& x, const TensorView& x_perm, cudaStream_t stream,
                         const TensorView* x_scale, const TensorView* x_perm_scale) const {
  const Impl& m = *impl_;
  int64_t T = 0;
  const PlanLayout p = m.filled(plan, "Dispatcher::permute", &T);
  m.check_rows(x, "x", T);
  m.check_rows(x_perm, "x_perm", m.R);
  const int64_t S = m.cfg.scale_bytes_per_row;
  MOE_CHECK((x_scale != nullptr) == (S > 0) && (x_perm_scale != nullptr) == (S > 0),
            "argument 'x_scale': expected x_scale and x_perm_scale exactly when scale_bytes_per_row > 0 (it is ", S,
            ")");
  const void* xs = nullptr;
  void* xps = nullptr;
  if (S > 0) {
    for (auto [t, name, rows] : {std::tuple{x_scale, "x_scale", T}, std::tuple{x_perm_scale, "x_perm_scale", m.R}}) {
      check_device(*t, name, Device::kCUDA);
      check_contiguous(*t, name);
      check_pointer(*t, name, 16);
      MOE_CHECK(t->ndim >= 1 && t->shape[0] == rows && t->nbytes() == rows * S, "argument '", name,
                "': expected [", rows, ", *] holding ", S, " bytes per row, got ", t->shape_string(), " of ",
                dtype_name(t->dtype));
    }
    xs = x_scale->data;
    xps = x_perm_scale->data;
  }
  kernels::launch_permute_rows(x.data, x_perm.data, dtype_bytes(m.cfg.row_dtype, m.cfg.hidden), xs, xps, S,
                               p.row_slot, m.slots, static_cast<int32_t>(m.R), stream);
}

void Dispatcher::permute_backward(const SavedState& plan, const TensorView& d_x_perm, const TensorView& dx,
                                  cudaStream_t stream, const TensorView* d_probs_perm,
                                  const TensorView* dprobs) const {
  const Impl& m = *impl_;
  int64_t T = 0;
  const PlanLayout p = m.filled(plan, "Dispatcher::permute_backward", &T);
  m.require_arith("permute_backward");
  m.check_rows(d_x_perm, "d_x_perm", m.R);
  m.check_rows(dx, "dx", T);
  if (d_probs_perm) check_device_tensor(*d_probs_perm, "d_probs_perm", DType::kFP32, {m.R}, 4);
  if (dprobs) check_device_tensor(*dprobs, "dprobs", DType::kFP32, {T, m.slots}, 4);
  kernels::launch_combine(m.cfg.row_dtype, d_x_perm.data, dx.data, m.cfg.hidden, p.slot_row, m.slots,
                          static_cast<int32_t>(T), nullptr, nullptr,
                          d_probs_perm ? d_probs_perm->ptr<float>() : nullptr,
                          dprobs ? dprobs->ptr<float>() : nullptr, stream);
}

void Dispatcher::unpermute(const SavedState& plan, const TensorView& Y, const TensorView& y, MergeProbs merge,
                           cudaStream_t stream, const TensorView* probs) const {
  const Impl& m = *impl_;
  int64_t T = 0;
  const PlanLayout p = m.filled(plan, "Dispatcher::unpermute", &T);
  m.require_arith("unpermute");
  m.check_rows(Y, "Y", m.R);
  m.check_rows(y, "y", T);
  const float *by_row, *by_slot;
  kernels::merge_weights(merge, probs, p.probs_perm, T, m.slots, "Dispatcher::unpermute", &by_row, &by_slot);
  kernels::launch_combine(m.cfg.row_dtype, Y.data, y.data, m.cfg.hidden, p.slot_row, m.slots,
                          static_cast<int32_t>(T), by_row, by_slot, nullptr, nullptr, stream);
}

void Dispatcher::unpermute_backward(const SavedState& plan, const TensorView& dy, const TensorView& dY,
                                    MergeProbs merge, cudaStream_t stream, const TensorView* probs,
                                    const TensorView* Y, const TensorView* dprobs) const {
  const Impl& m = *impl_;
  int64_t T = 0;
  const PlanLayout p = m.filled(plan, "Dispatcher::unpermute_backward", &T);
  m.require_arith("unpermute_backward");
  m.check_rows(dy, "dy", T);
  m.check_rows(dY, "dY", m.R);
  const bool merging = merge != MergeProbs::kNone;
  const bool want_dot = merging && dprobs != nullptr;
  MOE_CHECK(!want_dot || Y != nullptr, "argument 'Y': the combine's input is needed for dprobs when merging probs");
  if (want_dot) m.check_rows(*Y, "Y", m.R);
  const float *by_row, *by_slot;
  kernels::merge_weights(merge, probs, p.probs_perm, T, m.slots, "Dispatcher::unpermute_backward", &by_row,
                         &by_slot);
  if (dprobs) {
    check_device_tensor(*dprobs, "dprobs", DType::kFP32, {T, m.slots}, 4);
    // Slots without a row (and every slot without merged probs) have a zero gradient.
    if (T > 0) MOE_CUDA_CHECK(cudaMemsetAsync(dprobs->data, 0, sizeof(float) * T * m.slots, stream));
  }
  kernels::launch_scale_rows_backward(m.cfg.row_dtype, dy.data, want_dot ? Y->data : nullptr, dY.data, m.cfg.hidden,
                                      p.row_slot, m.slots, static_cast<int32_t>(m.R), by_row, by_slot, merging,
                                      want_dot ? dprobs->ptr<float>() : nullptr, stream);
}

int64_t Dispatcher::chunk_tokens(int64_t T, int chunks) {
  MOE_CHECK(chunks >= 1, "argument 'chunks': expected >= 1, got ", chunks);
  return std::max<int64_t>(1, (T + chunks - 1) / chunks);
}

int64_t Dispatcher::chunk_windows_size(int chunks) const { return impl_->windows_size(chunks); }

namespace {
int32_t* window_part(const TensorView& windows, int chunks, int64_t E, int part) {
  int32_t* w = windows.ptr<int32_t>();
  return part == 0 ? w : part == 1 ? w + chunks * E : w + chunks * (2 * E + 1);
}
}  // namespace

void Dispatcher::chunk_windows(const SavedState& plan, int chunks, const TensorView& windows,
                               cudaStream_t stream) const {
  const Impl& m = *impl_;
  int64_t T = 0;
  const PlanLayout p = m.filled(plan, "Dispatcher::chunk_windows", &T);
  check_device_tensor(windows, "windows", DType::kInt32, {chunk_windows_size(chunks)}, 4);
  const int64_t E = m.cfg.num_experts;
  kernels::WindowArgs a;
  a.chunks = chunks;
  a.E = m.cfg.num_experts;
  a.slots = m.slots;
  a.T = static_cast<int32_t>(T);
  a.Tc = static_cast<int32_t>(chunk_tokens(T, chunks));
  a.R = static_cast<int32_t>(m.R);
  a.offset32 = p.offset32;
  a.count32 = p.count32;
  a.row_slot = p.row_slot;
  a.slot_row = p.slot_row;
  a.row_begin = window_part(windows, chunks, E, 0);
  a.offsets = window_part(windows, chunks, E, 1);
  a.local_row = window_part(windows, chunks, E, 2);
  kernels::launch_chunk_windows(a, stream);
}

TensorView Dispatcher::chunk_row_begin(const TensorView& windows, int chunks, int chunk) const {
  check_device_tensor(windows, "windows", DType::kInt32, {chunk_windows_size(chunks)}, 4);
  MOE_CHECK(chunk >= 0 && chunk < chunks, "argument 'chunk': expected 0..", chunks - 1, ", got ", chunk);
  const int64_t E = impl_->cfg.num_experts;
  return TensorView(window_part(windows, chunks, E, 0) + chunk * E, DType::kInt32, {E}, Device::kCUDA);
}

TensorView Dispatcher::chunk_offsets(const TensorView& windows, int chunks, int chunk) const {
  check_device_tensor(windows, "windows", DType::kInt32, {chunk_windows_size(chunks)}, 4);
  MOE_CHECK(chunk >= 0 && chunk < chunks, "argument 'chunk': expected 0..", chunks - 1, ", got ", chunk);
  const int64_t E = impl_->cfg.num_experts;
  return TensorView(window_part(windows, chunks, E, 1) + chunk * (E + 1), DType::kInt32, {E + 1}, Device::kCUDA);
}

TensorView Dispatcher::chunk_slot_rows(const TensorView& windows, int chunks, int64_t T) const {
  check_device_tensor(windows, "windows", DType::kInt32, {chunk_windows_size(chunks)}, 4);
  MOE_CHECK(T >= 0 && T <= impl_->cfg.max_tokens, "argument 'T': expected 0..", impl_->cfg.max_tokens, ", got ", T);
  return TensorView(window_part(windows, chunks, impl_->cfg.num_experts, 2), DType::kInt32, {T, impl_->slots},
                    Device::kCUDA);
}

Dispatcher::Impl::PieceSum Dispatcher::Impl::piece_sum(const SavedState& plan, const TensorView& windows, int chunks,
                                                       int chunk, const TensorView& rows, const char* rows_name,
                                                       const TensorView& out, const char* out_name,
                                                       const char* op) const {
  PieceSum r;
  r.plan = filled(plan, (std::string("Dispatcher::") + op).c_str(), &r.T);
  require_arith(op);
  check_device_tensor(windows, "windows", DType::kInt32, {windows_size(chunks)}, 4);
  MOE_CHECK(chunk >= 0 && chunk < chunks, "argument 'chunk': expected 0..", chunks - 1, ", got ", chunk);
  MOE_CHECK(rows.ndim == 2, "argument '", rows_name, "': expected [rows, ", cfg.hidden, "], got ",
            rows.shape_string());
  check_rows(rows, rows_name, rows.shape[0]);
  // A piece's packed rows: at most its Tc tokens' slots (and R); the rows the combine may read.
  const int64_t Tc = Dispatcher::chunk_tokens(r.T, chunks), need = std::min(R, Tc * slots);
  MOE_CHECK(rows.shape[0] >= need, "argument '", rows_name, "': a piece of ", Tc, " tokens may have ", need,
            " packed rows, got ", rows.shape[0]);
  check_rows(out, out_name, r.T);
  r.t0 = std::min(r.T, chunk * Tc);
  r.n = std::min(r.T, r.t0 + Tc) - r.t0;
  r.local = window_part(windows, chunks, cfg.num_experts, 2) + r.t0 * slots;
  return r;
}

void Dispatcher::unpermute_chunk(const SavedState& plan, const TensorView& windows, int chunks, int chunk,
                                 const TensorView& Y_chunk, const TensorView& y, cudaStream_t stream) const {
  const Impl& m = *impl_;
  const Impl::PieceSum p = m.piece_sum(plan, windows, chunks, chunk, Y_chunk, "Y_chunk", y, "y", "unpermute_chunk");
  void* y0 = static_cast<char*>(y.data) + dtype_bytes(m.cfg.row_dtype, p.t0 * m.cfg.hidden);
  kernels::launch_combine(m.cfg.row_dtype, Y_chunk.data, y0, m.cfg.hidden, p.local, m.slots, static_cast<int32_t>(p.n),
                          nullptr, nullptr, nullptr, nullptr, stream);
}

void Dispatcher::permute_backward_chunk(const SavedState& plan, const TensorView& windows, int chunks, int chunk,
                                        const TensorView& d_x_perm_chunk, const TensorView& dx, cudaStream_t stream,
                                        const TensorView* d_probs_perm, const TensorView* dprobs) const {
  const Impl& m = *impl_;
  const Impl::PieceSum p = m.piece_sum(plan, windows, chunks, chunk, d_x_perm_chunk, "d_x_perm_chunk", dx, "dx",
                                       "permute_backward_chunk");
  if (d_probs_perm) check_device_tensor(*d_probs_perm, "d_probs_perm", DType::kFP32, {m.R}, 4);
  if (dprobs) check_device_tensor(*dprobs, "dprobs", DType::kFP32, {p.T, m.slots}, 4);
  void* dx0 = static_cast<char*>(dx.data) + dtype_bytes(m.cfg.row_dtype, p.t0 * m.cfg.hidden);
  kernels::launch_combine(m.cfg.row_dtype, d_x_perm_chunk.data, dx0, m.cfg.hidden, p.local, m.slots,
                          static_cast<int32_t>(p.n), nullptr, nullptr,
                          d_probs_perm ? d_probs_perm->ptr<float>() : nullptr,
                          dprobs ? dprobs->ptr<float>() + p.t0 * m.slots : nullptr, stream,
                          p.plan.slot_row + p.t0 * m.slots);
}

namespace {
TensorView int_view(void* p32, void* p64, DType dtype, int64_t n, const char* what) {
  MOE_CHECK(dtype == DType::kInt32 || dtype == DType::kInt64, "argument 'dtype' of ", what,
            ": expected int32 or int64, got ", dtype_name(dtype));
  return TensorView(dtype == DType::kInt32 ? p32 : p64, dtype, {n}, Device::kCUDA);
}
}  // namespace

int64_t Dispatcher::tokens(const SavedState& plan) const {
  int64_t T = 0;
  impl_->filled(plan, "Dispatcher::tokens", &T);
  return T;
}
TensorView Dispatcher::counts(const SavedState& plan, DType dtype) const {
  int64_t T = 0;
  const PlanLayout p = impl_->filled(plan, "Dispatcher::counts", &T);
  return int_view(p.count32, p.count64, dtype, impl_->cfg.num_experts, "counts");
}
TensorView Dispatcher::padded_counts(const SavedState& plan, DType dtype) const {
  int64_t T = 0;
  const PlanLayout p = impl_->filled(plan, "Dispatcher::padded_counts", &T);
  return int_view(p.padded32, p.padded64, dtype, impl_->cfg.num_experts, "padded_counts");
}
TensorView Dispatcher::offsets(const SavedState& plan, DType dtype) const {
  int64_t T = 0;
  const PlanLayout p = impl_->filled(plan, "Dispatcher::offsets", &T);
  return int_view(p.offset32, p.offset64, dtype, impl_->cfg.num_experts, "offsets");
}
TensorView Dispatcher::group_offsets(const SavedState& plan) const {
  int64_t T = 0;
  const PlanLayout p = impl_->filled(plan, "Dispatcher::group_offsets", &T);
  return TensorView(p.group_offsets, DType::kInt32, {impl_->cfg.num_experts + 1}, Device::kCUDA);
}
TensorView Dispatcher::probs_perm(const SavedState& plan) const {
  int64_t T = 0;
  const PlanLayout p = impl_->filled(plan, "Dispatcher::probs_perm", &T);
  return TensorView(p.probs_perm, DType::kFP32, {impl_->R}, Device::kCUDA);
}
TensorView Dispatcher::slot_rows(const SavedState& plan) const {
  int64_t T = 0;
  const PlanLayout p = impl_->filled(plan, "Dispatcher::slot_rows", &T);
  return TensorView(p.slot_row, DType::kInt32, {T, impl_->slots}, Device::kCUDA);
}
TensorView Dispatcher::row_slots(const SavedState& plan) const {
  int64_t T = 0;
  const PlanLayout p = impl_->filled(plan, "Dispatcher::row_slots", &T);
  return TensorView(p.row_slot, DType::kInt32, {impl_->R}, Device::kCUDA);
}

}  // namespace moe
