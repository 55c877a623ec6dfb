// CPU reference of the whole expert layer (docs/semantics.md): dispatch -> fc1 (+bias) ->
// activation x prob -> fc2 (+bias, scaled by p) -> combine, forward and backward, weight gradients
// written or accumulated into main_grad, delayed wgrad with per-parameter hooks. fp64 throughout
// (so finite differences can check every gradient); built from the dispatch, grouped GEMM and
// activation references. Probs are applied in the activation (fc2 bias scaled by p) or merged at
// combine, never both (config.probs).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "moe/grouped_mlp_config.h"
#include "moe/quant_format.h"
#include "reference/grouped_gemm_ref.h"
#include "reference/routing_ref.h"

namespace moe::ref {

// Per-expert pointer tables of the four parameters, fp64 on the host, in the config's physical
// layout (fc1 rows follow the GLU interleave). Values are fp64 (exact for bf16/fp32 data). Single-grouped = pointers into one [E, ...] block,
// per-expert = E separate blocks; results must be bitwise identical either way.
struct ExpertParams {
  std::vector<double*> fc1_weight;  // E x [fc1_out, H]
  std::vector<double*> fc1_bias;    // E x [fc1_out]   (config.bias only)
  std::vector<double*> fc2_weight;  // E x [H, F]
  std::vector<double*> fc2_bias;    // E x [H]         (config.bias only)
};

// Quantized GEMM operands, as the layer's quantized recipes compute (docs/layer.md, FP8 experts):
// each operand of the six products is replaced by the dequantization of its quantized copy. Token
// operands (x_perm, act, dY, dh; [R, cols] in permuted row order) use `tokens` (1-D blocks), each
// expert's rows quantized as a matrix of their own (ref::fake_quantize_groups: NVFP4 with a global
// amax per expert): their rowwise copy (blocks along the reduction) in fprop and dgrad, their
// columnwise copy (blocks along the rows, from the expert's first row) in the weight gradients.
// Each expert's weight matrix uses `weights`: its rowwise copy in fprop, its columnwise copy in
// dgrad (the same values with 2-D blocks). The quantizer sees the values as fp32 (exact for the
// bf16 values the layer stores). Bias gradients and dprobs read the unquantized dY and dact, as the
// layer does.
struct OperandQuant {
  QuantConfig tokens, weights;
  // The dequantized operands rounded to bf16 (with emulate_bf16): the emulated recipes feed them to
  // bf16 GEMMs.
  bool bf16_operands = false;
};

class GroupedMlpRef {
 public:
  using Hook = std::function<void(Param)>;

  // emulate_bf16: round every intermediate the GPU layer stores in bf16 (x_perm, fc1 output and again
  // after its bias, activation, fc2 output and again after its bias, y; dY, dAct, dh, dx_perm, dx),
  // round dprobs and fp32 gradients to fp32 and bf16-written gradients to bf16, so GPU results can
  // be compared with tight tolerances. Off: pure fp64 (for finite differences).
  explicit GroupedMlpRef(const GroupedMlpConfig& config, bool emulate_bf16 = false);

  void set_weights(const ExpertParams& weights);  // read only
  // Gradient destinations: written (kWrite) or accumulated into (kAccumulate, main_grad).
  void set_grads(const ExpertParams& grads);
  // Called once per backward (or backward_dw) when that parameter's gradient is final; bias hooks
  // only when config.bias. Order: fc2.weight, fc2.bias, fc1.weight, fc1.bias.
  void register_hook(Param param, Hook hook);
  // Quantized operands from now on (see OperandQuant); the configs' copy flags are ignored.
  void set_operand_quant(const OperandQuant& quant);

  // x [T, H] -> y [T, H].
  void forward(const Routing& routing, const double* x, double* y);
  // dy [T, H] -> dx [T, H], dprobs [T, slots]; weight gradients too unless config.delay_wgrad.
  void backward(const double* dy, double* dx, double* dprobs);
  // Delayed mode: fc2's weight gradients, then fc1's, each parameter's hooks once it is final.
  void backward_dw();

  const DispatchPlan& plan() const { return plan_; }
  const GroupedMlpConfig& config() const { return config_; }
  // Saved intermediates of the last forward, [R, cols] in permuted row order (for layer tests).
  const std::vector<double>& x_perm() const { return x_perm_; }
  const std::vector<double>& fc1_out() const { return h_; }   // after its bias
  const std::vector<double>& act() const { return act_; }     // scaled by p when probs are in the activation
  const std::vector<double>& fc2_out() const { return Y_; }   // after its bias

 private:
  bool probs_in_act() const { return config_.probs == ProbsPlacement::kInActivation; }
  double round(double v) const;     // bf16 rounding when emulating
  double round_f32(double v) const;  // fp32 rounding when emulating
  void round_all(std::vector<double>& v) const;
  void compute_wgrad_fc2();
  void compute_wgrad_fc1();
  // db_e (= or +=) sum over expert e's rows of (scale[r] *) d[r, :], scale may be null.
  void bias_grad(const std::vector<double>& d, int64_t cols, const double* scale, const std::vector<double*>& db);
  void round_grads(const std::vector<double*>& g, int64_t n);
  void fire(Param p);
  // `v` [rows, cols] through the token quantization (columnwise: blocks along the rows), or `v`
  // itself without operand quantization.
  std::vector<double> token_operand(const std::vector<double>& v, int64_t rows, int64_t cols, bool columnwise) const;
  // A dequantized operand value, rounded to bf16 with quant_.bf16_operands (and emulate_bf16).
  double operand_value(float v) const;
  // Each expert's [rows, cols] weight through the weight quantization (into `store`), or the bound
  // table itself.
  std::vector<double*> weight_operand(const std::vector<double*>& w, int64_t rows, int64_t cols, bool columnwise,
                                      std::vector<std::vector<double>>& store) const;

  GroupedMlpConfig config_;
  bool emulate_bf16_;
  bool quantize_operands_ = false;
  OperandQuant quant_;
  ExpertParams w_, g_;
  bool have_weights_ = false, have_grads_ = false;
  std::vector<std::vector<Hook>> hooks_;
  // Saved for backward.
  DispatchPlan plan_;
  Groups groups_;
  std::vector<double> x_perm_, probs_perm_, h_, act_, Y_;
  std::vector<double> dY_, dh_;
  bool forward_done_ = false;
  bool wgrad_pending_ = false;
};

}  // namespace moe::ref
