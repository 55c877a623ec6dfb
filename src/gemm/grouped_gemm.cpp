// GroupedGemm front end: argument checks on the host, the device prep kernel, then one CUTLASS
// grouped kernel chosen from the static shape. Every device buffer is allocated in the constructor.
#include "moe/grouped_gemm.h"

#include <algorithm>
#include <cstring>

#include "gemm/grouped_gemm_prep.h"
#include "gemm/grouped_kernel.h"
#include "kernels/cuda_check.h"

namespace moe {
namespace {

using gemm::Op;
using gemm::Out;

constexpr int kNumOps = 3;
constexpr int64_t kAlign = 8;  // bf16 elements in 16 bytes: TMA needs 16-byte aligned rows

Op to_op(GemmOp op) { return static_cast<Op>(op); }
Out to_out(DType t) { return t == DType::kFP32 ? Out::kFP32 : Out::kBF16; }

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// A kernel configuration and the persistent scheduler's tile order inside each group.
struct Choice {
  const char* name;
  bool raster_along_n;
};

// The tile configuration for a shape, from static quantities only (never from device data): the
// same choice in eager and captured runs, whatever the routing. Every rule is a measurement on the
// named shapes of BENCHMARKS.md (interleaved timing, docs/gemm.md):
//  - short reductions: the epilogue no longer hides behind a short main loop, and ping-pong (one
//    warp group's epilogue overlapping the other's main loop) beats the cooperative 128x256 tile;
//  - long reductions: cooperative 128x256; the 1x2 cluster (token tile multicast to two N tiles)
//    beats 2x1 when the output width fills whole cluster pairs of 256-wide tiles, otherwise half a
//    cluster idles and 2x1 is used;
//  - wgrad: the scheduler walks each expert's tiles along N when the output is taller than wide
//    (measured 1.0-1.05x on bf16 and up to 1.38x on the fp32 main_grad of mixtral fc1; along M
//    is better the other way round).
Choice heuristic_config(Op op, int64_t N, int64_t K) {
  switch (op) {
    case Op::kFprop: {  // Y [m, N], reduction K
      const bool short_k = K <= 1024 || (K <= 2048 && N <= 2048);
      if (short_k && N % 256 == 0) return {"pong_128x128x64_c1x2", true};
      return {N % 512 == 0 ? "coop_128x256x64_c1x2" : "coop_128x256x64_c2x1", false};
    }
    case Op::kDgrad:  // dX [m, K], reduction N
      if (N <= 768) return {"pong_128x128x64_c2x1", true};
      return {K % 512 == 0 ? "coop_128x256x64_c1x2" : "coop_128x256x64_c2x1", false};
    case Op::kWgrad:  // dW [N, K], reduction over the tokens of an expert
      return {"coop_128x256x64_c2x1", N > K};
  }
  return {"coop_128x256x64_c2x1", false};
}

void check_matrix(const TensorView& t, const char* name, DType dtype) {
  MOE_CHECK(t.ndim == 2, "argument '", name, "': expected a 2-D tensor, got shape ", t.shape_string());
  check_dtype(t, name, dtype);
  check_device(t, name, Device::kCUDA);
  check_contiguous(t, name);
  check_pointer(t, name, 16);
}

void check_dim(int64_t v, const char* name, const char* what) {
  MOE_CHECK(v > 0 && v % kAlign == 0 && v < (int64_t(1) << 31), "argument '", name, "': expected ", what,
            " to be a positive multiple of ", kAlign, " (16-byte aligned bf16 rows for TMA) below 2^31, got ", v);
}

}  // namespace

const char* gemm_op_name(GemmOp op) {
  switch (op) {
    case GemmOp::kFprop: return "fprop";
    case GemmOp::kDgrad: return "dgrad";
    case GemmOp::kWgrad: return "wgrad";
  }
  return "?";
}

struct GroupedGemm::Impl {
  int max_experts = 0;
  int64_t max_rows = 0;  // bound of every call's token-side rows
  int sm_count = 0;
  void* memory = nullptr;
  size_t bytes = 0;
  struct PerOp {
    gemm::ArgArrays arrays{};
    void* workspace = nullptr;
    std::string forced;
    bool raster_along_n = false;
  } ops[kNumOps];

  ~Impl() {
    if (memory) cudaFree(memory);
  }

