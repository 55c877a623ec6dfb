// Layout normalisation of expert keys: single grouped <-> per expert (docs/semantics.md, Weight
// layouts and checkpoints), the quantized weights' companion tensors (moe/checkpoint_quant.h)
// moving with their data.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/key_list.h"
#include "moe/checkpoint_quant.h"
#include "moe/error.h"
#include "moe/state_dict.h"

namespace moe {

namespace {

constexpr Param kParams[] = {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias};

// One family of keys that move together: base + suffix (grouped) and base + e + suffix (per
// expert), e.g. "fc1.weight_scale_inv" and "fc1.weight3_scale_inv".
struct Family {
  std::string base, suffix;
  std::string grouped() const { return base + suffix; }
  std::string expert(int e) const { return base + std::to_string(e) + suffix; }
};

// The experts e < E whose key f.expert(e) is present, ascending: found by walking the keys that start
// with the family's base (a state dict's keys are sorted), never by trying every e -- E may come from
// an untrusted file or command line and be in the billions.
std::vector<int> present_experts(const StateDict& sd, const Family& f, int E) {
  std::vector<int> found;
  for (auto it = sd.lower_bound(f.base); it != sd.end() && it->first.compare(0, f.base.size(), f.base) == 0; ++it) {
    const std::string& k = it->first;
    size_t at = f.base.size();
    int64_t e = 0;
    while (at < k.size() && k[at] >= '0' && k[at] <= '9' && at - f.base.size() < 10) e = 10 * e + (k[at++] - '0');
    const size_t digits = at - f.base.size();
    // Exactly f.expert(e): decimal without leading zeros, then the suffix and nothing else.
    if (digits == 0 || (digits > 1 && k[f.base.size()] == '0') || e >= E) continue;
    if (k.compare(at, std::string::npos, f.suffix) == 0) found.push_back(static_cast<int>(e));
  }
  std::sort(found.begin(), found.end());
  return found;
}

// Whole bytes per expert: packed FP4 with an odd count per expert cannot be stacked or split by bytes.
bool whole_bytes(DType t, int64_t numel) { return (numel * dtype_bits(t)) % 8 == 0; }

// P.S0 .. P.S{E-1} -> P.S [E, ...], when all are present and P.S is not. With apply = false only
// the checks run (so a failing call changes nothing).
void stack_experts(StateDict& sd, const Family& f, int E, bool apply) {
  const std::string key = f.grouped();
  if (sd.count(key)) return;  // the target is present: never overwritten
  const std::vector<int> indices = present_experts(sd, f, E);
  if (indices.empty()) return;
  std::vector<std::string> present;
  for (int e : indices) present.push_back(f.expert(e));
  detail::KeyList missing;
  for (int e = 0, i = 0; e < E && !missing.full(); ++e) {
    if (i < static_cast<int>(indices.size()) && indices[i] == e)
      ++i;
    else
      missing.add(f.expert(e));
  }
  missing.skip(static_cast<size_t>(E) - indices.size() - missing.size());
  MOE_CHECK(missing.empty(), "state dict: cannot stack '", key, "' for ", E, " experts: ", present.size(),
            " per-expert keys are present, missing ", missing.str());
  const HostTensor& first = sd.at(present[0]);
  for (int e = 1; e < E; ++e) {
    const HostTensor& t = sd.at(present[e]);
    MOE_CHECK(t.dtype() == first.dtype() && t.shape() == first.shape(), "state dict: '", present[e], "' is ",
              dtype_name(t.dtype()), " ", t.shape_string(), " but '", present[0], "' is ", dtype_name(first.dtype()),
              " ", first.shape_string(), ": per-expert tensors must match to be stacked");
  }
  MOE_CHECK(whole_bytes(first.dtype(), first.numel()), "state dict: cannot stack '", key, "': '", present[0], "' ",
            first.shape_string(), " of ", dtype_name(first.dtype()), " is not a whole number of bytes");
  if (!apply) return;
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

// P.S [E, ...] or [m E, ...] -> P.S0 .. P.S{E-1}, when no P.S{i} is present. `exact`: only a
// first dimension of E (a quantized tensor: chunks of rows would cut its blocks and scale layouts).
void split_experts(StateDict& sd, const Family& f, int E, bool exact, bool apply) {
  const std::string key = f.grouped();
  auto it = sd.find(key);
  if (it == sd.end()) return;
  if (!present_experts(sd, f, E).empty()) return;  // already (partly) per expert: left alone
  const HostTensor& t = it->second;
  if (exact) {
    MOE_CHECK(t.ndim() >= 1 && t.size(0) == E, "state dict: cannot split '", key, "' ", t.shape_string(), " into ",
              E, " experts: the tensors of a quantized weight must have the number of experts as first dimension");
  } else {
    MOE_CHECK(t.ndim() >= 1 && t.size(0) % E == 0 && t.size(0) > 0, "state dict: cannot split '", key, "' ",
              t.shape_string(), " into ", E, " experts: its first dimension must be ", E, " or a multiple of it");
  }
  const int64_t rows = t.size(0) / E;
  std::vector<int64_t> shape(t.shape().begin() + 1, t.shape().end());
  if (rows > 1) shape.insert(shape.begin(), rows);  // a chunk keeps its rows: [m, ...]
  MOE_CHECK(whole_bytes(t.dtype(), t.numel() / E), "state dict: cannot split '", key, "' ", t.shape_string(), " of ",
            dtype_name(t.dtype()), " into ", E, " experts: a slice is not a whole number of bytes");
  if (!apply) return;
  const int64_t n = t.nbytes() / E;
  for (int e = 0; e < E; ++e) {
    HostTensor slice(t.dtype(), shape);
    if (n > 0) std::memcpy(slice.mutable_data(), t.data() + e * n, n);
    sd.emplace(f.expert(e), std::move(slice));
  }
  sd.erase(key);
}

bool is_weight(Param p) { return p == Param::kFc1Weight || p == Param::kFc2Weight; }

}  // namespace

std::string expert_param_key(const std::string& prefix, Param p) { return prefix + param_name(p); }

std::string expert_param_key(const std::string& prefix, Param p, int expert) {
  return prefix + param_name(p) + std::to_string(expert);
}

void normalize_expert_keys(StateDict& sd, const std::string& prefix, int num_experts, WeightLayout layout) {
  MOE_CHECK(num_experts > 0, "argument 'num_experts': expected > 0, got ", num_experts);
  // Which weights are quantized, decided before anything moves.
  bool quantized[4] = {false, false, false, false};
  for (Param p : kParams)
    // A weight with any companion tensor (grouped or of any expert) is quantized.
    quantized[static_cast<int>(p)] = is_weight(p) && !find_quant_companion(sd, expert_param_key(prefix, p)).empty();
  // Every check first, then the moves: a failing call leaves the dict as it was.
  for (bool apply : {false, true}) {
    for (Param p : kParams) {
      for (QuantPart part : kQuantParts) {
        if (part != QuantPart::kData && !is_weight(p)) continue;  // biases are never quantized
        const Family f{expert_param_key(prefix, p), quant_part_suffix(part)};
        if (layout == WeightLayout::kSingleGrouped)
          stack_experts(sd, f, num_experts, apply);
        else
          split_experts(sd, f, num_experts, quantized[static_cast<int>(p)], apply);
      }
    }
  }
}

}  // namespace moe
