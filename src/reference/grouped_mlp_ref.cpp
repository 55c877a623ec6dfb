// CPU reference of the expert layer (docs/semantics.md), composed from the dispatch, grouped GEMM
// and activation references; every step is a plain loop in fp64. The order of the steps (and what
// is rounded to bf16 under emulate_bf16) follows the GPU layer, so the layer's tests can compare
// against it closely.
#include "reference/grouped_mlp_ref.h"

#include <algorithm>

#include "moe/error.h"
#include "moe/float_convert.h"
#include "reference/activation_ref.h"
#include "reference/dispatch_ref.h"
#include "reference/quantize_ref.h"

namespace moe::ref {
namespace {

void check_table(const std::vector<double*>& t, const char* name, int E) {
  MOE_CHECK(static_cast<int>(t.size()) == E, "argument '", name, "': expected ", E, " expert pointers, got ",
            t.size());
  for (int e = 0; e < E; ++e) MOE_CHECK(t[e] != nullptr, "argument '", name, "': null pointer for expert ", e);
}

void check_params(const ExpertParams& p, const GroupedMlpConfig& c, const char* what) {
  const std::string w = what;
  check_table(p.fc1_weight, (w + ".fc1.weight").c_str(), c.experts);
  check_table(p.fc2_weight, (w + ".fc2.weight").c_str(), c.experts);
  if (c.bias) {
    check_table(p.fc1_bias, (w + ".fc1.bias").c_str(), c.experts);
    check_table(p.fc2_bias, (w + ".fc2.bias").c_str(), c.experts);
  } else {
    MOE_CHECK(p.fc1_bias.empty() && p.fc2_bias.empty(), "argument '", what,
              ".fc1.bias/fc2.bias': the layer has no biases (config.bias = false)");
  }
}

// v [rows, cols] replaced by the dequantization of its rowwise or columnwise copy under c, in v's
// orientation.
std::vector<double> fake_quantize(QuantConfig c, const double* v, int64_t rows, int64_t cols, bool columnwise) {
  c.rowwise = !columnwise;
  c.columnwise = columnwise;
  const std::vector<float> x(v, v + rows * cols);
  const std::vector<float> d = dequantize(c, quantize_fp32(c, x, 1, rows, cols), columnwise, 1, rows, cols);
  std::vector<double> out(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < cols; ++j) out[r * cols + j] = columnwise ? d[j * rows + r] : d[r * cols + j];
  return out;
}

}  // namespace

GroupedMlpRef::GroupedMlpRef(const GroupedMlpConfig& config, bool emulate_bf16)
    : config_(config), emulate_bf16_(emulate_bf16), hooks_(4) {
  config_.validate();
  MOE_CHECK(!config_.transposed_weights, "config 'transposed_weights': the reference takes weights in the standard ",
            "orientation (its tests transpose them on the host)");
}

void GroupedMlpRef::set_weights(const ExpertParams& weights) {
  check_params(weights, config_, "weights");
  w_ = weights;
  have_weights_ = true;
}

void GroupedMlpRef::set_grads(const ExpertParams& grads) {
  check_params(grads, config_, "grads");
  g_ = grads;
  have_grads_ = true;
}

void GroupedMlpRef::set_operand_quant(const OperandQuant& quant) {
  for (const QuantConfig* c : {&quant.tokens, &quant.weights}) {
    QuantConfig both = *c;
    both.rowwise = both.columnwise = true;
    validate_quant_config(both, c == &quant.tokens ? "quant.tokens" : "quant.weights");
  }
  MOE_CHECK(quant.tokens.blocking == QuantBlocking::k1D, "argument 'quant.tokens.blocking': token operands take ",
            "1-D blocks");
  quant_ = quant;
  quantize_operands_ = true;
}

std::vector<double> GroupedMlpRef::token_operand(const std::vector<double>& v, int64_t rows, int64_t cols,
                                                 bool columnwise) const {
  if (!quantize_operands_ || rows == 0) return v;
  std::vector<double> out(v.size(), 0.0);
  for (int e = 0; e < groups_.count(); ++e) {
    const int64_t r0 = groups_.offset[e], n = groups_.rows[e];
    if (n == 0) continue;
    const std::vector<float> x(v.begin() + r0 * cols, v.begin() + (r0 + n) * cols);
    const std::vector<float> d = fake_quantize_groups(quant_.tokens, columnwise, x, n, cols, {0, n});
    for (int64_t i = 0; i < n * cols; ++i) out[r0 * cols + i] = operand_value(d[i]);
  }
  return out;
}

double GroupedMlpRef::operand_value(float v) const {
  return quant_.bf16_operands ? round(v) : static_cast<double>(v);
}

std::vector<double*> GroupedMlpRef::weight_operand(const std::vector<double*>& w, int64_t rows, int64_t cols,
                                                   bool columnwise, std::vector<std::vector<double>>& store) const {
  if (!quantize_operands_) return w;
  store.clear();
  std::vector<double*> table;
  for (double* m : w) {
    store.push_back(fake_quantize(quant_.weights, m, rows, cols, columnwise));
    for (double& x : store.back()) x = operand_value(static_cast<float>(x));
    table.push_back(store.back().data());
  }
  return table;
}

void GroupedMlpRef::register_hook(Param param, Hook hook) {
  MOE_CHECK(static_cast<bool>(hook), "argument 'hook': expected a callable");
  hooks_[static_cast<int>(param)].push_back(std::move(hook));
}

double GroupedMlpRef::round(double v) const {
  return emulate_bf16_ ? static_cast<double>(round_to_bf16(static_cast<float>(v))) : v;
}
double GroupedMlpRef::round_f32(double v) const { return emulate_bf16_ ? static_cast<double>(static_cast<float>(v)) : v; }
void GroupedMlpRef::round_all(std::vector<double>& v) const {
  if (emulate_bf16_)
    for (double& x : v) x = round(x);
}

void GroupedMlpRef::forward(const Routing& routing, const double* x, double* y) {
  const GroupedMlpConfig& c = config_;
  MOE_CHECK(have_weights_, "GroupedMlpRef::forward: no weights bound (call set_weights first)");
  MOE_CHECK(!wgrad_pending_, "GroupedMlpRef::forward: the previous step's backward_dw() has not run");
  MOE_CHECK(routing.form == c.routing_form, "argument 'routing': expected the config's routing form");
  MOE_CHECK(routing.E == c.experts, "argument 'routing.E': expected ", c.experts, ", got ", routing.E);
  MOE_CHECK(routing.form == RoutingForm::kMap || routing.k == c.topk, "argument 'routing.k': expected ", c.topk,
            ", got ", routing.k);
  MOE_CHECK(routing.T >= 0 && routing.T <= c.max_tokens, "argument 'routing.T': expected 0..", c.max_tokens,
            ", got ", routing.T);
  MOE_CHECK(routing.T == 0 || (x != nullptr && y != nullptr), "argument 'x'/'y': null pointer");
  const int64_t H = c.hidden, F = c.ffn, F1 = c.fc1_out();
  const int E = c.experts;

  plan_ = plan_dispatch(routing, c.dispatch);
  const int64_t R = plan_.R;
  groups_.offset.assign(plan_.offset.begin(), plan_.offset.end());
  groups_.rows.resize(E);
  for (int e = 0; e < E; ++e) groups_.rows[e] = plan_.rows_in_bound(e);

  // Dispatch: rows of each expert (pad rows zero, prob zero).
  x_perm_.assign(R * H, 0.0);
  probs_perm_.assign(R, 0.0);
  permute(plan_, x, H, x_perm_.data(), probs_perm_.data());
  round_all(x_perm_);
  const double* p_act = probs_in_act() ? probs_perm_.data() : nullptr;

  // fc1 (+ b1): the GEMM output is stored, then the bias is added in place.
  h_.assign(R * F1, 0.0);
  std::vector<std::vector<double>> wq;
  grouped_fprop(groups_, token_operand(x_perm_, R, H, false).data(),
                weight_operand(w_.fc1_weight, F1, H, false, wq).data(), F1, H, h_.data());
  round_all(h_);
  if (c.bias)
    for (int e = 0; e < E; ++e)
      for (int64_t r = groups_.offset[e]; r < groups_.offset[e] + groups_.rows[e]; ++r)
        for (int64_t j = 0; j < F1; ++j) h_[r * F1 + j] = round(h_[r * F1 + j] + w_.fc1_bias[e][j]);

  // Activation x prob (or unscaled when probs are merged at combine), expert by expert.
  act_.assign(R * F, 0.0);
  for (int e = 0; e < E; ++e) {
    const int64_t r0 = groups_.offset[e], n = groups_.rows[e];
    if (n == 0) continue;
    activation_forward(c.activation, h_.data() + r0 * F1, p_act ? p_act + r0 : nullptr, n, F, act_.data() + r0 * F);
  }
  round_all(act_);

  // fc2 (+ p * b2, or + b2 when probs are merged at combine).
  Y_.assign(R * H, 0.0);
  grouped_fprop(groups_, token_operand(act_, R, F, false).data(), weight_operand(w_.fc2_weight, H, F, false, wq).data(),
                H, F, Y_.data());
  round_all(Y_);
  if (c.bias)
    for (int e = 0; e < E; ++e)
      for (int64_t r = groups_.offset[e]; r < groups_.offset[e] + groups_.rows[e]; ++r) {
        const double s = p_act ? p_act[r] : 1.0;
        for (int64_t j = 0; j < H; ++j) Y_[r * H + j] = round(Y_[r * H + j] + s * w_.fc2_bias[e][j]);
      }

  // Combine: merge with the probs only when they were not applied inside the experts.
  if (routing.T > 0) {
    unpermute(plan_, Y_.data(), H, !probs_in_act(), y);
    for (int64_t i = 0; i < routing.T * H; ++i) y[i] = round(y[i]);
  }
  forward_done_ = true;
}

void GroupedMlpRef::backward(const double* dy, double* dx, double* dprobs) {
  const GroupedMlpConfig& c = config_;
  MOE_CHECK(forward_done_, "GroupedMlpRef::backward: no forward to differentiate (call forward first)");
  MOE_CHECK(!wgrad_pending_, "GroupedMlpRef::backward: the previous step's backward_dw() has not run");
  MOE_CHECK(have_grads_, "GroupedMlpRef::backward: no gradient destinations bound (call set_grads first)");
  const int64_t T = plan_.T, H = c.hidden, F = c.ffn, F1 = c.fc1_out(), R = plan_.R;
  const int E = c.experts;
  const size_t n_slots = static_cast<size_t>(T) * plan_.slots;
  MOE_CHECK(T == 0 || (dy != nullptr && dx != nullptr && dprobs != nullptr),
            "argument 'dy'/'dx'/'dprobs': null pointer");
  const double* p_act = probs_in_act() ? probs_perm_.data() : nullptr;

  // Combine backward: dY = w * dy (w = 1 when probs are in the activation); with merged probs their
  // gradient <Y[row], dy[t]> comes from here.
  dY_.assign(R * H, 0.0);
  std::vector<double> dprobs_combine(probs_in_act() ? 0 : n_slots, 0.0);
  unpermute_backward(plan_, Y_.data(), dy, H, !probs_in_act(), dY_.data(),
                     probs_in_act() ? nullptr : dprobs_combine.data());
  round_all(dY_);

  // fc2 dgrad, then the activation's backward (dh and dp through the activation).
  std::vector<double> d_act(R * F, 0.0);
  std::vector<std::vector<double>> wq;
  grouped_dgrad(groups_, token_operand(dY_, R, H, false).data(), weight_operand(w_.fc2_weight, H, F, true, wq).data(),
                H, F, d_act.data());
  round_all(d_act);
  dh_.assign(R * F1, 0.0);
  std::vector<double> dp_perm(R, 0.0);
  for (int e = 0; e < E; ++e) {
    const int64_t r0 = groups_.offset[e], n = groups_.rows[e];
    if (n == 0) continue;
    activation_backward(c.activation, h_.data() + r0 * F1, p_act ? p_act + r0 : nullptr, d_act.data() + r0 * F, n,
                        F, dh_.data() + r0 * F1, p_act ? dp_perm.data() + r0 : nullptr);
  }
  round_all(dh_);
  // dp += <dY_r, b2_e>: the fc2 bias was scaled by p.
  if (p_act && c.bias)
    for (int e = 0; e < E; ++e)
      for (int64_t r = groups_.offset[e]; r < groups_.offset[e] + groups_.rows[e]; ++r) {
        double dot = 0.0;
        for (int64_t j = 0; j < H; ++j) dot += dY_[r * H + j] * w_.fc2_bias[e][j];
        dp_perm[r] += dot;
      }
  for (double& v : dp_perm) v = round_f32(v);

  // fc1 dgrad, then the dispatch's backward (sum of each token's rows; dprobs at the slots' rows).
  std::vector<double> dx_perm(R * H, 0.0);
  grouped_dgrad(groups_, token_operand(dh_, R, F1, false).data(),
                weight_operand(w_.fc1_weight, F1, H, true, wq).data(), F1, H, dx_perm.data());
  round_all(dx_perm);
  if (T > 0) {
    if (p_act) {
      permute_backward(plan_, dx_perm.data(), dp_perm.data(), H, dx, dprobs);
    } else {
      permute_backward(plan_, dx_perm.data(), nullptr, H, dx, nullptr);
      std::copy(dprobs_combine.begin(), dprobs_combine.end(), dprobs);
    }
    for (int64_t i = 0; i < T * H; ++i) dx[i] = round(dx[i]);
    for (size_t i = 0; i < n_slots; ++i) dprobs[i] = round_f32(dprobs[i]);
  }

  if (c.delay_wgrad) {
    wgrad_pending_ = true;  // dY_, act_, dh_, x_perm_ and probs_perm_ stay for backward_dw
    return;
  }
  compute_wgrad_fc2();
  compute_wgrad_fc1();
  for (Param p : {Param::kFc2Weight, Param::kFc2Bias, Param::kFc1Weight, Param::kFc1Bias}) fire(p);
}

void GroupedMlpRef::backward_dw() {
  MOE_CHECK(config_.delay_wgrad, "GroupedMlpRef::backward_dw: only for config.delay_wgrad = true");
  MOE_CHECK(wgrad_pending_, "GroupedMlpRef::backward_dw: no pending weight gradients (call backward first)");
  compute_wgrad_fc2();
  fire(Param::kFc2Weight);
  fire(Param::kFc2Bias);
  compute_wgrad_fc1();
  fire(Param::kFc1Weight);
  fire(Param::kFc1Bias);
  wgrad_pending_ = false;
}

void GroupedMlpRef::bias_grad(const std::vector<double>& d, int64_t cols, const double* scale,
                              const std::vector<double*>& db) {
  const bool acc = config_.wgrad == WgradMode::kAccumulate;
  for (int e = 0; e < config_.experts; ++e) {
    if (acc && groups_.rows[e] == 0) continue;  // main_grad of an expert without rows stays untouched
    for (int64_t j = 0; j < cols; ++j) {
      double s = 0.0;
      for (int64_t r = groups_.offset[e]; r < groups_.offset[e] + groups_.rows[e]; ++r)
        s += (scale ? scale[r] : 1.0) * d[r * cols + j];
      db[e][j] = acc ? db[e][j] + s : s;
    }
  }
}

// What storing the gradient does on the GPU: fp32 (main_grad or fp32 grads) or bf16 (written).
void GroupedMlpRef::round_grads(const std::vector<double*>& g, int64_t n) {
  if (!emulate_bf16_) return;
  const bool acc = config_.wgrad == WgradMode::kAccumulate;
  const bool to_bf16 = !acc && config_.wgrad_dtype == DType::kBF16;
  for (int e = 0; e < config_.experts; ++e) {
    if (acc && groups_.rows[e] == 0) continue;
    for (int64_t i = 0; i < n; ++i) g[e][i] = to_bf16 ? round(g[e][i]) : round_f32(g[e][i]);
  }
}

void GroupedMlpRef::compute_wgrad_fc2() {
  const GroupedMlpConfig& c = config_;
  const bool acc = c.wgrad == WgradMode::kAccumulate;
  // dW2_e = dY_e^T Act_e; db2_e = sum_rows (p *) dY_e (p when the bias was scaled by it).
  const int64_t R = plan_.R;
  grouped_wgrad(groups_, token_operand(dY_, R, c.hidden, true).data(), token_operand(act_, R, c.ffn, true).data(),
                c.hidden, c.ffn, g_.fc2_weight.data(), acc);
  round_grads(g_.fc2_weight, c.hidden * c.ffn);
  if (c.bias) {
    bias_grad(dY_, c.hidden, probs_in_act() ? probs_perm_.data() : nullptr, g_.fc2_bias);
    round_grads(g_.fc2_bias, c.hidden);
  }
}

void GroupedMlpRef::compute_wgrad_fc1() {
  const GroupedMlpConfig& c = config_;
  const bool acc = c.wgrad == WgradMode::kAccumulate;
  // dW1_e = dHh_e^T X_e; db1_e = sum_rows dHh_e.
  const int64_t R = plan_.R;
  grouped_wgrad(groups_, token_operand(dh_, R, c.fc1_out(), true).data(),
                token_operand(x_perm_, R, c.hidden, true).data(), c.fc1_out(), c.hidden, g_.fc1_weight.data(), acc);
  round_grads(g_.fc1_weight, c.fc1_out() * c.hidden);
  if (c.bias) {
    bias_grad(dh_, c.fc1_out(), nullptr, g_.fc1_bias);
    round_grads(g_.fc1_bias, c.fc1_out());
  }
}

void GroupedMlpRef::fire(Param p) {
  if (!config_.bias && (p == Param::kFc1Bias || p == Param::kFc2Bias)) return;
  for (auto& hook : hooks_[static_cast<int>(p)]) hook(p);
}

}  // namespace moe::ref