  // The kernel for (op, out) and the scheduler order: the heuristic's, or the forced ones. A forced
  // name compiled only for the other output dtype (wgrad) leaves this one on the heuristic.
  const gemm::KernelEntry* kernel(Op op, Out out, int64_t N, int64_t K, bool* raster_along_n) const {
    const PerOp& s = ops[int(op)];
    Choice c = heuristic_config(op, N, K);
    if (!s.forced.empty() && gemm::find_kernel(op, out, s.forced.c_str())) c = {s.forced.c_str(), s.raster_along_n};
    const gemm::KernelEntry* k = gemm::find_kernel(op, out, c.name);
    MOE_CHECK(k != nullptr, "grouped GEMM: no ", gemm_op_name(GemmOp(op)), " kernel '", c.name, "' with ",
              out == Out::kFP32 ? "fp32" : "bf16", " output is compiled");
    *raster_along_n = c.raster_along_n;
    return k;
  }

  gemm::GroupedArgs args(Op op, int groups, bool raster_along_n) const {
    const PerOp& s = ops[int(op)];
    gemm::GroupedArgs a;
    a.groups = groups;
    a.problem_shapes = s.arrays.shapes;
    a.ptr_a = s.arrays.ptr_a, a.ld_a = s.arrays.ld_a;
    a.ptr_b = s.arrays.ptr_b, a.ld_b = s.arrays.ld_b;
    a.ptr_c = s.arrays.ptr_c, a.ld_c = s.arrays.ld_c;
    a.ptr_d = s.arrays.ptr_d, a.ld_d = s.arrays.ld_d;
    a.sm_count = sm_count;
    a.raster_along_n = raster_along_n;
    a.workspace = s.workspace;
    return a;
  }

  // Checks shared by the three ops: offsets [E + 1] int32 on the device, E within bounds.
  void check_groups(const TensorView& offsets, int experts) const {
    MOE_CHECK(experts >= 1 && experts <= max_experts, "argument 'experts': expected 1..", max_experts,
              " experts (the bound given at construction), got ", experts);
    check_dtype(offsets, "group_offsets", DType::kInt32);
    check_device(offsets, "group_offsets", Device::kCUDA);
    check_shape(offsets, "group_offsets", {int64_t(experts) + 1});
    check_contiguous(offsets, "group_offsets");
    check_pointer(offsets, "group_offsets", 4);
  }

  void check_rows(int64_t rows, const char* name) const {
    MOE_CHECK(rows <= max_rows, "argument '", name, "': expected at most ", max_rows,
              " rows (the bound given at construction), got ", rows);
  }
};

GroupedGemm::GroupedGemm(int max_experts, int64_t max_rows) : impl_(std::make_unique<Impl>()) {
  MOE_CHECK(max_experts >= 1 && max_experts <= 65535, "argument 'max_experts': expected 1..65535, got ", max_experts);
  MOE_CHECK(max_rows >= 0 && max_rows < (int64_t(1) << 31), "argument 'max_rows': expected 0..2^31-1, got ",
            max_rows);
  Impl& s = *impl_;
  s.max_experts = max_experts;
  s.max_rows = max_rows;
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&s.sm_count, cudaDevAttrMultiProcessorCount, device));

  // The largest workspace any compiled configuration needs (TMA descriptors per SM).
  size_t workspace = 0;
  int n = 0;
  const gemm::KernelEntry* const* all = gemm::kernel_registry(&n);
  for (int i = 0; i < n; ++i) workspace = std::max(workspace, all[i]->workspace_bytes(max_experts, s.sm_count));
  workspace = round_up(std::max<size_t>(workspace, 1), 256);

  // Layout per op: shapes, 4 pointer arrays, 4 leading-dimension arrays, workspace; 256-aligned.
  const size_t E = size_t(max_experts);
  const size_t shapes = round_up(E * 3 * sizeof(int32_t), 256), arr = round_up(E * 8, 256);
  const size_t per_op = shapes + 8 * arr + workspace;
  s.bytes = per_op * kNumOps;
  MOE_CUDA_CHECK(cudaMalloc(&s.memory, s.bytes));
  MOE_CUDA_CHECK(cudaMemset(s.memory, 0, s.bytes));
  for (int op = 0; op < kNumOps; ++op) {
    char* p = static_cast<char*>(s.memory) + op * per_op;
    auto take = [&p](size_t b) { char* q = p; p += b; return q; };
    gemm::ArgArrays& a = s.ops[op].arrays;
    a.shapes = reinterpret_cast<int32_t*>(take(shapes));
    a.ptr_a = reinterpret_cast<const void**>(take(arr));
    a.ptr_b = reinterpret_cast<const void**>(take(arr));
    a.ptr_c = reinterpret_cast<const void**>(take(arr));
    a.ptr_d = reinterpret_cast<void**>(take(arr));
    a.ld_a = reinterpret_cast<int64_t*>(take(arr));
    a.ld_b = reinterpret_cast<int64_t*>(take(arr));
    a.ld_c = reinterpret_cast<int64_t*>(take(arr));
    a.ld_d = reinterpret_cast<int64_t*>(take(arr));
    s.ops[op].workspace = take(workspace);
  }
}

