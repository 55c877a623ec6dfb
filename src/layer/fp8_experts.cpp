// Fp8ExpertsRecipe: quantize + FP8 grouped GEMM steps of the FP8 experts (see fp8_experts.h).
#include "layer/fp8_experts.h"

#include <algorithm>

#include "layer/expert_weight_quantize.h"
#include "moe/activation_ops.h"
#include "moe/error.h"
#include "moe/quantize.h"

namespace moe {
namespace {

constexpr int64_t kBlock = 128;
int64_t blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }

// Weights: 128x128 blocks, both copies, row-major scales; with pow2, every scale a power of two
// (Fp8Recipe::kBlockPow2; the layouts do not depend on it). Tokens: 1x128 blocks, both copies'
// scales kMNMajor: the rowwise copy's [ceil(cols / 128), round_up(rows, 4)] (fprop / dgrad; each
// tile's scales of a block contiguous, copied by the GEMM's TMA engine), the columnwise copy's
// [ceil(rows / 128), cols] (the weight gradient; cols is a multiple of 16, so no padding).
QuantConfig fp8_config(QuantBlocking blocking, bool rowwise, bool columnwise, bool pow2 = false) {
  QuantConfig c;
  c.format = QuantFormat::kFP8Block;
  c.pow2_scale = pow2;
  c.blocking = blocking;
  c.rowwise = rowwise;
  c.columnwise = columnwise;
  c.scale_layout = blocking == QuantBlocking::k1D ? ScaleLayout::kMNMajor : ScaleLayout::kRowMajor;
  return c;
}

// The token workspace's rowwise scales of a [rows, cols] operand, in the layout fp8_config writes.
ScaleShape row_scale_shape(int64_t rows, int64_t cols) {
  return scale_shape(fp8_config(QuantBlocking::k1D, true, false), rows, cols);
}
TensorView row_scales(float* scales, int64_t rows, int64_t cols) {
  const ScaleShape s = row_scale_shape(rows, cols);
  return TensorView(scales, DType::kFP32, {s.rows, s.cols});
}

}  // namespace

Fp8ExpertsRecipe::Fp8ExpertsRecipe(const ExpertsConfig& config) : cfg_(config), R_(config.max_rows) {
  w_[0].N = cfg_.fc1_out(), w_[0].K = cfg_.hidden;  // fc1.weight [fc1_out, H]
  w_[1].N = cfg_.hidden, w_[1].K = cfg_.ffn;        // fc2.weight [H, F]
  tok_cols_ = std::max({cfg_.hidden, cfg_.ffn, cfg_.fc1_out()});
}

void Fp8ExpertsRecipe::plan_weight(DeviceArena& a, Weight& w) {
  const int64_t E = cfg_.experts, nb = blocks(w.N), kb = blocks(w.K);
  w.row = a.take<uint8_t>(E * w.N * w.K);
  w.col = a.take<uint8_t>(E * w.N * w.K);
  w.row_scale = a.take<float>(E * nb * kb);
  w.col_scale = a.take<float>(E * nb * kb);
  if (w.row == nullptr) return;  // measuring pass
  w.row_m = ExpertMatrices::grouped(TensorView(w.row, DType::kFP8E4M3, {E, w.N, w.K}), "fc weight (fp8)");
  w.row_scale_m = ExpertMatrices::grouped(TensorView(w.row_scale, DType::kFP32, {E, nb, kb}), "fc weight scale", 4);
  // The columnwise copy W^T [K, N] is read by dgrad as transposed expert matrices.
  w.col_m =
      ExpertMatrices::grouped(TensorView(w.col, DType::kFP8E4M3, {E, w.K, w.N}), "fc weight (fp8)").as_transposed();
  w.col_scale_m =
      ExpertMatrices::grouped(TensorView(w.col_scale, DType::kFP32, {E, kb, nb}), "fc weight scale", 4).as_transposed();
}

void Fp8ExpertsRecipe::plan_workspace(DeviceArena& a) {
  plan_weight(a, w_[0]);
  plan_weight(a, w_[1]);
  row_ = a.take<uint8_t>(R_ * tok_cols_);
  const ScaleShape rs = row_scale_shape(R_, tok_cols_);
  row_scale_ = a.take<float>(rs.rows * rs.cols);
  if (!cfg_.delay_wgrad) {  // delayed: the columnwise copies of dY and dh live in each state
    col_ = a.take<uint8_t>(R_ * tok_cols_);
    col_scale_ = a.take<float>(blocks(R_) * tok_cols_);
  }
  if (fused_activation_grad() && cfg_.probs == ProbsPlacement::kInActivation) {
    grad_partials_count_ = activation_backward_quantized_workspace(cfg_.activation, R_, cfg_.ffn);
    grad_partials_ = a.take<float>(grad_partials_count_);
  }
}

