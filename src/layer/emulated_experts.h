// The emulated MXFP8 / NVFP4 recipes of GroupedExperts (ExpertsConfig::emulated, docs/layer.md):
// every GEMM operand goes through the format -- quantized (round to nearest) into the codes and
// scales a Blackwell GEMM would read, then dequantized to bf16 -- and the bf16 grouped GEMMs
// compute with those values.
//
//   forward   x_perm, act  -> rowwise   (fc1 / fc2 fprop)
//   backward  dY, dh       -> rowwise   (fc2 / fc1 dgrad)
//             dY & act, dh & x_perm -> columnwise (fc2 / fc1 wgrad)
//   weights   rowwise copy (fprop), columnwise copy (dgrad), per expert matrix
//
// Token operands are quantized per expert group (quant/fake_quantize.h) straight into a bf16
// workspace, so the saved state is the bf16 path's (x_perm, h, act): the weight gradients quantize
// act and x_perm again at backward time, a pure function of the saved values. The weights are
// quantized by moe::quantize into codes and scales the op keeps (the storage a checkpoint of
// quantized weights holds) and dequantized once per refresh into bf16 copies the GEMMs read: the
// rowwise copy as W [E, N, K] (fprop) and, with 1-D blocks, the columnwise copy as W^T [E, K, N],
// which computes dgrad as an fprop (dx = dy (W^T)^T); 2-D blocks (NVFP4 16x16) give both copies the
// same values, so dgrad reads the rowwise one.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "device/device_arena.h"
#include "moe/grouped_gemm.h"
#include "moe/grouped_mlp_config.h"
#include "moe/quantize.h"
#include "moe/tensor.h"

namespace moe {

class EmulatedExpertsRecipe {
 public:
  explicit EmulatedExpertsRecipe(const ExpertsConfig& config);

  // The op's workspace (two passes of the arena: measure, then carve).
  void plan_workspace(DeviceArena& arena);

  // The bound bf16 weights (either layout), kept for quantize_weights.
  void bind_weights(const std::vector<TensorView>& fc1_weight, const std::vector<TensorView>& fc2_weight);
  // Codes and scales of both copies, then their bf16 dequantizations. Graph-capturable.
  void quantize_weights(cudaStream_t stream) const;
  // The bf16 dequantizations of the codes alone (after codes were written through weight_codes,
  // e.g. loaded from a checkpoint).
  void dequantize_weights(cudaStream_t stream) const;
  // fc (1 or 2)'s codes and scales, single grouped: rowwise [E, N, K], columnwise [E, K, N], row-major
  // scales (weight_config()), NVFP4's global amax [E].
  QuantizedTensor weight_codes(int fc) const;
  // fc (1 or 2)'s products with the dequantized weight copies, A a token operand already through
  // tokens(): y [rows, N] = A W^T (the rowwise copy), dx [rows, K] = A W (the columnwise copy: with
  // 1-D blocks its own dequantization W^T [E, K, N], run as an fprop; with 2-D blocks the rowwise
  // copy's values, so no second copy is kept).
  void fprop(int fc, const GroupedGemm& gemm, const TensorView& a, const TensorView& g, const TensorView& y,
             const TensorView& gemm_ws, cudaStream_t stream) const;
  void dgrad(int fc, const GroupedGemm& gemm, const TensorView& a, const TensorView& g, const TensorView& dx,
             const TensorView& gemm_ws, cudaStream_t stream) const;

  // a bf16 [rows, cols] through the token format, each expert's rows of g on their own: rowwise
  // (blocks along cols; fprop and dgrad) or columnwise (blocks along the rows; wgrad), into token
  // workspace `slot` (0 or 1). Returns the bf16 view [rows, cols] of the result.
  TensorView tokens(const TensorView& a, const TensorView& g, bool columnwise, int slot, cudaStream_t stream) const;

  QuantConfig token_config() const { return tokens_; }
  QuantConfig weight_config() const { return weights_; }

 private:
  struct Weight {
    int64_t N = 0, K = 0;  // W_e [N, K]
    uint8_t *row = nullptr, *col = nullptr, *row_scale = nullptr, *col_scale = nullptr;
    float* amax = nullptr;  // NVFP4: [E]
    uint16_t *row_deq = nullptr, *col_deq = nullptr;  // col_deq: 1-D blocks only
    std::vector<TensorView> source;
    ExpertMatrices row_deq_m, col_deq_m;
  };
  void plan_weight(DeviceArena& arena, Weight& w);
  void quantize_weight(int fc, cudaStream_t stream) const;
  void dequantize_weight(int fc, cudaStream_t stream) const;
  int64_t data_bytes(int64_t elements) const;
  bool two_d() const { return weights_.blocking == QuantBlocking::k2D; }

  ExpertsConfig cfg_;
  QuantConfig tokens_, weights_;
  int64_t R_ = 0, tok_cols_ = 0;
  Weight w_[2];
  uint16_t* tok_[2] = {nullptr, nullptr};
  void* fq_ws_ = nullptr;
};

}  // namespace moe