GroupedGemm::~GroupedGemm() = default;

int GroupedGemm::max_experts() const { return impl_->max_experts; }
int64_t GroupedGemm::max_rows() const { return impl_->max_rows; }
size_t GroupedGemm::device_bytes() const { return impl_->bytes; }

std::string GroupedGemm::chosen_config(GemmOp op, int64_t N, int64_t K, DType out_dtype) const {
  bool along_n = false;
  const gemm::KernelEntry* k = impl_->kernel(to_op(op), to_out(out_dtype), N, K, &along_n);
  return std::string(k->name) + (along_n ? "/N" : "/M");
}

std::vector<std::string> GroupedGemm::configs(GemmOp op, DType out_dtype) {
  std::vector<std::string> names;
  int n = 0;
  const gemm::KernelEntry* const* all = gemm::kernel_registry(&n);
  for (int i = 0; i < n; ++i)
    if (all[i]->op == to_op(op) && all[i]->out == to_out(out_dtype)) names.push_back(all[i]->name);
  return names;
}

void GroupedGemm::force_config(GemmOp op, const std::string& name, bool raster_along_n) {
  if (!name.empty()) {
    bool known = false;
    for (DType out : {DType::kBF16, DType::kFP32})
      known = known || gemm::find_kernel(to_op(op), to_out(out), name.c_str()) != nullptr;
    MOE_CHECK(known, "argument 'name': no ", gemm_op_name(op), " configuration named '", name, "'");
  }
  impl_->ops[int(op)].forced = name;
  impl_->ops[int(op)].raster_along_n = raster_along_n;
}

void GroupedGemm::fprop(const TensorView& x, const ExpertMatrices& w, const TensorView& group_offsets,
                        const TensorView& y, cudaStream_t stream) {
  Impl& s = *impl_;
  check_matrix(x, "x", DType::kBF16);
  MOE_CHECK(w.experts() >= 1, "argument 'w': expected expert weights, got none");
  MOE_CHECK(w.dtype() == DType::kBF16, "argument 'w': expected dtype bf16, got ", dtype_name(w.dtype()));
  const int64_t rows = x.shape[0], K = x.shape[1], N = w.rows();
  check_dim(K, "x", "K (columns)");
  check_dim(N, "w", "N (rows)");
  MOE_CHECK(w.cols() == K, "argument 'w': expected [", N, ", ", K, "] expert matrices (K of x), got [", N, ", ",
            w.cols(), "]");
  check_matrix(y, "y", DType::kBF16);
  check_shape(y, "y", {rows, N});
  s.check_rows(rows, "x");
  s.check_groups(group_offsets, w.experts());

  bool along_n = false;
  const gemm::KernelEntry* k = s.kernel(Op::kFprop, Out::kBF16, N, K, &along_n);
  gemm::PrepParams p{};
  p.op = Op::kFprop;
  p.groups = w.experts();
  p.rows = rows, p.N = N, p.K = K;
  p.offsets = group_offsets.ptr<const int32_t>();
  p.a = static_cast<const char*>(x.data);
  p.d = static_cast<char*>(y.data);
  p.weights = {static_cast<const char*>(w.base()), w.expert_stride_bytes(), w.device_table()};
  gemm::launch_prep(p, s.ops[int(Op::kFprop)].arrays, stream);
  k->run(s.args(Op::kFprop, w.experts(), along_n), stream);
}

