// EmulatedExpertsRecipe: quantize-dequantize steps of the emulated MXFP8 / NVFP4 experts (see
// emulated_experts.h).
#include "layer/emulated_experts.h"

#include <algorithm>

#include "layer/expert_weight_quantize.h"
#include "moe/error.h"
#include "quant/fake_quantize.h"

namespace moe {
namespace {

QuantFormat format_of(EmulatedQuant q) { return q == EmulatedQuant::kMXFP8 ? QuantFormat::kMXFP8 : QuantFormat::kNVFP4; }

TensorView bf16(void* p, int64_t rows, int64_t cols) { return TensorView(p, DType::kBF16, {rows, cols}); }
TensorView bf16(void* p, int64_t E, int64_t rows, int64_t cols) { return TensorView(p, DType::kBF16, {E, rows, cols}); }

}  // namespace

EmulatedExpertsRecipe::EmulatedExpertsRecipe(const ExpertsConfig& config) : cfg_(config), R_(config.max_rows) {
  tokens_.format = weights_.format = format_of(cfg_.emulated);
  tokens_.blocking = QuantBlocking::k1D;
  // Weights: MXFP8 1x32 / 32x1; NVFP4 16x16 (both copies share the blocks, as TransformerEngine's
  // NVFP4 recipe quantizes weights).
  weights_.blocking = cfg_.emulated == EmulatedQuant::kNVFP4 ? QuantBlocking::k2D : QuantBlocking::k1D;
  weights_.rowwise = weights_.columnwise = true;
  w_[0].N = cfg_.fc1_out(), w_[0].K = cfg_.hidden;  // fc1.weight [fc1_out, H]
  w_[1].N = cfg_.hidden, w_[1].K = cfg_.ffn;        // fc2.weight [H, F]
  tok_cols_ = std::max({cfg_.hidden, cfg_.ffn, cfg_.fc1_out()});
}

int64_t EmulatedExpertsRecipe::data_bytes(int64_t elements) const {
  return weights_.format == QuantFormat::kNVFP4 ? elements / 2 : elements;
}

void EmulatedExpertsRecipe::plan_weight(DeviceArena& a, Weight& w) {
  const int64_t E = cfg_.experts;
  const ScaleShape rs = scale_shape(weights_, w.N, w.K), cs = scale_shape(weights_, w.K, w.N, true);
  w.row = a.take<uint8_t>(E * data_bytes(w.N * w.K));
  w.col = a.take<uint8_t>(E * data_bytes(w.N * w.K));
  w.row_scale = a.take<uint8_t>(E * rs.rows * rs.cols);
  w.col_scale = a.take<uint8_t>(E * cs.rows * cs.cols);
  w.amax = a.take<float>(E);
  w.row_deq = a.take<uint16_t>(E * w.N * w.K);
  if (!two_d()) w.col_deq = a.take<uint16_t>(E * w.N * w.K);
  if (w.row == nullptr) return;  // measuring pass
  w.row_deq_m = ExpertMatrices::grouped(bf16(w.row_deq, E, w.N, w.K), "fc weight (dequantized)");
  if (!two_d())
    w.col_deq_m = ExpertMatrices::grouped(bf16(w.col_deq, E, w.K, w.N), "fc weight (dequantized, transposed)");
}

void EmulatedExpertsRecipe::plan_workspace(DeviceArena& a) {
  plan_weight(a, w_[0]);
  plan_weight(a, w_[1]);
  tok_[0] = a.take<uint16_t>(R_ * tok_cols_);
  tok_[1] = a.take<uint16_t>(R_ * tok_cols_);
  fq_ws_ = a.take<uint8_t>(static_cast<int64_t>(quant::fake_quantize_workspace_bytes(cfg_.experts)));
}

void EmulatedExpertsRecipe::bind_weights(const std::vector<TensorView>& fc1, const std::vector<TensorView>& fc2) {
  w_[0].source = fc1;
  w_[1].source = fc2;
}

QuantizedTensor EmulatedExpertsRecipe::weight_codes(int fc) const {
  const Weight& w = w_[fc - 1];
  const int64_t E = cfg_.experts;
  const ScaleShape rs = scale_shape(weights_, w.N, w.K), cs = scale_shape(weights_, w.K, w.N, true);
  const DType data = weights_.format == QuantFormat::kNVFP4 ? DType::kFP4E2M1 : DType::kFP8E4M3;
  QuantizedTensor q;
  q.rowwise_data = TensorView(w.row, data, {E, w.N, w.K}, Device::kCUDA);
  q.rowwise_scale = TensorView(w.row_scale, rs.dtype, {E, rs.rows, rs.cols}, Device::kCUDA);
  q.columnwise_data = TensorView(w.col, data, {E, w.K, w.N}, Device::kCUDA);
  q.columnwise_scale = TensorView(w.col_scale, cs.dtype, {E, cs.rows, cs.cols}, Device::kCUDA);
  if (weights_.format == QuantFormat::kNVFP4) q.global_amax = TensorView(w.amax, DType::kFP32, {E}, Device::kCUDA);
  return q;
}

void EmulatedExpertsRecipe::quantize_weight(int fc, cudaStream_t s) const {
  quantize_expert_weight(weights_, w_[fc - 1].source, weight_codes(fc), s);
  dequantize_weight(fc, s);
}

void EmulatedExpertsRecipe::dequantize_weight(int fc, cudaStream_t s) const {
  const Weight& w = w_[fc - 1];
  const QuantizedTensor all = weight_codes(fc);
  const int64_t E = cfg_.experts;
  moe::dequantize(weights_, all, /*columnwise=*/false, bf16(w.row_deq, E, w.N, w.K), s);
  if (!two_d()) moe::dequantize(weights_, all, /*columnwise=*/true, bf16(w.col_deq, E, w.K, w.N), s);
}

void EmulatedExpertsRecipe::dequantize_weights(cudaStream_t s) const {
  dequantize_weight(1, s);
  dequantize_weight(2, s);
}

void EmulatedExpertsRecipe::fprop(int fc, const GroupedGemm& gemm, const TensorView& a, const TensorView& g,
                                  const TensorView& y, const TensorView& ws, cudaStream_t s) const {
  gemm.fprop(a, w_[fc - 1].row_deq_m, g, y, ws, s);
}

void EmulatedExpertsRecipe::dgrad(int fc, const GroupedGemm& gemm, const TensorView& a, const TensorView& g,
                                  const TensorView& dx, const TensorView& ws, cudaStream_t s) const {
  if (two_d())
    gemm.dgrad(a, w_[fc - 1].row_deq_m, g, dx, ws, s);
  else
    gemm.fprop(a, w_[fc - 1].col_deq_m, g, dx, ws, s);
}

void EmulatedExpertsRecipe::quantize_weights(cudaStream_t s) const {
  quantize_weight(1, s);
  quantize_weight(2, s);
}

TensorView EmulatedExpertsRecipe::tokens(const TensorView& a, const TensorView& g, bool columnwise, int slot,
                                         cudaStream_t s) const {
  const TensorView out = bf16(tok_[slot], a.shape[0], a.shape[1]);
  quant::fake_quantize_groups(tokens_, columnwise, a, g, out, fq_ws_, s);
  return out;
}

}  // namespace moe