Fp8ExpertsRecipe::SavedCopies Fp8ExpertsRecipe::plan_state(DeviceArena& a) const {
  SavedCopies c;
  c.x_col = a.take<uint8_t>(R_ * cfg_.hidden);
  c.x_col_scale = a.take<float>(blocks(R_) * cfg_.hidden);
  c.act_col = a.take<uint8_t>(R_ * cfg_.ffn);
  c.act_col_scale = a.take<float>(blocks(R_) * cfg_.ffn);
  if (cfg_.delay_wgrad) {
    c.dy_col = a.take<uint8_t>(R_ * cfg_.hidden);
    c.dy_col_scale = a.take<float>(blocks(R_) * cfg_.hidden);
    c.dh_col = a.take<uint8_t>(R_ * cfg_.fc1_out());
    c.dh_col_scale = a.take<float>(blocks(R_) * cfg_.fc1_out());
  }
  return c;
}

void Fp8ExpertsRecipe::bind_weights(const std::vector<TensorView>& fc1, const std::vector<TensorView>& fc2) {
  w_[0].source = fc1;
  w_[1].source = fc2;
}

QuantConfig Fp8ExpertsRecipe::weight_config() const { return fp8_config(QuantBlocking::k2D, true, true, pow2()); }
QuantConfig Fp8ExpertsRecipe::token_config(bool rowwise, bool columnwise) const {
  return fp8_config(QuantBlocking::k1D, rowwise, columnwise, pow2());
}

QuantizedTensor Fp8ExpertsRecipe::weight_copies(int fc) const {
  const Weight& w = w_[fc - 1];
  const int64_t E = cfg_.experts, nb = blocks(w.N), kb = blocks(w.K);
  QuantizedTensor q;
  q.rowwise_data = TensorView(w.row, DType::kFP8E4M3, {E, w.N, w.K});
  q.rowwise_scale = TensorView(w.row_scale, DType::kFP32, {E, nb, kb});
  q.columnwise_data = TensorView(w.col, DType::kFP8E4M3, {E, w.K, w.N});
  q.columnwise_scale = TensorView(w.col_scale, DType::kFP32, {E, kb, nb});
  return q;
}

// The bound weights (bf16, or fp32 master weights: moe::quantize takes either).
void Fp8ExpertsRecipe::quantize_weight(int fc, cudaStream_t s) const {
  quantize_expert_weight(weight_config(), w_[fc - 1].source, weight_copies(fc), s);
}

void Fp8ExpertsRecipe::quantize_weights(cudaStream_t s) const {
  quantize_weight(1, s);
  quantize_weight(2, s);
}

// The views of a token operand's copies: rowwise in the token workspace, columnwise in (col, col_scale).
QuantizedTensor Fp8ExpertsRecipe::token_copies(int64_t rows, int64_t cols, bool rowwise, uint8_t* col,
                                               float* col_scale) const {
  QuantizedTensor q;
  if (rowwise) {
    q.rowwise_data = TensorView(row_, DType::kFP8E4M3, {rows, cols});
    q.rowwise_scale = row_scales(row_scale_, rows, cols);
  }
  if (col != nullptr) {
    q.columnwise_data = TensorView(col, DType::kFP8E4M3, {cols, rows});
    q.columnwise_scale = TensorView(col_scale, DType::kFP32, {blocks(rows), cols});
  }
  return q;
}

void Fp8ExpertsRecipe::quantize(const TensorView& a, bool rowwise, uint8_t* col, float* col_scale,
                                cudaStream_t s) const {
  // Both copies come from one read of `a` (each with its own scale layout).
  const QuantizedTensor q = token_copies(a.shape[0], a.shape[1], rowwise, col, col_scale);
  if (rowwise || col != nullptr) moe::quantize(token_config(rowwise, col != nullptr), a, q, s);
}

void Fp8ExpertsRecipe::quantize_gathered(const TensorView& x, const TensorView& row_slots, int slots, bool rowwise,
                                         uint8_t* col, float* col_scale, uint32_t* error_word, cudaStream_t s) const {
  const QuantizedTensor q = token_copies(row_slots.shape[0], x.shape[1], rowwise, col, col_scale);
  if (rowwise || col != nullptr)
    moe::quantize_gathered(token_config(rowwise, col != nullptr), x, row_slots, slots, q, error_word,
                           s);
}