void GroupedGemm::dgrad(const TensorView& dy, const ExpertMatrices& w, const TensorView& group_offsets,
                        const TensorView& dx, cudaStream_t stream) {
  Impl& s = *impl_;
  check_matrix(dy, "dy", DType::kBF16);
  MOE_CHECK(w.experts() >= 1, "argument 'w': expected expert weights, got none");
  MOE_CHECK(w.dtype() == DType::kBF16, "argument 'w': expected dtype bf16, got ", dtype_name(w.dtype()));
  const int64_t rows = dy.shape[0], N = dy.shape[1], K = w.cols();
  check_dim(N, "dy", "N (columns)");
  check_dim(K, "w", "K (columns)");
  MOE_CHECK(w.rows() == N, "argument 'w': expected [", N, ", ", K, "] expert matrices (N of dy), got [", w.rows(),
            ", ", K, "]");
  check_matrix(dx, "dx", DType::kBF16);
  check_shape(dx, "dx", {rows, K});
  s.check_rows(rows, "dy");
  s.check_groups(group_offsets, w.experts());

  bool along_n = false;
  const gemm::KernelEntry* k = s.kernel(Op::kDgrad, Out::kBF16, N, K, &along_n);
  gemm::PrepParams p{};
  p.op = Op::kDgrad;
  p.groups = w.experts();
  p.rows = rows, p.N = N, p.K = K;
  p.offsets = group_offsets.ptr<const int32_t>();
  p.a = static_cast<const char*>(dy.data);
  p.d = static_cast<char*>(dx.data);
  p.weights = {static_cast<const char*>(w.base()), w.expert_stride_bytes(), w.device_table()};
  gemm::launch_prep(p, s.ops[int(Op::kDgrad)].arrays, stream);
  k->run(s.args(Op::kDgrad, w.experts(), along_n), stream);
}

void GroupedGemm::wgrad(const TensorView& dy, const TensorView& x, const TensorView& group_offsets,
                        const ExpertMatrices& dw, bool accumulate, cudaStream_t stream) {
  Impl& s = *impl_;
  check_matrix(dy, "dy", DType::kBF16);
  check_matrix(x, "x", DType::kBF16);
  const int64_t rows = dy.shape[0], N = dy.shape[1], K = x.shape[1];
  check_dim(N, "dy", "N (columns)");
  check_dim(K, "x", "K (columns)");
  MOE_CHECK(x.shape[0] == rows, "argument 'x': expected ", rows, " rows (as dy), got shape ", x.shape_string());
  MOE_CHECK(dw.experts() >= 1, "argument 'dw': expected expert gradients, got none");
  MOE_CHECK(dw.rows() == N && dw.cols() == K, "argument 'dw': expected [", N, ", ", K, "] expert matrices, got [",
            dw.rows(), ", ", dw.cols(), "]");
  if (accumulate)
    MOE_CHECK(dw.dtype() == DType::kFP32, "argument 'dw': accumulation needs an fp32 main_grad, got dtype ",
              dtype_name(dw.dtype()));
  else
    MOE_CHECK(dw.dtype() == DType::kFP32 || dw.dtype() == DType::kBF16,
              "argument 'dw': expected dtype bf16 or fp32, got ", dtype_name(dw.dtype()));
  s.check_rows(rows, "dy");
  s.check_groups(group_offsets, dw.experts());

  const Out out = to_out(dw.dtype());
  bool along_n = false;
  const gemm::KernelEntry* k = s.kernel(Op::kWgrad, out, N, K, &along_n);
  const gemm::ExpertPtrs dw_ptrs{static_cast<const char*>(dw.base()), dw.expert_stride_bytes(), dw.device_table()};
  gemm::PrepParams p{};
  p.op = Op::kWgrad;
  p.groups = dw.experts();
  p.rows = rows, p.N = N, p.K = K;
  p.offsets = group_offsets.ptr<const int32_t>();
  p.a = static_cast<const char*>(dy.data);
  p.b_tokens = static_cast<const char*>(x.data);
  p.weights = dw_ptrs;
  gemm::launch_prep(p, s.ops[int(Op::kWgrad)].arrays, stream);
  // Empty experts: the GEMM has no tiles for them; write mode needs their zero gradient.
  if (!accumulate)
    gemm::launch_zero_empty_experts(p.offsets, p.groups, rows, dw_ptrs, N * K * (out == Out::kFP32 ? 4 : 2), stream);
  gemm::GroupedArgs a = s.args(Op::kWgrad, dw.experts(), along_n);
  a.beta = accumulate ? 1.0f : 0.0f;
  k->run(a, stream);
}

}  // namespace moe
