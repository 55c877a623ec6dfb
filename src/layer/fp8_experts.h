// The FP8 block-scaling recipe of GroupedExperts (ExpertsConfig::fp8 = kBlock, docs/layer.md, FP8):
// which tensor is quantized where, the quantized copies of the weights, and the FP8 products. Every
// GEMM operand is E4M3 with fp32 block scales (docs/quantization.md, FP8 block); everything between
// the GEMMs (h, the activation, dact, dh, bias, probs) stays bf16 as in the bf16 path.
//
//   forward   x_perm -> rowwise (fc1 fprop)  + columnwise, saved (fc1 wgrad), quantized from x_perm
//                       or from the rows of x gathered through the dispatch map (same bits)
//             act    -> rowwise (fc2 fprop)  + columnwise, saved (fc2 wgrad), quantized as the
//                       activation computes it from h (act itself is never stored)
//   backward  dY     -> rowwise (fc2 dgrad)  + columnwise (fc2 wgrad), from dY or gathered from dy
//             dh     -> rowwise (fc1 dgrad)  + columnwise (fc1 wgrad), without the fc1 bias
//                       quantized as the activation backward computes it (dh is never stored)
//             (the columnwise copies are transient, read by the weight gradients right after; with
//             delayed weight gradients they are saved in the state, where backward_dw reads them)
//   weights   128x128 blocks, rowwise (fprop) and columnwise (dgrad), at every forward
//
// Quantizing the weights at every forward (and recompute) makes the copies a pure function of the
// bf16 weights at that moment: an eval forward between two train steps, or new weights after an
// optimizer step, can never leave a stale copy for a later forward (a backward uses the copies of
// the latest forward or refresh). With FP8 primary weights (kFromMaster) the bound weights are the
// fp32 master weights, quantized without a bf16 rounding. Both weight layouts quantize into one grouped
// copy (the per-expert layout one expert at a time), so their results are bitwise equal.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

#include "device/device_arena.h"
#include "moe/activation.h"
#include "moe/grouped_gemm.h"
#include "moe/grouped_mlp_config.h"
#include "moe/quantize.h"
#include "moe/tensor.h"

namespace moe {

class Fp8ExpertsRecipe {
 public:
  explicit Fp8ExpertsRecipe(const ExpertsConfig& config);

  // The op's workspace (two passes of the arena: measure, then carve).
  void plan_workspace(DeviceArena& arena);
  // The FP8 part of a saved state: the columnwise copies the weight gradients read. With delayed
  // weight gradients (config.delay_wgrad) also those of dY and dh, which the backward makes and
  // backward_dw reads; otherwise they are transient, in the recipe's workspace.
  struct SavedCopies {
    uint8_t* x_col = nullptr;  // [H, rows]
    float* x_col_scale = nullptr;
    uint8_t* act_col = nullptr;  // [F, rows]
    float* act_col_scale = nullptr;
    uint8_t* dy_col = nullptr;  // [H, rows], delayed only
    float* dy_col_scale = nullptr;
    uint8_t* dh_col = nullptr;  // [fc1_out, rows], delayed only
    float* dh_col_scale = nullptr;
  };
  SavedCopies plan_state(DeviceArena& arena) const;

  // The weights' views as bound (either layout; bf16, or fp32 master weights), kept for
  // quantize_weights.
  void bind_weights(const std::vector<TensorView>& fc1_weight, const std::vector<TensorView>& fc2_weight);
  void quantize_weights(cudaStream_t stream) const;
  // Views of fc (1 or 2)'s quantized copies (see GroupedExperts::fp8_weights), and their format:
  // 128x128 blocks, both copies, row-major fp32 scales (powers of two with Fp8Recipe::kBlockPow2).
  QuantizedTensor weight_copies(int fc) const;
  QuantConfig weight_config() const;

