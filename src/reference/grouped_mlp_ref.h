// CPU reference of the whole expert layer (SPEC 2-5): dispatch -> fc1 (+bias) -> activation x prob
// -> fc2 (+bias, scaled by p) -> combine, forward and backward, weight gradients written or
// accumulated into main_grad, delayed wgrad with per-parameter hooks.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "moe/grouped_mlp_config.h"
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

class GroupedMlpRef {
 public:
  using Hook = std::function<void(Param)>;

  // emulate_bf16: round every intermediate the GPU layer stores in bf16 (fc1 output, activation,
  // fc2 output, y, and their gradients), so GPU results can be compared with tight tolerances.
  explicit GroupedMlpRef(const GroupedMlpConfig& config, bool emulate_bf16 = false);

  void set_weights(const ExpertParams& weights);  // read only
  // Gradient destinations: written (kWrite) or accumulated into (kAccumulate, main_grad).
  void set_grads(const ExpertParams& grads);
  // Called once per backward (or backward_dw) when that parameter's gradient is final.
  void register_hook(Param param, Hook hook);

  // x [T, H] -> y [T, H].
  void forward(const Routing& routing, const double* x, double* y);
  // dy [T, H] -> dx [T, H], dprobs [T, slots]; weight gradients too unless config.delay_wgrad.
  void backward(const double* dy, double* dx, double* dprobs);
  // Delayed mode: fc2's weight gradients, then fc1's, each parameter's hooks once it is final.
  void backward_dw();

  const DispatchPlan& plan() const { return plan_; }
  const GroupedMlpConfig& config() const { return config_; }

 private:
  void compute_wgrad_fc2();
  void compute_wgrad_fc1();
  void fire(Param p);

  GroupedMlpConfig config_;
  bool emulate_bf16_;
  ExpertParams w_, g_;
  std::vector<std::vector<Hook>> hooks_;
  // Saved for backward.
  DispatchPlan plan_;
  std::vector<double> x_perm_, probs_perm_, h_, act_, act_unscaled_, Y_;
  std::vector<double> dY_, dh_;
  bool wgrad_pending_ = false;
};

}  // namespace moe::ref