void Fp8ExpertsRecipe::quantize_activation(const ActivationParams& params, const TensorView& h,
                                           const TensorView& probs, const TensorView& group_offsets, bool rowwise,
                                           uint8_t* col, float* col_scale, cudaStream_t s) const {
  const QuantizedTensor q = token_copies(h.shape[0], cfg_.ffn, rowwise, col, col_scale);
  if (rowwise || col != nullptr)
    activation_forward_quantized(params, h, probs, group_offsets,
                                 token_config(rowwise, col != nullptr), q, s);
}

bool Fp8ExpertsRecipe::fused_activation_grad() const {
  return !cfg_.bias && activation_backward_quantized_evaluates_once(cfg_.activation, cfg_.ffn);
}

void Fp8ExpertsRecipe::quantize_activation_grad(const ActivationParams& params, const TensorView& h,
                                                const TensorView& probs, const TensorView& d_out,
                                                const TensorView& group_offsets, const TensorView& dprobs,
                                                uint8_t* col, float* col_scale, cudaStream_t s) const {
  MOE_CHECK(fused_activation_grad(), "Fp8ExpertsRecipe::quantize_activation_grad: not offered for this ",
            "configuration (see fused_activation_grad)");
  MOE_CHECK(col != nullptr && col_scale != nullptr, "Fp8ExpertsRecipe::quantize_activation_grad: needs the ",
            "columnwise copy's memory (internal error)");
  const QuantizedTensor q = token_copies(h.shape[0], cfg_.fc1_out(), /*rowwise=*/true, col, col_scale);
  activation_backward_quantized(params, h, probs, d_out, group_offsets,
                                token_config(/*rowwise=*/true, /*columnwise=*/true), q, dprobs,
                                TensorView(grad_partials_, DType::kFP32, {grad_partials_count_}), s);
}

// fprop reads the rowwise weight copy and reduces over K; dgrad the columnwise copy (W^T, viewed
// transposed) and reduces over N. A is the token workspace's rowwise copy [rows, reduction], its
// scales MN-major.
void Fp8ExpertsRecipe::token_product(GemmOp op, const Weight& w, const GroupedGemm& gemm, const TensorView& ws,
                                     const TensorView& g, const TensorView& out, cudaStream_t s) const {
  const bool fprop = op == GemmOp::kFprop;
  const int64_t rows = out.shape[0], red = fprop ? w.K : w.N;
  GemmProblem p;
  p.op = op;
  p.a = TensorView(row_, DType::kFP8E4M3, {rows, red});
  p.a_scale = row_scales(row_scale_, rows, red);
  p.a_scale_layout = ScaleLayout::kMNMajor;
  p.w = fprop ? w.row_m : w.col_m;
  p.w_scale = fprop ? w.row_scale_m : w.col_scale_m;
  p.d = out;
  p.group_offsets = g;
  gemm.run(p, ws, s);
}

void Fp8ExpertsRecipe::fprop(int fc, const GroupedGemm& gemm, const TensorView& ws, const TensorView& g,
                             const TensorView& y, cudaStream_t s) const {
  token_product(GemmOp::kFprop, w_[fc - 1], gemm, ws, g, y, s);
}

void Fp8ExpertsRecipe::dgrad(int fc, const GroupedGemm& gemm, const TensorView& ws, const TensorView& g,
                             const TensorView& dx, cudaStream_t s) const {
  token_product(GemmOp::kDgrad, w_[fc - 1], gemm, ws, g, dx, s);
}

void Fp8ExpertsRecipe::wgrad(const GroupedGemm& gemm, const TensorView& ws, const TensorView& g, int64_t rows,
                             const uint8_t* dy_col, const float* dy_col_scale, int64_t N, const uint8_t* x_col,
                             const float* x_col_scale, int64_t K, const ExpertMatrices& dw, bool accumulate,
                             uint32_t* error_word, cudaStream_t s) const {
  GemmProblem p;
  p.op = GemmOp::kWgrad;
  p.a = TensorView(const_cast<uint8_t*>(dy_col), DType::kFP8E4M3, {N, rows});
  p.a_scale = TensorView(const_cast<float*>(dy_col_scale), DType::kFP32, {blocks(rows), N});
  p.b = TensorView(const_cast<uint8_t*>(x_col), DType::kFP8E4M3, {K, rows});
  p.b_scale = TensorView(const_cast<float*>(x_col_scale), DType::kFP32, {blocks(rows), K});
  p.w = dw;
  p.group_offsets = g;
  p.epilogue = accumulate ? GemmEpilogue::kAccumulate : GemmEpilogue::kStore;
  p.error_word = error_word;
  gemm.run(p, ws, s);
}

}  // namespace moe