  // Quantizes a bf16 [rows, cols]: rowwise into the token workspace (read by the next fprop or
  // dgrad) when `rowwise`; columnwise into (col, col_scale) when col is given.
  void quantize(const TensorView& a, bool rowwise, uint8_t* col, float* col_scale, cudaStream_t stream) const;
  // The same for the rows of x [T, cols] gathered through a row map (row r = x[row_slots[r] /
  // slots], zeros where -1): bitwise quantize() of the permuted matrix, which is never written.
  void quantize_gathered(const TensorView& x, const TensorView& row_slots, int slots, bool rowwise, uint8_t* col,
                         float* col_scale, uint32_t* error_word, cudaStream_t stream) const;
  // The same for act = activation(h) x probs [rows, ffn], computed on the way (act is not stored):
  // bitwise the copies of quantize() on activation_forward's output.
  void quantize_activation(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                           const TensorView& group_offsets, bool rowwise, uint8_t* col, float* col_scale,
                           cudaStream_t stream) const;
  // The same for dh = activation_backward(h, d_out, probs) [rows, fc1_out], computed on the way
  // (dh is not stored): bitwise the copies of quantize() on activation_backward's dh, rowwise into
  // the token workspace and columnwise into (col, col_scale) (the transient copy, or a delayed
  // state's); dprobs [rows] (or absent) summed per tile of dh in the recipe's workspace (which it
  // has with fused_activation_grad() and the probs in the activation).
  void quantize_activation_grad(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                                const TensorView& d_out, const TensorView& group_offsets, const TensorView& dprobs,
                                uint8_t* col, float* col_scale, cudaStream_t stream) const;
  // Whether the backward quantizes dh as the activation backward computes it: without the fc1
  // bias (whose gradient sums dh in bf16), and where that kernel evaluates each feature's
  // derivatives once (activation_backward_quantized_evaluates_once); elsewhere the activation
  // backward and dh's quantize run apart.
  bool fused_activation_grad() const;
  // The transient columnwise copy of dY or dh (backward), for the weight gradient that follows
  // (none with delayed weight gradients: the state keeps those copies).
  uint8_t* col_workspace() const { return col_; }
  float* col_workspace_scale() const { return col_scale_; }

  // fc (1 or 2): y [rows, N] = q(a) W^T from the token workspace's rowwise copy of a [rows, K]
  // (rows = y's).
  void fprop(int fc, const GroupedGemm& gemm, const TensorView& gemm_ws, const TensorView& g, const TensorView& y,
             cudaStream_t stream) const;
  // fc (1 or 2): dx [rows, K] = q(dy) W from the token workspace's rowwise copy of dy [rows, N]
  // (rows = dx's).
  void dgrad(int fc, const GroupedGemm& gemm, const TensorView& gemm_ws, const TensorView& g, const TensorView& dx,
             cudaStream_t stream) const;
  // dW [N, K] = q(dy)^T q(x) over `rows` tokens, from columnwise copies dy^T [N, rows], x^T [K, rows].
  void wgrad(const GroupedGemm& gemm, const TensorView& gemm_ws, const TensorView& g, int64_t rows,
             const uint8_t* dy_col, const float* dy_col_scale, int64_t N, const uint8_t* x_col,
             const float* x_col_scale, int64_t K, const ExpertMatrices& dw, bool accumulate, uint32_t* error_word,
             cudaStream_t stream) const;

 private:
  struct Weight {
    int64_t N = 0, K = 0;  // W_e [N, K]
    uint8_t *row = nullptr, *col = nullptr;
    float *row_scale = nullptr, *col_scale = nullptr;
    std::vector<TensorView> source;  // as bound: bf16 weights, or fp32 master weights (kFromMaster)
    ExpertMatrices row_m, row_scale_m, col_m, col_scale_m;  // views of the copies for the GEMMs
  };
  void plan_weight(DeviceArena& arena, Weight& w);
  void quantize_weight(int fc, cudaStream_t stream) const;
  QuantizedTensor token_copies(int64_t rows, int64_t cols, bool rowwise, uint8_t* col, float* col_scale) const;
  // The tokens' format: 1x128 blocks, the copies asked for (scale layouts as described above).
  QuantConfig token_config(bool rowwise, bool columnwise) const;
  bool pow2() const { return cfg_.fp8 == Fp8Recipe::kBlockPow2; }
  void token_product(GemmOp op, const Weight& w, const GroupedGemm& gemm, const TensorView& gemm_ws,
                     const TensorView& g, const TensorView& out, cudaStream_t stream) const;

  ExpertsConfig cfg_;
  int64_t R_ = 0;
  Weight w_[2];
  // Token workspace: the rowwise copy of the operand of the next fprop / dgrad ([rows, cols], scales
  // [rows, ceil(cols / 128)]) and the transient columnwise copy of dY or dh (not with delayed weight
  // gradients, whose states keep those copies).
  int64_t tok_cols_ = 0;
  uint8_t* row_ = nullptr;
  float* row_scale_ = nullptr;
  uint8_t* col_ = nullptr;
  float* col_scale_ = nullptr;
  // The tile sums of dprobs of quantize_activation_grad ([tiles of dh's columns, rows]).
  float* grad_partials_ = nullptr;
  int64_t grad_partials_count_ = 0;
};

}  // namespace moe
