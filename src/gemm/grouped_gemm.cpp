// GroupedGemm front end: argument checks on the host, the device prep kernel into the caller's
// per-call workspace, then one CUTLASS grouped kernel chosen from the problem's capabilities and
// static shape. The engine itself owns no device memory.
#include "moe/grouped_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "device/cuda_check.h"
#include "fused/rows_gemm.h"
#include "gemm/forced_configs.h"
#include "gemm/grouped_gemm_prep.h"
#include "gemm/grouped_kernel.h"
#include "gemm/tile_heuristic.h"

namespace moe {
namespace {

using gemm::Op;

constexpr int kNumOps = 3;
constexpr int64_t kAlign = 8;  // bf16 elements in 16 bytes: TMA needs 16-byte aligned rows

Op to_op(GemmOp op) { return static_cast<Op>(op); }

size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

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

// The per-call workspace: argument arrays (shapes, 4 pointer arrays, 4 leading-dimension arrays,
// 2 FP8 scale pointer arrays), CUTLASS's workspace, then (with max_weight_dim) the weight scales
// restated per 64 rows for the 192-wide FP8 configurations, each piece 256-byte aligned.
struct CallLayout {
  size_t shapes = 0, arr = 0, cutlass = 0, restated = 0;
  size_t total() const { return shapes + 10 * arr + cutlass + restated; }
};

constexpr int64_t kFp8Block = 128;  // FP8 block scaling: elements per scale block
int64_t blocks_of(int64_t n) { return (n + kFp8Block - 1) / kFp8Block; }
// Leading dimension of MN-major token scales ([blocks, rows rounded up to 4], quantize's kMNMajor).
int64_t mn_major_ld(int64_t rows) { return (rows + 3) / 4 * 4; }
// Rows of the weight scales restated per 64 rows of B (KernelEntry::weight_scale_rows == 64) for
// `b_rows` rows of B: whole 192-wide tiles.
int64_t restated_rows(int64_t b_rows) { return 3 * ((b_rows + 191) / 192); }

// An fp32 scale_inv tensor of exactly `shape`, on the device, contiguous.
void check_scale(const TensorView& t, const char* name, std::initializer_list<int64_t> shape) {
  MOE_CHECK(t.ndim > 0, "argument '", name, "': FP8 operands need their fp32 scale_inv tensor, got none");
  check_device_tensor(t, name, DType::kFP32, shape, 4);
}

// The weights' FP8 scales: per expert [ceil(N/128), ceil(K/128)] fp32, oriented as the weights.
void check_weight_scale(const ExpertMatrices& s, const ExpertMatrices& w) {
  MOE_CHECK(s.experts() == w.experts(), "argument 'w_scale': FP8 weights need one scale_inv matrix per expert (",
            w.experts(), "), got ", s.experts());
  MOE_CHECK(s.dtype() == DType::kFP32, "argument 'w_scale': expected dtype fp32, got ", dtype_name(s.dtype()));
  MOE_CHECK(s.transposed() == w.transposed(), "argument 'w_scale': expected the orientation of w (",
            w.transposed() ? "transposed" : "rowwise", ")");
  MOE_CHECK(s.rows() == blocks_of(w.rows()) && s.cols() == blocks_of(w.cols()), "argument 'w_scale': expected [",
            blocks_of(w.rows()), ", ", blocks_of(w.cols()), "] scale matrices (128 x 128 blocks of [", w.rows(), ", ",
            w.cols(), "]), got [", s.rows(), ", ", s.cols(), "]");
}

// FP8 dimensions: 16-byte rows of one-byte elements.
void check_fp8_dim(int64_t v, const char* name, const char* what) {
  MOE_CHECK(v % 16 == 0, "argument '", name, "': FP8 operands need ", what,
            " to be a multiple of 16 (16-byte TMA rows), got ", v);
}

// FP8 fprop / dgrad over `red` (K / N) into `out` columns (N / K): the weights' copy contiguous
// along the reduction (fprop: the rowwise copy; dgrad: the columnwise one viewed as_transposed()),
// dimensions of 16, the token and weight scales.
void check_fp8_token_product(const GemmProblem& pr, int64_t rows, int64_t red, int64_t out) {
  const bool dgrad = pr.op == GemmOp::kDgrad;
  MOE_CHECK(pr.w.transposed() == dgrad, "argument 'w': FP8 ",
            dgrad ? "dgrad reads the weights' columnwise copy W^T [K, N] (viewed as_transposed()), got the rowwise "
                    "orientation"
                  : "fprop reads the weights' rowwise copy W [N, K], got a transposed view");
  check_fp8_dim(red, dgrad ? "dy" : "x", dgrad ? "N (columns)" : "K (columns)");
  check_fp8_dim(out, "w", dgrad ? "K (columns)" : "N (rows)");
  if (pr.a_scale_layout == ScaleLayout::kMNMajor)
    check_scale(pr.a_scale, "a_scale", {blocks_of(red), mn_major_ld(rows)});
  else
    check_scale(pr.a_scale, "a_scale", {rows, blocks_of(red)});
  check_weight_scale(pr.w_scale, pr.w);
}

// Whether a configuration of that name is compiled for `op` (any operand and output dtype), and
// whether all of them take runs of tiles.
bool compiled(Op op, const std::string& name, bool* takes_runs) {
  bool known = false;
  for (DType ab : {DType::kBF16, DType::kFP8E4M3})
    for (DType out : {DType::kBF16, DType::kFP32})
      if (const gemm::KernelEntry* k = gemm::find_kernel(op, ab, out, false, name.c_str())) {
        known = true;
        *takes_runs = *takes_runs && k->tile_runs;
      }
  return known;
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
  int64_t max_weight_dim = 0;  // bound of every call's N and K (0: no restated weight scales)
  int sm_count = 0;
  size_t cutlass_workspace = 0;  // the largest any compiled configuration needs for max_experts
  struct Forced {
    std::string name;
    bool raster_along_n = false;
    int tile_run = 1;
  } forced[kNumOps];

  CallLayout layout(int experts) const {
    const size_t E = size_t(experts);
    const size_t restated = max_weight_dim > 0 ? E * restated_rows(max_weight_dim) * blocks_of(max_weight_dim) * 4 : 0;
    return {round_up(E * 3 * sizeof(int32_t), 256), round_up(E * 8, 256), cutlass_workspace, round_up(restated, 256)};
  }

  gemm::ArgArrays carve(void* base, int experts, void** cutlass_ws, float** restated = nullptr) const {
    const CallLayout l = layout(experts);
    char* p = static_cast<char*>(base);
    auto take = [&p](size_t b) { char* q = p; p += b; return q; };
    gemm::ArgArrays a;
    a.shapes = reinterpret_cast<int32_t*>(take(l.shapes));
    a.ptr_a = reinterpret_cast<const void**>(take(l.arr));
    a.ptr_b = reinterpret_cast<const void**>(take(l.arr));
    a.ptr_c = reinterpret_cast<const void**>(take(l.arr));
    a.ptr_d = reinterpret_cast<void**>(take(l.arr));
    a.ld_a = reinterpret_cast<int64_t*>(take(l.arr));
    a.ld_b = reinterpret_cast<int64_t*>(take(l.arr));
    a.ld_c = reinterpret_cast<int64_t*>(take(l.arr));
    a.ld_d = reinterpret_cast<int64_t*>(take(l.arr));
    a.ptr_sfa = reinterpret_cast<const float**>(take(l.arr));
    a.ptr_sfb = reinterpret_cast<const float**>(take(l.arr));
    *cutlass_ws = take(l.cutlass);
    float* r = reinterpret_cast<float*>(take(l.restated));
    if (restated != nullptr) *restated = l.restated > 0 ? r : nullptr;
    return a;
  }

  // The kernel for the problem's capabilities and shape: the heuristic's configuration, or the forced
  // one when a kernel of that name has the needed capabilities. `fallback`: a call the rows GEMM
  // cannot take -- the heuristic's CUTLASS configuration, nothing forced.
  const gemm::KernelEntry* kernel(Op op, DType ab, DType out, bool accumulate, int64_t N, int64_t K,
                                  gemm::TileChoice* choice, bool fallback = false) const {
    const Forced& f = forced[int(op)];
    gemm::TileChoice c = ab == DType::kFP8E4M3
                             ? gemm::choose_fp8_tiles(op, N, K, max_weight_dim >= std::max(N, K), accumulate)
                             : gemm::choose_tiles(op, N, K, accumulate, /*rows_ok=*/!fallback);
    if (!fallback && !f.name.empty() && gemm::find_kernel(op, ab, out, accumulate, f.name.c_str()))
      c = {f.name.c_str(), f.raster_along_n, f.tile_run};
    const gemm::KernelEntry* k = gemm::find_kernel(op, ab, out, accumulate, c.name);
    MOE_CHECK(k != nullptr, "grouped GEMM: no ", gemm_op_name(GemmOp(op)), " kernel '", c.name, "' for ",
              dtype_name(ab), " operands with ", dtype_name(out), " output",
              accumulate ? " (accumulating)" : "", " is compiled");
    *choice = c;
    return k;
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

  void check_workspace(const TensorView& ws, int experts) const {
    const size_t need = layout(experts).total();
    MOE_CHECK(ws.data != nullptr && ws.device == Device::kCUDA, "argument 'workspace': expected device memory of ",
              need, " bytes, got ", ws.data == nullptr ? "none" : "host memory");
    MOE_CHECK(static_cast<size_t>(ws.nbytes()) >= need, "argument 'workspace': expected at least ", need,
              " bytes (workspace_bytes(", experts, ")), got ", ws.nbytes());
    check_pointer(ws, "workspace", 256);
  }
};

GroupedGemm::GroupedGemm(int max_experts, int64_t max_rows, int max_sms, int64_t max_weight_dim)
    : impl_(std::make_unique<Impl>()) {
  MOE_CHECK(max_experts >= 1 && max_experts <= 65535, "argument 'max_experts': expected 1..65535, got ", max_experts);
  MOE_CHECK(max_rows >= 0 && max_rows < (int64_t(1) << 31), "argument 'max_rows': expected 0..2^31-1, got ",
            max_rows);
  MOE_CHECK(max_weight_dim >= 0 && max_weight_dim < (int64_t(1) << 31),
            "argument 'max_weight_dim': expected 0..2^31-1, got ", max_weight_dim);
  Impl& s = *impl_;
  s.max_experts = max_experts;
  s.max_rows = max_rows;
  s.max_weight_dim = max_weight_dim;
  int device = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CHECK(max_sms >= 0, "argument 'max_sms': expected 0 (every SM) or a positive count, got ", max_sms);
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&s.sm_count, cudaDevAttrMultiProcessorCount, device));
  // Rounded down to whole clusters of 2 CTAs (the largest cluster of the compiled kernels: CUTLASS
  // cannot launch a persistent grid of 3 CTAs in clusters of 2).
  if (max_sms > 0) s.sm_count = std::max(2, std::min(s.sm_count, max_sms) / 2 * 2);
  // The largest workspace any compiled configuration needs (TMA descriptors per SM).
  size_t workspace = 0;
  int n = 0;
  const gemm::KernelEntry* const* all = gemm::kernel_registry(&n);
  for (int i = 0; i < n; ++i) workspace = std::max(workspace, all[i]->workspace_bytes(max_experts, s.sm_count));
  s.cutlass_workspace = round_up(std::max<size_t>(workspace, 1), 256);
  // Configurations forced from the environment (gemm/forced_configs.h), for experiments.
  if (const char* env = std::getenv(gemm::kGemmConfigsEnv))
    for (const gemm::ForcedConfig& f : gemm::parse_forced_configs(env, gemm::kGemmConfigsEnv)) {
      bool runs = true;
      MOE_CHECK(compiled(f.op, f.name, &runs), gemm::kGemmConfigsEnv, ": no ", gemm_op_name(static_cast<GemmOp>(f.op)),
                " configuration named '", f.name, "'");
      force_config(static_cast<GemmOp>(f.op), f.name, f.raster_along_n, f.tile_run);
    }
}

GroupedGemm::~GroupedGemm() = default;

int GroupedGemm::sm_count() const { return impl_->sm_count; }

int GroupedGemm::max_experts() const { return impl_->max_experts; }
int64_t GroupedGemm::max_rows() const { return impl_->max_rows; }

size_t GroupedGemm::workspace_bytes(int experts) const {
  const int E = experts == 0 ? impl_->max_experts : experts;
  MOE_CHECK(E >= 1 && E <= impl_->max_experts, "argument 'experts': expected 1..", impl_->max_experts, ", got ",
            experts);
  // CUTLASS's part is sized for max_experts: its workspace grows with the group count.
  return impl_->layout(E).total();
}

std::string GroupedGemm::chosen_config(GemmOp op, int64_t N, int64_t K, DType out_dtype, bool accumulate) const {
  gemm::TileChoice c{};
  const gemm::KernelEntry* k = impl_->kernel(to_op(op), DType::kBF16, out_dtype, accumulate, N, K, &c);
  return std::string(k->name) + (c.raster_along_n ? "/N" : "/M") +
         (c.tile_run > 1 ? "/run" + std::to_string(c.tile_run) : std::string());
}

std::vector<std::string> GroupedGemm::configs(GemmOp op, DType out_dtype, DType operands) {
  std::vector<std::string> names;
  int n = 0;
  const gemm::KernelEntry* const* all = gemm::kernel_registry(&n);
  for (int i = 0; i < n; ++i)
    if (all[i]->caps.op == to_op(op) && all[i]->caps.ab == operands && all[i]->caps.out == out_dtype)
      names.push_back(all[i]->name);
  return names;
}

void GroupedGemm::force_config(GemmOp op, const std::string& name, bool raster_along_n, int tile_run) {
  MOE_CHECK(tile_run >= 1 && tile_run <= 1024, "argument 'tile_run': expected 1..1024, got ", tile_run);
  MOE_CHECK(!name.empty() || tile_run == 1,
            "argument 'tile_run': a run length goes with a configuration name (\"\" returns to the heuristic)");
  if (!name.empty()) {
    bool runs = true;
    MOE_CHECK(compiled(to_op(op), name, &runs), "argument 'name': no ", gemm_op_name(op), " configuration named '",
              name, "'");
    MOE_CHECK(runs || tile_run == 1, "argument 'tile_run': configuration '", name,
              "' takes no runs of tiles (tile_run 1)");
  }
  impl_->forced[int(op)] = {name, raster_along_n, tile_run};
}

void GroupedGemm::run(const GemmProblem& pr, const TensorView& workspace, cudaStream_t stream) const {
  const Impl& s = *impl_;
  const ExpertMatrices& w = pr.w;
  const bool accumulate = pr.epilogue == GemmEpilogue::kAccumulate;
  const char* wname = pr.op == GemmOp::kWgrad ? "dw" : "w";
  MOE_CHECK(w.experts() >= 1, "argument '", wname, "': expected expert matrices, got none");
  MOE_CHECK(w.alignment() >= 16, "argument '", wname, "': GEMM operands need 16-byte aligned matrices (TMA), got ",
            "expert matrices made with alignment ", w.alignment());
  const bool fp8 = pr.a.dtype == DType::kFP8E4M3;
  check_matrix(pr.a, pr.op == GemmOp::kFprop ? "x" : "dy", fp8 ? DType::kFP8E4M3 : DType::kBF16);
  MOE_CHECK(pr.a_scale_layout == ScaleLayout::kRowMajor || pr.a_scale_layout == ScaleLayout::kMNMajor,
            "argument 'a_scale_layout': expected row_major or mn_major (FP8 block token scales), got enum value ",
            static_cast<int>(pr.a_scale_layout));
  const bool a_scale_mn_major = fp8 && pr.op != GemmOp::kWgrad && pr.a_scale_layout == ScaleLayout::kMNMajor;
  const DType ab = pr.a.dtype;
  // Windows of a's rows (GemmProblem::a_row_begin): a may hold more rows than d; `rows` are d's.
  const bool windows = pr.a_row_begin.data != nullptr;
  if (windows) {
    MOE_CHECK(!fp8 && pr.op != GemmOp::kWgrad, "argument 'a_row_begin': windows of rows are offered for bf16 fprop ",
              "and dgrad only");
    check_dtype(pr.a_row_begin, "a_row_begin", DType::kInt32);
    check_device(pr.a_row_begin, "a_row_begin", Device::kCUDA);
    check_shape(pr.a_row_begin, "a_row_begin", {int64_t(w.experts())});
    check_contiguous(pr.a_row_begin, "a_row_begin");
    check_pointer(pr.a_row_begin, "a_row_begin", 4);
    MOE_CHECK(pr.d.ndim == 2, "argument '", pr.op == GemmOp::kFprop ? "y" : "dx", "': expected a matrix, got shape ",
              pr.d.shape_string());
    s.check_rows(pr.a.shape[0], pr.op == GemmOp::kFprop ? "x" : "dy");
  }
  // FP8 wgrad reads dY's columnwise copy [N, rows]: the tokens run along its columns.
  const int64_t rows = windows ? pr.d.shape[0] : fp8 && pr.op == GemmOp::kWgrad ? pr.a.shape[1] : pr.a.shape[0];
  int64_t N = 0, K = 0;
  DType out = DType::kBF16;  // fprop and dgrad write bf16 (from bf16 or FP8 operands); wgrad: dw's dtype
  gemm::PrepParams p{};
  p.op = to_op(pr.op);
  p.groups = w.experts();
  p.rows = rows;
  p.a = static_cast<const char*>(pr.a.data);
  p.weights = {static_cast<const char*>(w.base()), w.expert_stride_bytes(), w.device_table()};
  switch (pr.op) {
    case GemmOp::kFprop:
      K = pr.a.shape[1], N = w.rows();
      check_dim(K, "x", "K (columns)");
      check_dim(N, "w", "N (rows)");
      MOE_CHECK(w.dtype() == ab, "argument 'w': expected dtype ", dtype_name(ab), " (as x), got ", dtype_name(w.dtype()));
      MOE_CHECK(w.cols() == K, "argument 'w': expected [", N, ", ", K, "] expert matrices (K of x), got [", N, ", ",
                w.cols(), "]");
      if (fp8) check_fp8_token_product(pr, rows, K, N);
      check_matrix(pr.d, "y", DType::kBF16);
      check_shape(pr.d, "y", {rows, N});
      p.d = static_cast<char*>(pr.d.data);
      break;
    case GemmOp::kDgrad:
      N = pr.a.shape[1], K = w.cols();
      check_dim(N, "dy", "N (columns)");
      check_dim(K, "w", "K (columns)");
      MOE_CHECK(w.dtype() == ab, "argument 'w': expected dtype ", dtype_name(ab), " (as dy), got ",
                dtype_name(w.dtype()));
      MOE_CHECK(w.rows() == N, "argument 'w': expected [", N, ", ", K, "] expert matrices (N of dy), got [", w.rows(),
                ", ", K, "]");
      if (fp8) check_fp8_token_product(pr, rows, N, K);
      check_matrix(pr.d, "dx", DType::kBF16);
      check_shape(pr.d, "dx", {rows, K});
      p.d = static_cast<char*>(pr.d.data);
      break;
    case GemmOp::kWgrad:
      check_matrix(pr.b, "x", ab);
      if (fp8) {  // the columnwise copies dY^T [N, rows] and X^T [K, rows]
        N = pr.a.shape[0], K = pr.b.shape[0];
        check_dim(N, "dy", "N (rows of the columnwise copy)");
        check_dim(K, "x", "K (rows of the columnwise copy)");
        MOE_CHECK(pr.b.shape[1] == rows, "argument 'x': expected ", rows, " tokens (columns, as dy), got shape ",
                  pr.b.shape_string());
        check_fp8_dim(rows, "dy", "the tokens (columns of the columnwise copy)");
        check_scale(pr.a_scale, "a_scale", {blocks_of(rows), N});
        check_scale(pr.b_scale, "b_scale", {blocks_of(rows), K});
      } else {
        N = pr.a.shape[1], K = pr.b.shape[1];
        check_dim(N, "dy", "N (columns)");
        check_dim(K, "x", "K (columns)");
        MOE_CHECK(pr.b.shape[0] == rows, "argument 'x': expected ", rows, " rows (as dy), got shape ",
                  pr.b.shape_string());
      }
      MOE_CHECK(w.rows() == N && w.cols() == K, "argument 'dw': expected [", N, ", ", K, "] expert matrices, got [",
                w.rows(), ", ", w.cols(), "]");
      out = w.dtype();
      if (accumulate)
        MOE_CHECK(out == DType::kFP32, "argument 'dw': accumulation needs an fp32 main_grad, got dtype ",
                  dtype_name(out));
      else
        MOE_CHECK(out == DType::kFP32 || out == DType::kBF16, "argument 'dw': expected dtype bf16 or fp32, got ",
                  dtype_name(out));
      p.b_tokens = static_cast<const char*>(pr.b.data);
      break;
  }
  MOE_CHECK(pr.op == GemmOp::kWgrad || !accumulate, "argument 'epilogue': accumulation is only offered for wgrad");
  p.N = N, p.K = K;
  s.check_rows(rows, pr.op == GemmOp::kFprop ? "x" : "dy");
  s.check_groups(pr.group_offsets, w.experts());
  s.check_workspace(workspace, w.experts());
  p.offsets = pr.group_offsets.ptr<const int32_t>();
  p.error_word = pr.error_word;
  if (windows) {
    p.a_row_begin = pr.a_row_begin.ptr<const int32_t>();
    p.a_rows = pr.a.shape[0];
  }
  if (fp8) {
    p.fp8 = true;
    p.a_scale_mn_major = a_scale_mn_major;
    p.a_scale = static_cast<const float*>(pr.a_scale.data);
    p.b_scale = static_cast<const float*>(pr.b_scale.data);
    p.w_scale = {static_cast<const char*>(pr.w_scale.base()), pr.w_scale.expert_stride_bytes(),
                 pr.w_scale.device_table()};
  }

  // Transposed expert matrices (stored W_e^T, [K, N] row-major) are the other major order of the
  // same B operand: fprop becomes the dgrad-shaped product (B N-major), dgrad the fprop-shaped one
  // (B K-major) with the roles of N and K exchanged, and wgrad computes dW_e^T = X_e^T dY_e, its
  // token-side operands exchanged. So the compiled kernels serve both orientations.
  if (w.transposed()) {
    if (pr.op == GemmOp::kFprop) p.op = Op::kDgrad;
    else if (pr.op == GemmOp::kDgrad) p.op = Op::kFprop;
    else std::swap(p.a, p.b_tokens), std::swap(p.a_scale, p.b_scale);
    std::swap(p.N, p.K);
  }

  gemm::TileChoice choice{};
  const gemm::KernelEntry* k = s.kernel(p.op, ab, out, accumulate, p.N, p.K, &choice);
  if (k->contiguous_rows) {
    // The rows GEMM reads the token rows in place and the weights as one contiguous tensor (TMA);
    // a call it cannot take runs the heuristic's kernel -- so does a call without rows, whose
    // offsets only the prep kernel checks (the rows GEMM launches nothing then).
    const bool red_is_k = p.op == Op::kFprop;
    const bool takes = rows > 0 && w.is_grouped() &&
                       fused::rows_gemm_unsupported(w.experts(), rows, red_is_k ? p.K : p.N, red_is_k ? p.N : p.K)
                           .empty();
    if (!takes) {
      k = s.kernel(p.op, ab, out, accumulate, p.N, p.K, &choice, /*fallback=*/true);
      MOE_CHECK(!k->contiguous_rows, "grouped GEMM: the heuristic chose '", k->name, "' for a call it cannot take");
    } else {
      gemm::GroupedArgs a;
      a.groups = w.experts();
      a.sm_count = s.sm_count;
      a.contiguous = {p.a, w.base(), p.d, p.offsets, rows, p.N, p.K, p.error_word, p.a_row_begin, p.a_rows};
      k->run(a, stream);
      return;
    }
  }
  void* cutlass_ws = nullptr;
  float* restated = nullptr;
  const gemm::ArgArrays arrays = s.carve(workspace.data, w.experts(), &cutlass_ws, &restated);
  if (fp8 && k->weight_scale_rows == 64) {
    // The configuration reads the weight scales per 64 rows of B (the output rows N of the fprop
    // form): restate each expert's [ceil(N / 128), ceil(K / 128)] scales into the workspace.
    MOE_CHECK(s.max_weight_dim >= std::max(p.N, p.K), "grouped GEMM: configuration '", k->name,
              "' reads the weight scales restated in the workspace; construct GroupedGemm with max_weight_dim >= ",
              std::max(p.N, p.K), " (got ", s.max_weight_dim, ")");
    const int64_t rows = restated_rows(p.N), cols = blocks_of(p.K);
    gemm::launch_restate_weight_scales(p.w_scale, w.experts(), blocks_of(p.N), cols, restated, rows, stream);
    p.w_scale = {reinterpret_cast<const char*>(restated), rows * cols * int64_t(sizeof(float)), nullptr};
  }
  gemm::launch_prep(p, arrays, stream);
  // wgrad's empty experts: the GEMM has no tiles for them; write mode needs their zero gradient.
  if (pr.op == GemmOp::kWgrad && !accumulate)
    gemm::launch_zero_empty_experts(p.offsets, p.groups, rows, p.weights, N * K * dtype_bytes(out, 1), p.fp8, stream);

  gemm::GroupedArgs a;
  a.groups = w.experts();
  a.problem_shapes = arrays.shapes;
  a.ptr_a = arrays.ptr_a, a.ld_a = arrays.ld_a;
  a.ptr_b = arrays.ptr_b, a.ld_b = arrays.ld_b;
  a.ptr_c = arrays.ptr_c, a.ld_c = arrays.ld_c;
  a.ptr_d = arrays.ptr_d, a.ld_d = arrays.ld_d;
  a.ptr_sfa = arrays.ptr_sfa, a.ptr_sfb = arrays.ptr_sfb;
  a.a_scale_mn_ld = a_scale_mn_major ? mn_major_ld(rows) : 0;
  a.sm_count = s.sm_count;
  a.raster_along_n = choice.raster_along_n;
  a.tile_run = choice.tile_run;
  a.workspace = cutlass_ws;
  a.beta = accumulate ? 1.0f : 0.0f;
  k->run(a, stream);
}

void GroupedGemm::fprop(const TensorView& x, const ExpertMatrices& w, const TensorView& group_offsets,
                        const TensorView& y, const TensorView& workspace, cudaStream_t stream) const {
  GemmProblem p;
  p.op = GemmOp::kFprop;
  p.a = x, p.w = w, p.d = y, p.group_offsets = group_offsets;
  run(p, workspace, stream);
}

void GroupedGemm::dgrad(const TensorView& dy, const ExpertMatrices& w, const TensorView& group_offsets,
                        const TensorView& dx, const TensorView& workspace, cudaStream_t stream) const {
  GemmProblem p;
  p.op = GemmOp::kDgrad;
  p.a = dy, p.w = w, p.d = dx, p.group_offsets = group_offsets;
  run(p, workspace, stream);
}

void GroupedGemm::wgrad(const TensorView& dy, const TensorView& x, const TensorView& group_offsets,
                        const ExpertMatrices& dw, bool accumulate, const TensorView& workspace,
                        cudaStream_t stream) const {
  GemmProblem p;
  p.op = GemmOp::kWgrad;
  p.a = dy, p.b = x, p.w = dw, p.group_offsets = group_offsets;
  p.epilogue = accumulate ? GemmEpilogue::kAccumulate : GemmEpilogue::kStore;
  run(p, workspace, stream);
}

}  // namespace moe
