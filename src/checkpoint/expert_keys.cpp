// Layout normalisation of expert keys: single grouped <-> per expert (docs/semantics.md, Weight
// layouts and checkpoints).
#include <cstring>

#include "checkpoint/key_list.h"
#include "moe/error.h"
#include "moe/state_dict.h"

namespace moe {

namespace {

constexpr Param kParams[] = {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias};

// P.S0 .. P.S{E-1} -> P.S [E, ...], when all are present and P.S is not.
void stack_experts(StateDict& sd, const std::string& prefix, Param p, int E) {
  const std::string key = expert_param_key(prefix, p);
  if (sd.count(key)) return;  // the target is present: never overwritten
  std::vector<std::string> present;
  detail::KeyList missing;
  for (int e = 0; e < E; ++e) {
    std::string k = expert_param_key(prefix, p, e);
    if (sd.count(k))
      present.push_back(std::move(k));
    else if (missing.full())
      missing.skip();
    else
      missing.add(k);
  }
  if (present.empty()) return;
  MOE_CHECK(missing.empty(), "state dict: cannot stack '", key, "' for ", E, " experts: ", present.size(),
            " per-expert keys are present, missing ", missing.str());
  const HostTensor& first = sd.at(present[0]);
  for (int e = 1; e < E; ++e) {
    const HostTensor& t = sd.at(present[e]);
    MOE_CHECK(t.dtype() == first.dtype() && t.shape() == first.shape(), "state dict: '", present[e], "' is ",
              dtype_name(t.dtype()), " ", t.shape_string(), " but '", present[0], "' is ", dtype_name(first.dtype()),
              " ", first.shape_string(), ": per-expert tensors must match to be stacked");
  }
  std::vector<int64_t> shape{E};
  shape.insert(shape.end(), first.shape().begin(), first.shape().end());
  HostTensor stacked(first.dtype(), shape);
  const int64_t n = first.nbytes();
  uint8_t* dst = stacked.mutable_data();
  for (int e = 0; e < E; ++e) {
    if (n > 0) std::memcpy(dst + e * n, sd.at(present[e]).data(), n);
    sd.erase(present[e]);
  }
  sd.emplace(key, std::move(stacked));
}

// P.S [E, ...] or [m E, ...] -> P.S0 .. P.S{E-1}, when no P.S{i} is present.
void split_experts(StateDict& sd, const std::string& prefix, Param p, int E) {
  const std::string key = expert_param_key(prefix, p);
  auto it = sd.find(key);
  if (it == sd.end()) return;
  for (int e = 0; e < E; ++e)
    if (sd.count(expert_param_key(prefix, p, e))) return;  // already (partly) per expert: left alone
  const HostTensor& t = it->second;
  MOE_CHECK(t.ndim() >= 1 && t.size(0) % E == 0 && t.size(0) > 0, "state dict: cannot split '", key, "' ",
            t.shape_string(), " into ", E, " experts: its first dimension must be ", E, " or a multiple of it");
  const int64_t rows = t.size(0) / E;
  std::vector<int64_t> shape(t.shape().begin() + 1, t.shape().end());
  if (rows > 1) shape.insert(shape.begin(), rows);  // a chunk keeps its rows: [m, ...]
  const int64_t n = t.nbytes() / E;
  for (int e = 0; e < E; ++e) {
    HostTensor slice(t.dtype(), shape);
    if (n > 0) std::memcpy(slice.mutable_data(), t.data() + e * n, n);
    sd.emplace(expert_param_key(prefix, p, e), std::move(slice));
  }
  sd.erase(it);
}

}  // namespace

std::string expert_param_key(const std::string& prefix, Param p) { return prefix + param_name(p); }

std::string expert_param_key(const std::string& prefix, Param p, int expert) {
  return prefix + param_name(p) + std::to_string(expert);
}

void normalize_expert_keys(StateDict& sd, const std::string& prefix, int num_experts, WeightLayout layout) {
  MOE_CHECK(num_experts > 0, "argument 'num_experts': expected > 0, got ", num_experts);
  for (Param p : kParams) {
    if (layout == WeightLayout::kSingleGrouped)
      stack_experts(sd, prefix, p, num_experts);
    else
      split_experts(sd, prefix, p, num_experts);
  }
}

}  // namespace moe
