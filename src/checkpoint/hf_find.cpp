// Finding the expert layers of a Hugging Face state dict, and the keys each reads (layouts in
// include/moe/checkpoint_hf.h). Every shape comes from an untrusted file: each is checked, by name,
// before any arithmetic on it.
#include <algorithm>
#include <cstdint>
#include <map>
#include <set>

#include "checkpoint/hf_names.h"
#include "checkpoint/hf_tensors.h"
#include "checkpoint/key_list.h"
#include "checkpoint/key_text.h"
#include "moe/checkpoint_hf.h"
#include "moe/error.h"

namespace moe {

namespace {

// "<prefix>experts.<rest>" with "experts." at the start of the key or after a '.': the prefix
// (ending in "experts.") and the rest. The last such "experts." wins.
bool split_experts_key(const std::string& key, std::string* prefix, std::string* rest) {
  static const std::string kExperts = "experts.";
  size_t pos = key.rfind("." + kExperts);
  size_t start;
  if (pos != std::string::npos) {
    start = pos + 1;
  } else if (key.compare(0, kExperts.size(), kExperts) == 0) {
    start = 0;
  } else {
    return false;
  }
  *prefix = key.substr(0, start + kExperts.size());
  *rest = key.substr(start + kExperts.size());
  return true;
}

// The expert count of a tensor whose first dimension is E (an int for the layer).
int experts_of(const std::string& key, const HostTensor& t) {
  MOE_CHECK(t.size(0) <= INT32_MAX, "state dict: '", key, "' ", t.shape_string(), " holds more experts than a ",
            "layer can (2^31 - 1)");
  return static_cast<int>(t.size(0));
}

// GPT-OSS's released form: MXFP4 blocks [E, rows, cols / 32, 16] (two E2M1 codes a byte, low nibble
// first, along cols) and E8M0 scales [E, rows, cols / 32], rows the output features.
void need_mxfp4(const StateDict& sd, const std::string& key, int64_t E, int64_t rows, int64_t cols) {
  need(sd, key + "_blocks", {E, rows, cols / 32, 16}, DType::kUInt8);
  need(sd, key + "_scales", {E, rows, cols / 32}, DType::kUInt8);
}

void find_gpt_oss_mxfp4(const StateDict& sd, const std::string& key, const HostTensor& t, const std::string& prefix,
                        std::vector<HfExpertLayer>& layers) {
  MOE_CHECK(t.ndim() == 4 && t.size(1) % 2 == 0 && t.size(3) == 16 && t.size(2) <= INT32_MAX, "state dict: '", key,
            "' has shape ", t.shape_string(), ", expected [E, 2F, H / 32, 16] (MXFP4 blocks)");
  HfExpertLayer l;
  l.prefix = prefix;
  l.experts = experts_of(key, t);
  l.ffn = t.size(1) / 2;
  l.hidden = t.size(2) * 32;
  l.dtype = DType::kBF16;  // what the codes decode to, exactly, and the biases' dtype
  l.mxfp4 = true;
  need_mxfp4(sd, prefix + "gate_up_proj", l.experts, 2 * l.ffn, l.hidden);
  // F must be a multiple of 32 for down's blocks to hold it (need_mxfp4 takes F / 32 groups).
  MOE_CHECK(l.ffn % 32 == 0, "state dict: '", key, "' ", t.shape_string(), " gives F = ", l.ffn,
            ", which MXFP4 blocks of down_proj along F cannot hold (a multiple of 32)");
  need_mxfp4(sd, prefix + "down_proj", l.experts, l.hidden, l.ffn);
  need(sd, prefix + "gate_up_proj_bias", {l.experts, 2 * l.ffn}, l.dtype);
  need(sd, prefix + "down_proj_bias", {l.experts, l.hidden}, l.dtype);
  layers.push_back(l);
}

// Fused and x @ W expert tensors are read unquantized; FP8 weights with block scales come per expert.
void need_floating(const std::string& key, const HostTensor& t) {
  const DType d = t.dtype();
  MOE_CHECK(d == DType::kBF16 || d == DType::kFP16 || d == DType::kFP32 || d == DType::kFP64, "state dict: '", key,
            "' has dtype ", dtype_name(d), "; experts stored fused are read in bf16, fp16, fp32 or fp64 (FP8 ",
            "experts with block scales are read in the per-expert naming only)");
}

// GPT-OSS's layout (stored_as_gpt_oss: gpt_oss, openai_privacy_filter); the MXFP4 form is GPT-OSS's.
void find_gpt_oss(const StateDict& sd, HfFamily f, std::vector<HfExpertLayer>& layers) {
  for (const auto& [key, t] : sd) {
    std::string prefix, rest;
    if (!split_experts_key(key, &prefix, &rest) || (rest != "gate_up_proj" && rest != "gate_up_proj_blocks")) continue;
    MOE_CHECK(!sd.count(prefix + "gate_up_proj") || !sd.count(prefix + "gate_up_proj_blocks"), "state dict: ",
              "experts under '", prefix, "' are stored both in MXFP4 (gate_up_proj_blocks) and unquantized ",
              "(gate_up_proj)");
    if (rest == "gate_up_proj_blocks") {
      MOE_CHECK(f == HfFamily::kGptOss, "state dict: '", key, "': MXFP4 experts are read for gpt_oss only, not for ",
                hf_family_name(f));
      find_gpt_oss_mxfp4(sd, key, t, prefix, layers);
      continue;
    }
    MOE_CHECK(t.ndim() == 3 && t.size(2) % 2 == 0, "state dict: '", key, "' has shape ", t.shape_string(),
              ", expected [E, H, 2F]");
    need_floating(key, t);
    HfExpertLayer l;
    l.prefix = prefix;
    l.experts = experts_of(key, t);
    l.hidden = t.size(1);
    l.ffn = t.size(2) / 2;
    l.dtype = t.dtype();
    need(sd, prefix + "gate_up_proj_bias", {l.experts, 2 * l.ffn}, l.dtype);
    need(sd, prefix + "down_proj", {l.experts, l.ffn, l.hidden}, l.dtype);
    need(sd, prefix + "down_proj_bias", {l.experts, l.hidden}, l.dtype);
    layers.push_back(l);
  }
}

// "<e>.<proj>" after a layer's "experts.": the expert index (at most six digits, written as the library
// writes it: no leading zero) and the projection's key; false for anything else.
bool split_expert_rest(const std::string& rest, int* e, std::string* proj) {
  const size_t dot = rest.find('.');
  if (dot == std::string::npos || dot == 0 || dot > 6 || rest.find_first_not_of("0123456789") != dot) return false;
  if (dot > 1 && rest[0] == '0') return false;  // "01": not an index the library writes
  *e = std::stoi(rest.substr(0, dot));
  *proj = rest.substr(dot + 1);
  return true;
}

// One layer stored fused under `prefix`: names.gate_up [E, 2F, H] and names.down [E, H, F].
// With `may_transpose`, the x @ W form is read too (gate_up [E, H, 2F], down [E, F, H]; qwen3_vl_moe's
// released files): down's shape tells the two apart, since F != H whenever gate_up is square (H = 2F).
void add_fused_layer(const StateDict& sd, const std::string& prefix, const FusedNames& names, bool may_transpose,
                     std::vector<HfExpertLayer>& layers) {
  const std::string gu_key = prefix + names.gate_up, dn_key = prefix + names.down;
  const HostTensor& gu = sd.at(gu_key);
  auto dn = sd.find(dn_key);
  const bool transposed = may_transpose && gu.ndim() == 3 && gu.size(2) % 2 == 0 && dn != sd.end() &&
                          dn->second.shape() == std::vector<int64_t>{gu.size(0), gu.size(2) / 2, gu.size(1)};
  MOE_CHECK(gu.ndim() == 3 && gu.size(transposed ? 2 : 1) % 2 == 0, "state dict: '", gu_key, "' has shape ",
            gu.shape_string(), ", expected [E, 2F, H]", may_transpose ? " or [E, H, 2F]" : "");
  need_floating(gu_key, gu);
  HfExpertLayer l;
  l.prefix = prefix;
  l.experts = experts_of(gu_key, gu);
  l.ffn = gu.size(transposed ? 2 : 1) / 2;
  l.hidden = gu.size(transposed ? 1 : 2);
  l.dtype = gu.dtype();
  l.fused = true;
  l.transposed = transposed;
  if (!transposed) need(sd, dn_key, {l.experts, l.hidden, l.ffn}, l.dtype);
  layers.push_back(l);
}

// The families stored fused: every "<prefix><gate_up name>" with a prefix that names the experts module
// ("...experts.", granitemoe's "...block_sparse_moe.").
void find_fused(const StateDict& sd, HfFamily f, std::vector<HfExpertLayer>& layers) {
  const FusedNames names = fused_names(f);
  const std::string gate_up = names.gate_up;
  for (const auto& [key, t] : sd) {
    if (key.size() == gate_up.size() || !detail::ends_with(key, gate_up)) continue;
    const std::string prefix = key.substr(0, key.size() - gate_up.size());
    if (names_expert_module(prefix, f)) add_fused_layer(sd, prefix, names, f == HfFamily::kQwen3VlMoe, layers);
  }
}

void find_per_expert(const StateDict& sd, HfFamily f, std::vector<HfExpertLayer>& layers) {
  const ProjNames names = proj_names(f);
  const std::vector<const char*> projs = names.all();  // fc1's first: gate, or up when not gated
  std::string expected;                                // for the error naming a stray tensor
  for (const char* n : projs) expected += std::string(expected.empty() ? "" : ", ") + "<e>." + n + ".weight";
  std::map<std::string, std::map<int, std::set<std::string>>> found;  // prefix -> expert -> projections
  std::set<std::string> fused;
  for (const auto& [key, t] : sd) {
    std::string prefix, rest;
    if (!split_experts_key(key, &prefix, &rest)) continue;
    if (rest == "gate_up_proj" && names.gate) {
      fused.insert(prefix);
      continue;
    }
    int e;
    std::string proj;
    if (!split_expert_rest(rest, &e, &proj)) continue;
    for (const char* n : projs)
      if (proj == std::string(n) + ".weight") found[prefix][e].insert(n);
  }
  for (const auto& [prefix, experts] : found) {
    MOE_CHECK(!fused.count(prefix), "state dict: experts under '", prefix,
              "' are stored both per expert and fused (gate_up_proj)");
    const int E = experts.rbegin()->first + 1;
    detail::KeyList missing;
    for (int e = 0; e < E; ++e) {
      auto it = experts.find(e);
      for (const char* n : projs)
        if (it == experts.end() || !it->second.count(n)) {
          if (missing.full())
            missing.skip();
          else
            missing.add(per_expert_key(prefix, e, n));
        }
    }
    MOE_CHECK(missing.empty(), "state dict: the experts under '", prefix, "' are incomplete (", E,
              " experts): missing ", missing.str());
    // FP8 weights (DeepSeek-V3's released form) come with their 128x128 block scales.
    const HostTensor& first = sd.at(per_expert_key(prefix, 0, projs[0]));
    const bool fp8 = first.dtype() == DType::kFP8E4M3;
    // Any other key under the layer that starts with an expert index is none of the experts' tensors
    // (another projection, a bias, a quantization scale other than an FP8 layer's, an index past the
    // layer or written with a leading zero): refused by name, not left behind under its Hugging Face
    // name.
    for (auto it = sd.lower_bound(prefix); it != sd.end() && it->first.compare(0, prefix.size(), prefix) == 0;
         ++it) {
      const std::string rest = it->first.substr(prefix.size());
      if (rest.empty() || rest[0] < '0' || rest[0] > '9') continue;
      int e;
      std::string proj;
      bool expert_tensor = false;
      if (split_expert_rest(rest, &e, &proj) && e < E)
        for (const char* n : projs)
          expert_tensor = expert_tensor || proj == std::string(n) + ".weight" ||
                          (fp8 && proj == std::string(n) + ".weight" + kFp8ScaleSuffix);
      MOE_CHECK(expert_tensor, "state dict: '", it->first, "' lies under the ", hf_family_name(f), " experts '",
                prefix, "' but is none of their tensors (", expected, fp8 ? " and their weight_scale_inv" : "",
                " for e in 0..", E - 1, ")");
    }
    MOE_CHECK(first.ndim() == 2, "state dict: '", per_expert_key(prefix, 0, projs[0]), "' has shape ",
              first.shape_string(), ", expected [F, H]");
    HfExpertLayer l;
    l.prefix = prefix;
    l.experts = E;
    l.ffn = first.size(0);
    l.hidden = first.size(1);
    l.dtype = first.dtype();
    l.fp8 = fp8;
    for (int e = 0; e < E; ++e)
      for (const char* n : projs) {
        const bool down = n == names.down;
        const int64_t rows = down ? l.hidden : l.ffn, cols = down ? l.ffn : l.hidden;
        need(sd, per_expert_key(prefix, e, n), {rows, cols}, l.dtype);
        if (fp8) need_fp8_scale(sd, per_expert_key(prefix, e, n), rows, cols);
      }
    layers.push_back(l);
  }
  for (const std::string& prefix : fused) add_fused_layer(sd, prefix, fused_names(f), false, layers);
}

}  // namespace

std::vector<HfExpertLayer> find_hf_expert_layers(const StateDict& sd, HfFamily f) {
  std::vector<HfExpertLayer> layers;
  if (stored_as_gpt_oss(f))
    find_gpt_oss(sd, f, layers);
  else if (stored_fused(f))
    find_fused(sd, f, layers);
  else
    find_per_expert(sd, f, layers);
  for (const HfExpertLayer& l : layers)
    MOE_CHECK(l.experts > 0 && l.hidden > 0 && l.ffn > 0, "state dict: the experts under '", l.prefix,
              "' have an empty dimension (E=", l.experts, ", H=", l.hidden, ", F=", l.ffn, ")");
  std::sort(layers.begin(), layers.end(), [](const auto& a, const auto& b) { return a.prefix < b.prefix; });
  return layers;
}

std::vector<std::string> hf_expert_keys(const HfExpertLayer& l, HfFamily f) {
  const std::string& p = l.prefix;
  if (f == HfFamily::kGptOss && l.mxfp4)
    return {p + "gate_up_proj_blocks", p + "gate_up_proj_scales", p + "gate_up_proj_bias",
            p + "down_proj_blocks",    p + "down_proj_scales",    p + "down_proj_bias"};
  if (stored_as_gpt_oss(f))
    return {p + "gate_up_proj", p + "gate_up_proj_bias", p + "down_proj", p + "down_proj_bias"};
  if (l.fused) return {p + fused_names(f).gate_up, p + fused_names(f).down};
  const ProjNames n = proj_names(f);
  std::vector<std::string> keys;
  for (int e = 0; e < l.experts; ++e)
    for (const char* proj : n.all()) {
      keys.push_back(per_expert_key(p, e, proj));
      if (l.fp8) keys.push_back(per_expert_key(p, e, proj) + kFp8ScaleSuffix);
    }
  return keys;
}

}  // namespace moe
