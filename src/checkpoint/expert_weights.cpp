// ExpertWeights: the expert MLP's parameters on the host in our layout (include/moe/checkpoint.h).
#include <cstring>

#include "checkpoint/element_io.h"
#include "moe/checkpoint.h"
#include "moe/error.h"

namespace moe {

namespace {

constexpr Param kParams[] = {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias};

int64_t product(const std::vector<int64_t>& s) {
  int64_t n = 1;
  for (int64_t v : s) n *= v;
  return n;
}

}  // namespace

bool is_weight_dtype(DType t) {
  return t == DType::kBF16 || t == DType::kFP16 || t == DType::kFP32 || t == DType::kFP64;
}

// ---------------------------------------------------------------------------------------------
// ExpertWeightsSpec

ExpertWeightsSpec ExpertWeightsSpec::from_config(const GroupedMlpConfig& c) {
  // Checkpoints and their conversions describe the standard orientation; a square matrix in the
  // other one would otherwise be taken without a shape error.
  MOE_CHECK(!c.transposed_weights, "config 'transposed_weights': checkpoint weights are described in the ",
            "standard orientation ([E, fc1_out, H], [E, H, F]) only");
  ExpertWeightsSpec s;
  s.hidden = c.hidden;
  s.ffn = c.ffn;
  s.experts = c.experts;
  s.activation = c.activation;
  s.bias = c.bias;
  s.layout = c.layout;
  return s;
}

std::vector<int64_t> ExpertWeightsSpec::expert_shape(Param p) const {
  switch (p) {
    case Param::kFc1Weight: return {fc1_out(), hidden};
    case Param::kFc1Bias: return {fc1_out()};
    case Param::kFc2Weight: return {hidden, ffn};
    case Param::kFc2Bias: return {hidden};
  }
  return {};
}

void ExpertWeightsSpec::validate() const {
  MOE_CHECK(hidden > 0, "argument 'hidden': expected > 0, got ", hidden);
  MOE_CHECK(ffn > 0, "argument 'ffn': expected > 0, got ", ffn);
  MOE_CHECK(experts > 0, "argument 'experts': expected > 0, got ", experts);
  validate_activation(activation, ffn);
}

// ---------------------------------------------------------------------------------------------
// ExpertWeights

ExpertWeights::ExpertWeights(const ExpertWeightsSpec& spec, DType dtype) : spec_(spec), dtype_(dtype) {
  spec_.validate();
  MOE_CHECK(is_weight_dtype(dtype), "argument 'dtype': expected bf16, fp16, fp32 or fp64, got ", dtype_name(dtype));
  for (Param p : kParams) {
    if (!spec_.has(p)) continue;
    std::vector<int64_t> shape = spec_.expert_shape(p);
    if (spec_.layout == WeightLayout::kSingleGrouped) {
      shape.insert(shape.begin(), spec_.experts);
      params_[index(p)].emplace_back(dtype, shape);
    } else {
      for (int e = 0; e < spec_.experts; ++e) params_[index(p)].emplace_back(dtype, shape);
    }
  }
}

ExpertWeights ExpertWeights::from_state_dict(const StateDict& sd, const ExpertWeightsSpec& spec,
                                             const std::string& prefix) {
  spec.validate();
  const int E = spec.experts;
  // The keys of this layer only (copies share bytes), so normalising never touches `sd`.
  StateDict mine;
  for (Param p : kParams) {
    const std::string base = expert_param_key(prefix, p);
    for (auto it = sd.lower_bound(base); it != sd.end() && it->first.compare(0, base.size(), base) == 0; ++it) {
      const std::string rest = it->first.substr(base.size());
      if (!rest.empty() && rest.find_first_not_of("0123456789") != std::string::npos) continue;  // other keys
      MOE_CHECK(spec.has(p), "state dict: '", it->first, "' is present but the layer has no biases");
      MOE_CHECK(rest.empty() || (rest.size() < 8 && (rest == "0" || rest[0] != '0') && std::stoi(rest) < E),
                "state dict: '", it->first, "' names no expert of the layer's ", E);
      mine.emplace(it->first, it->second);
    }
  }
  normalize_expert_keys(mine, prefix, E, spec.layout);

  ExpertWeights w;
  w.spec_ = spec;
  bool have_dtype = false;
  auto take = [&](const std::string& key, const std::vector<int64_t>& expected, const std::vector<int64_t>& flat) {
    auto it = mine.find(key);
    MOE_CHECK(it != mine.end(), "state dict: missing '", key, "' (", shape_string(expected), ")");
    HostTensor t = it->second;
    MOE_CHECK(t.shape() == expected || (!flat.empty() && t.shape() == flat), "state dict: '", key, "' has shape ",
              t.shape_string(), ", expected ", shape_string(expected));
    MOE_CHECK(is_weight_dtype(t.dtype()), "state dict: '", key, "' has dtype ", dtype_name(t.dtype()),
              ", expected bf16, fp16, fp32 or fp64");
    if (!have_dtype) w.dtype_ = t.dtype(), have_dtype = true;
    MOE_CHECK(t.dtype() == w.dtype_, "state dict: '", key, "' has dtype ", dtype_name(t.dtype()),
              ", the layer's other parameters ", dtype_name(w.dtype_));
    return t.shape() == expected ? t : t.reshaped(expected);
  };
  for (Param p : kParams) {
    if (!spec.has(p)) continue;
    const std::vector<int64_t> one = spec.expert_shape(p);
    if (spec.layout == WeightLayout::kSingleGrouped) {
      std::vector<int64_t> grouped = one, flat = one;
      grouped.insert(grouped.begin(), E);
      flat[0] *= E;  // [E * rows, cols] (e.g. Megatron's stacked rows)
      w.params_[index(p)].push_back(take(expert_param_key(prefix, p), grouped, flat));
    } else {
      for (int e = 0; e < E; ++e) w.params_[index(p)].push_back(take(expert_param_key(prefix, p, e), one, {}));
    }
  }
  return w;
}

StateDict ExpertWeights::to_state_dict(const std::string& prefix) const {
  StateDict sd;
  for (Param p : kParams) {
    const auto& ts = params_[index(p)];
    if (spec_.layout == WeightLayout::kSingleGrouped) {
      if (!ts.empty()) sd.emplace(expert_param_key(prefix, p), ts[0]);
    } else {
      for (size_t e = 0; e < ts.size(); ++e) sd.emplace(expert_param_key(prefix, p, static_cast<int>(e)), ts[e]);
    }
  }
  return sd;
}

ExpertWeights ExpertWeights::with_layout(WeightLayout layout) const {
  ExpertWeightsSpec s = spec_;
  s.layout = layout;
  return from_state_dict(to_state_dict(), s);  // normalize_expert_keys stacks or splits
}

ExpertWeights ExpertWeights::with_glu_interleave(int glu_interleave) const {
  ExpertWeightsSpec s = spec_;
  s.activation.glu_interleave = glu_interleave;
  ExpertWeights out(s, dtype_);
  const int64_t F = spec_.ffn, H = spec_.hidden;
  const int from = spec_.activation.glu_interleave, to = glu_interleave;
  const int64_t elem = dtype_bytes(dtype_, 1);
  for (int e = 0; e < spec_.experts; ++e) {
    for (Param p : kParams) {
      if (!spec_.has(p)) continue;
      const uint8_t* src = expert_data(p, e);
      uint8_t* dst = out.mutable_expert_data(p, e);
      const int64_t n = product(spec_.expert_shape(p)) * elem;
      if (p == Param::kFc2Weight || p == Param::kFc2Bias || !is_gated(spec_.activation.kind)) {
        std::memcpy(dst, src, n);
        continue;
      }
      // fc1 rows (weight: H elements each; bias: one) move to their column under the new interleave.
      const int64_t row = (p == Param::kFc1Weight ? H : 1) * elem;
      for (int64_t j = 0; j < F; ++j) {
        std::memcpy(dst + gate_column(j, F, to) * row, src + gate_column(j, F, from) * row, row);
        std::memcpy(dst + linear_column(j, F, to) * row, src + linear_column(j, F, from) * row, row);
      }
    }
  }
  return out;
}

ExpertWeights ExpertWeights::cast(DType dtype) const {
  ExpertWeights out(spec_, dtype);
  for (Param p : kParams) {
    if (!spec_.has(p)) continue;
    const int64_t n = product(spec_.expert_shape(p));
    for (int e = 0; e < spec_.experts; ++e) {
      const uint8_t* src = expert_data(p, e);
      uint8_t* dst = out.mutable_expert_data(p, e);
      if (dtype == dtype_) {
        std::memcpy(dst, src, dtype_bytes(dtype, n));
        continue;
      }
      // fp64 -> bf16/fp16 rounds twice (via fp32); exact for every value a narrower dtype holds.
      for (int64_t i = 0; i < n; ++i) detail::store_element(dtype, dst, i, detail::load_element(dtype_, src, i));
    }
  }
  return out;
}

const uint8_t* ExpertWeights::expert_data(Param p, int e) const {
  MOE_CHECK(spec_.has(p), "expert weights: the layer has no ", param_name(p));
  MOE_CHECK(e >= 0 && e < spec_.experts, "argument 'expert': expected [0, ", spec_.experts, "), got ", e);
  const auto& ts = params_[index(p)];
  if (spec_.layout == WeightLayout::kPerExpert) return ts[e].data();
  return ts[0].data() + e * dtype_bytes(dtype_, product(spec_.expert_shape(p)));
}

uint8_t* ExpertWeights::mutable_expert_data(Param p, int e) {
  expert_data(p, e);  // argument checks
  auto& ts = params_[index(p)];
  if (spec_.layout == WeightLayout::kPerExpert) return ts[e].mutable_data();
  return ts[0].mutable_data() + e * dtype_bytes(dtype_, product(spec_.expert_shape(p)));
}

std::vector<TensorView> ExpertWeights::views(Param p) const {
  std::vector<TensorView> v;
  for (const HostTensor& t : params_[index(p)]) v.push_back(t.view());
  return v;
}

bool ExpertWeights::equals(const ExpertWeights& o) const {
  if (dtype_ != o.dtype_ || spec_.hidden != o.spec_.hidden || spec_.ffn != o.spec_.ffn ||
      spec_.experts != o.spec_.experts || spec_.bias != o.spec_.bias || spec_.layout != o.spec_.layout ||
      spec_.activation.kind != o.spec_.activation.kind ||
      spec_.activation.glu_interleave != o.spec_.activation.glu_interleave)
    return false;
  for (Param p : kParams) {
    const auto &a = params_[index(p)], &b = o.params_[index(p)];
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (!a[i].equals(b[i])) return false;
  }
  return true;
}

}  // namespace moe
