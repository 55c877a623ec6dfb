// Hugging Face expert tensors <-> ExpertWeights (layouts in include/moe/checkpoint_hf.h).
// Pure data movement: every element is copied as bytes, so values and dtype never change.
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <map>
#include <set>
#include <utility>

#include "checkpoint/hf_names.h"
#include "checkpoint/hf_tensors.h"
#include "checkpoint/key_list.h"
#include "moe/checkpoint_hf.h"
#include "moe/error.h"
#include "moe/float_convert.h"

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

// ---------------------------------------------------------------------------------------------
// Finding layers

// E2M1 codes: sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

// MXFP4 blocks [E, rows, G, 16] with E8M0 scales [E, rows, G] decoded as transformers' gpt_oss loading
// does (torch.ldexp(code, scale - 127) in bf16, then transposed): bf16 [E, G * 32, rows]. Every value
// is exact in bf16 (two significant bits, exponents within its range) or beyond its largest and inf;
// scale 255 (NaN in the MX format) is read as torch reads it, 2^128.
HostTensor mxfp4_to_bf16(const HostTensor& blocks, const HostTensor& scales) {
  const int64_t E = blocks.size(0), rows = blocks.size(1), G = blocks.size(2), cols = G * 32;
  HostTensor out(DType::kBF16, {E, cols, rows});
  auto* o = reinterpret_cast<uint16_t*>(out.mutable_data());
  const uint8_t* b = blocks.data();
  const uint8_t* sc = scales.data();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int exponent = sc[(e * rows + r) * G + g] - 127;
        const uint8_t* byte = b + ((e * rows + r) * G + g) * 16;
        for (int i = 0; i < 32; ++i) {
          const int code = i % 2 == 0 ? byte[i / 2] & 0x0F : byte[i / 2] >> 4;
          // Exact in double; to float, exact or (from 2^128 on) inf; to bf16, exact.
          const auto v = static_cast<float>(std::ldexp(static_cast<double>(kE2M1[code]), exponent));
          o[(e * cols + g * 32 + i) * rows + r] = float_to_bf16_bits(v);
        }
      }
  return out;
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
  MOE_CHECK(t.size(0) <= INT32_MAX, "state dict: '", key, "' ", t.shape_string(), " holds more experts than a ",
            "layer can (2^31 - 1)");
  HfExpertLayer l;
  l.prefix = prefix;
  l.experts = static_cast<int>(t.size(0));
  l.ffn = t.size(1) / 2;
  l.hidden = t.size(2) * 32;
  l.dtype = DType::kBF16;  // what the codes decode to, exactly, and the biases' dtype
  l.mxfp4 = true;
  need_mxfp4(sd, prefix + "gate_up_proj", l.experts, 2 * l.ffn, l.hidden);
  MOE_CHECK(sd.count(prefix + "down_proj_blocks"), "state dict: missing '", prefix, "down_proj_blocks'");
  MOE_CHECK(sd.at(prefix + "down_proj_blocks").ndim() == 4 && sd.at(prefix + "down_proj_blocks").size(2) <= INT32_MAX &&
                sd.at(prefix + "down_proj_blocks").size(2) * 32 == l.ffn,
            "state dict: '", prefix, "down_proj_blocks' has shape ", sd.at(prefix + "down_proj_blocks").shape_string(),
            ", expected [E, H, F / 32, 16] with F = ", l.ffn, " (a multiple of 32)");
  need_mxfp4(sd, prefix + "down_proj", l.experts, l.hidden, l.ffn);
  need(sd, prefix + "gate_up_proj_bias", {l.experts, 2 * l.ffn}, l.dtype);
  need(sd, prefix + "down_proj_bias", {l.experts, l.hidden}, l.dtype);
  layers.push_back(l);
}

void find_gpt_oss(const StateDict& sd, std::vector<HfExpertLayer>& layers) {
  for (const auto& [key, t] : sd) {
    std::string prefix, rest;
    if (!split_experts_key(key, &prefix, &rest)) continue;
    if (rest == "gate_up_proj_blocks") {
      MOE_CHECK(!sd.count(prefix + "gate_up_proj"), "state dict: experts under '", prefix,
                "' are stored both in MXFP4 (gate_up_proj_blocks) and unquantized (gate_up_proj)");
      find_gpt_oss_mxfp4(sd, key, t, prefix, layers);
      continue;
    }
    if (rest != "gate_up_proj") continue;
    MOE_CHECK(!sd.count(prefix + "gate_up_proj_blocks"), "state dict: experts under '", prefix,
              "' are stored both in MXFP4 (gate_up_proj_blocks) and unquantized (gate_up_proj)");
    MOE_CHECK(t.ndim() == 3 && t.size(2) % 2 == 0, "state dict: '", key, "' has shape ", t.shape_string(),
              ", expected [E, H, 2F]");
    MOE_CHECK(t.size(0) <= INT32_MAX, "state dict: '", key, "' ", t.shape_string(), " holds more experts than a ",
              "layer can (2^31 - 1)");
    HfExpertLayer l;
    l.prefix = prefix;
    l.experts = static_cast<int>(t.size(0));
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
  MOE_CHECK(gu.ndim() == 3, "state dict: '", gu_key, "' has shape ", gu.shape_string(), ", expected [E, 2F, H]",
            may_transpose ? " or [E, H, 2F]" : "");
  MOE_CHECK(gu.size(0) <= INT32_MAX, "state dict: '", gu_key, "' ", gu.shape_string(), " holds ",
            "more experts than a layer can (2^31 - 1)");
  auto dn = sd.find(dn_key);
  const bool transposed = may_transpose && gu.ndim() == 3 && gu.size(2) % 2 == 0 && dn != sd.end() &&
                          dn->second.shape() == std::vector<int64_t>{gu.size(0), gu.size(2) / 2, gu.size(1)};
  MOE_CHECK(gu.ndim() == 3 && gu.size(transposed ? 2 : 1) % 2 == 0, "state dict: '", gu_key, "' has shape ",
            gu.shape_string(), ", expected [E, 2F, H]", may_transpose ? " or [E, H, 2F]" : "");
  HfExpertLayer l;
  l.prefix = prefix;
  l.experts = static_cast<int>(gu.size(0));
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
    if (key.size() <= gate_up.size() || key.compare(key.size() - gate_up.size(), gate_up.size(), gate_up) != 0)
      continue;
    const std::string prefix = key.substr(0, key.size() - gate_up.size());
    if (names_expert_module(prefix, f)) add_fused_layer(sd, prefix, names, f == HfFamily::kQwen3VlMoe, layers);
  }
}

void find_per_expert(const StateDict& sd, HfFamily f, std::vector<HfExpertLayer>& layers) {
  const ProjNames names = proj_names(f);
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
    for (const char* n : names.all()) {
      if (proj == std::string(n) + ".weight") found[prefix][e].insert(n);
    }
  }
  for (const auto& [prefix, experts] : found) {
    MOE_CHECK(!fused.count(prefix), "state dict: experts under '", prefix,
              "' are stored both per expert and fused (gate_up_proj)");
    const int E = experts.rbegin()->first + 1;
    detail::KeyList missing;
    for (int e = 0; e < E; ++e) {
      auto it = experts.find(e);
      for (const char* n : names.all())
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
    const char* first = names.all()[0];  // fc1's first projection: gate, or up when not gated
    const bool fp8 = sd.at(per_expert_key(prefix, 0, first)).dtype() == DType::kFP8E4M3;
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
        for (const char* n : names.all())
          expert_tensor = expert_tensor || proj == std::string(n) + ".weight" ||
                          (fp8 && proj == std::string(n) + ".weight" + kFp8ScaleSuffix);
      std::string expected;
      for (const char* n : names.all()) expected += std::string(expected.empty() ? "" : ", ") + "<e>." + n + ".weight";
      MOE_CHECK(expert_tensor, "state dict: '", it->first, "' lies under the ", hf_family_name(f), " experts '",
                prefix, "' but is none of their tensors (", expected, fp8 ? " and their weight_scale_inv" : "",
                " for e in 0..", E - 1, ")");
    }
    const HostTensor& gate0 = sd.at(per_expert_key(prefix, 0, first));
    MOE_CHECK(gate0.ndim() == 2, "state dict: '", per_expert_key(prefix, 0, first), "' has shape ",
              gate0.shape_string(), ", expected [F, H]");
    HfExpertLayer l;
    l.prefix = prefix;
    l.experts = E;
    l.ffn = gate0.size(0);
    l.hidden = gate0.size(1);
    l.dtype = gate0.dtype();
    l.fp8 = fp8;
    for (int e = 0; e < E; ++e)
      for (const char* n : names.all()) {
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
  if (f == HfFamily::kGptOss)
    find_gpt_oss(sd, layers);
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
  if (f == HfFamily::kGptOss)
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

// ---------------------------------------------------------------------------------------------
// The x @ W form (GPT-OSS, qwen3_vl_moe's released files): gate_up [E, H, 2F], down [E, F, H]. Gate j
// and up j are columns 2j and 2j + 1 (GPT-OSS, interleaved) or j and F + j (halves).

namespace {

struct XwColumns {
  int64_t F;
  bool interleaved;
  int64_t gate(int64_t j) const { return interleaved ? 2 * j : j; }
  int64_t up(int64_t j) const { return interleaved ? 2 * j + 1 : F + j; }
};

// Our fc1 / fc2 of every expert from gate_up / down in the x @ W form.
void from_x_at_w(ExpertWeights& w, const uint8_t* gu, const uint8_t* dn, const XwColumns& c, int s, size_t el) {
  const ExpertWeightsSpec& spec = w.spec();
  const int64_t H = spec.hidden, F = spec.ffn;
  for (int e = 0; e < spec.experts; ++e) {
    uint8_t* fc1 = w.mutable_expert_data(Param::kFc1Weight, e);
    uint8_t* fc2 = w.mutable_expert_data(Param::kFc2Weight, e);
    const uint8_t* gu_e = gu + e * H * 2 * F * el;
    const uint8_t* dn_e = dn + e * F * H * el;
    for (int64_t j = 0; j < F; ++j) {
      const int64_t g = gate_column(j, F, s), u = linear_column(j, F, s);
      for (int64_t h = 0; h < H; ++h) {  // our fc1 row = one column of x @ W
        std::memcpy(fc1 + (g * H + h) * el, gu_e + (h * 2 * F + c.gate(j)) * el, el);
        std::memcpy(fc1 + (u * H + h) * el, gu_e + (h * 2 * F + c.up(j)) * el, el);
      }
    }
    // fc2 [H, F] is the transpose of down [F, H].
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < F; ++j) std::memcpy(fc2 + (h * F + j) * el, dn_e + (j * H + h) * el, el);
  }
}

// The reverse: gate_up [E, H, 2F] and down [E, F, H] of dtype dt from our fc1 / fc2.
std::pair<HostTensor, HostTensor> to_x_at_w(const ExpertWeights& w, const XwColumns& c, DType dt, size_t el) {
  const ExpertWeightsSpec& spec = w.spec();
  const int64_t E = spec.experts, H = spec.hidden, F = spec.ffn;
  const int s = spec.activation.glu_interleave;
  HostTensor gu(dt, {E, H, 2 * F}), dn(dt, {E, F, H});
  for (int e = 0; e < E; ++e) {
    const uint8_t* fc1 = w.expert_data(Param::kFc1Weight, e);
    const uint8_t* fc2 = w.expert_data(Param::kFc2Weight, e);
    uint8_t* gu_e = gu.mutable_data() + e * H * 2 * F * el;
    uint8_t* dn_e = dn.mutable_data() + e * F * H * el;
    for (int64_t j = 0; j < F; ++j) {
      const int64_t g = gate_column(j, F, s), u = linear_column(j, F, s);
      for (int64_t h = 0; h < H; ++h) {
        std::memcpy(gu_e + (h * 2 * F + c.gate(j)) * el, fc1 + (g * H + h) * el, el);
        std::memcpy(gu_e + (h * 2 * F + c.up(j)) * el, fc1 + (u * H + h) * el, el);
      }
    }
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < F; ++j) std::memcpy(dn_e + (j * H + h) * el, fc2 + (h * F + j) * el, el);
  }
  return {std::move(gu), std::move(dn)};
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// HF -> ours

ExpertWeights load_hf_experts(const StateDict& sd, HfFamily f, const HfExpertLayer& l, WeightLayout layout,
                              int glu_interleave) {
  MOE_CHECK(!l.fp8, "state dict: the experts under '", l.prefix, "' are FP8 with block scales: load_hf_fp8_experts ",
            "reads them");
  MOE_CHECK(glu_interleave == 0 || is_gated(hf_activation(f).kind), "argument 'glu_interleave': the ",
            hf_family_name(f), " experts are not gated (fc1 has no gate and linear halves to interleave), got ",
            glu_interleave);
  ExpertWeightsSpec spec;
  spec.hidden = l.hidden;
  spec.ffn = l.ffn;
  spec.experts = l.experts;
  spec.activation = hf_activation(f);
  spec.activation.glu_interleave = glu_interleave;
  spec.bias = hf_has_bias(f);
  spec.layout = layout;
  ExpertWeights w(spec, l.dtype);
  const int64_t H = l.hidden, F = l.ffn, E = l.experts;
  const int s = glu_interleave;
  const size_t el = static_cast<size_t>(dtype_bytes(l.dtype, 1));
  const size_t row = H * el;  // one fc1 row

  if (f == HfFamily::kGptOss) {
    // MXFP4 decodes (exactly) into the bf16 tensors transformers makes of it: gate_up [E, H, 2F], down [E, F, H].
    HostTensor gu_decoded, dn_decoded;
    if (l.mxfp4) {
      gu_decoded = mxfp4_to_bf16(sd.at(l.prefix + "gate_up_proj_blocks"), sd.at(l.prefix + "gate_up_proj_scales"));
      dn_decoded = mxfp4_to_bf16(sd.at(l.prefix + "down_proj_blocks"), sd.at(l.prefix + "down_proj_scales"));
    }
    const uint8_t* gu = l.mxfp4 ? gu_decoded.data() : need(sd, l.prefix + "gate_up_proj", {E, H, 2 * F}, l.dtype).data();
    const uint8_t* gub = need(sd, l.prefix + "gate_up_proj_bias", {E, 2 * F}, l.dtype).data();
    const uint8_t* dn = l.mxfp4 ? dn_decoded.data() : need(sd, l.prefix + "down_proj", {E, F, H}, l.dtype).data();
    const uint8_t* dnb = need(sd, l.prefix + "down_proj_bias", {E, H}, l.dtype).data();
    from_x_at_w(w, gu, dn, XwColumns{F, true}, s, el);
    for (int e = 0; e < E; ++e) {  // the biases follow the columns
      uint8_t* b1 = w.mutable_expert_data(Param::kFc1Bias, e);
      for (int64_t j = 0; j < F; ++j) {
        std::memcpy(b1 + gate_column(j, F, s) * el, gub + (e * 2 * F + 2 * j) * el, el);
        std::memcpy(b1 + linear_column(j, F, s) * el, gub + (e * 2 * F + 2 * j + 1) * el, el);
      }
      std::memcpy(w.mutable_expert_data(Param::kFc2Bias, e), dnb + e * H * el, H * el);
    }
    return w;
  }

  const ProjNames n = proj_names(f);
  const FusedNames fn = fused_names(f);
  if (l.transposed) {  // x @ W: gate = columns [0, F), up = [F, 2F) of gate_up [E, H, 2F]; down [E, F, H]
    from_x_at_w(w, need(sd, l.prefix + fn.gate_up, {E, H, 2 * F}, l.dtype).data(),
                need(sd, l.prefix + fn.down, {E, F, H}, l.dtype).data(), XwColumns{F, false}, s, el);
    return w;
  }
  const uint8_t* fused_gu = l.fused ? need(sd, l.prefix + fn.gate_up, {E, 2 * F, H}, l.dtype).data() : nullptr;
  const uint8_t* fused_dn = l.fused ? need(sd, l.prefix + fn.down, {E, H, F}, l.dtype).data() : nullptr;
  for (int e = 0; e < E; ++e) {
    const uint8_t *gate, *up, *down;
    if (l.fused) {  // [gate ; up] rows, as chunk(2, dim=-1) of the product splits them
      gate = fused_gu + e * 2 * F * row;
      up = gate + F * row;
      down = fused_dn + e * H * F * el;
    } else {
      gate = n.gate ? need(sd, per_expert_key(l.prefix, e, n.gate), {F, H}, l.dtype).data() : nullptr;
      up = need(sd, per_expert_key(l.prefix, e, n.up), {F, H}, l.dtype).data();
      down = need(sd, per_expert_key(l.prefix, e, n.down), {H, F}, l.dtype).data();
    }
    uint8_t* fc1 = w.mutable_expert_data(Param::kFc1Weight, e);
    std::memcpy(w.mutable_expert_data(Param::kFc2Weight, e), down, H * F * el);
    if (!gate) {  // not gated: fc1 is the up projection
      std::memcpy(fc1, up, F * row);
      continue;
    }
    for (int64_t j = 0; j < F; ++j) {
      std::memcpy(fc1 + gate_column(j, F, s) * row, gate + j * row, row);
      std::memcpy(fc1 + linear_column(j, F, s) * row, up + j * row, row);
    }
  }
  return w;
}

// ---------------------------------------------------------------------------------------------
// ours -> HF

StateDict hf_expert_tensors(const ExpertWeights& w, HfFamily f, const std::string& prefix) {
  // Hugging Face keys an expert module's tensors under "...experts." (granitemoe: "...block_sparse_moe."):
  // under any other prefix the names written would be no family's, and no reader would find the layer.
  MOE_CHECK(names_expert_module(prefix, f), "Hugging Face ", hf_family_name(f), ": the experts' prefix must end in '",
            expert_module(f), "' (the module's name), got '", prefix, "'");
  const ExpertWeightsSpec& spec = w.spec();
  const ActivationParams act = hf_activation(f);
  MOE_CHECK(spec.activation.kind == act.kind, "Hugging Face ", hf_family_name(f), ": its experts use ",
            activation_name(act.kind), ", these weights are for ", activation_name(spec.activation.kind));
  MOE_CHECK(spec.bias == hf_has_bias(f), "Hugging Face ", hf_family_name(f), ": its experts ",
            hf_has_bias(f) ? "have" : "have no", " biases, these weights ", spec.bias ? "have" : "have none");
  const int64_t H = spec.hidden, F = spec.ffn, E = spec.experts;
  const int s = spec.activation.glu_interleave;
  const DType dt = w.dtype();
  const size_t el = static_cast<size_t>(dtype_bytes(dt, 1));
  const size_t row = H * el;
  StateDict sd;

  if (f == HfFamily::kGptOss) {
    auto [gu, dn] = to_x_at_w(w, XwColumns{F, true}, dt, el);
    HostTensor gub(dt, {E, 2 * F}), dnb(dt, {E, H});
    for (int e = 0; e < E; ++e) {  // the biases follow the columns
      const uint8_t* b1 = w.expert_data(Param::kFc1Bias, e);
      for (int64_t j = 0; j < F; ++j) {
        std::memcpy(gub.mutable_data() + (e * 2 * F + 2 * j) * el, b1 + gate_column(j, F, s) * el, el);
        std::memcpy(gub.mutable_data() + (e * 2 * F + 2 * j + 1) * el, b1 + linear_column(j, F, s) * el, el);
      }
      std::memcpy(dnb.mutable_data() + e * H * el, w.expert_data(Param::kFc2Bias, e), H * el);
    }
    sd.emplace(prefix + "gate_up_proj", std::move(gu));
    sd.emplace(prefix + "gate_up_proj_bias", std::move(gub));
    sd.emplace(prefix + "down_proj", std::move(dn));
    sd.emplace(prefix + "down_proj_bias", std::move(dnb));
    return sd;
  }

  if (f == HfFamily::kQwen3VlMoe) {  // the released form: x @ W, gate_up [E, H, 2F] (halves), down [E, F, H]
    auto [gu, dn] = to_x_at_w(w, XwColumns{F, false}, dt, el);
    sd.emplace(prefix + "gate_up_proj", std::move(gu));
    sd.emplace(prefix + "down_proj", std::move(dn));
    return sd;
  }
  if (stored_fused(f)) {  // [gate ; up] rows of every expert, and every expert's fc2
    const FusedNames fn = fused_names(f);
    HostTensor gu(dt, {E, 2 * F, H}), dn(dt, {E, H, F});
    for (int e = 0; e < E; ++e) {
      const uint8_t* fc1 = w.expert_data(Param::kFc1Weight, e);
      uint8_t* gu_e = gu.mutable_data() + e * 2 * F * row;
      for (int64_t j = 0; j < F; ++j) {
        std::memcpy(gu_e + j * row, fc1 + gate_column(j, F, s) * row, row);
        std::memcpy(gu_e + (F + j) * row, fc1 + linear_column(j, F, s) * row, row);
      }
      std::memcpy(dn.mutable_data() + e * H * F * el, w.expert_data(Param::kFc2Weight, e), H * F * el);
    }
    sd.emplace(prefix + fn.gate_up, std::move(gu));
    sd.emplace(prefix + fn.down, std::move(dn));
    return sd;
  }

  const ProjNames n = proj_names(f);
  for (int e = 0; e < E; ++e) {
    HostTensor up(dt, {F, H}), down(dt, {H, F});
    const uint8_t* fc1 = w.expert_data(Param::kFc1Weight, e);
    std::memcpy(down.mutable_data(), w.expert_data(Param::kFc2Weight, e), H * F * el);
    sd.emplace(per_expert_key(prefix, e, n.down), std::move(down));
    if (!n.gate) {  // not gated: fc1 is the up projection
      std::memcpy(up.mutable_data(), fc1, F * row);
      sd.emplace(per_expert_key(prefix, e, n.up), std::move(up));
      continue;
    }
    HostTensor gate(dt, {F, H});
    uint8_t *pg = gate.mutable_data(), *pu = up.mutable_data();
    for (int64_t j = 0; j < F; ++j) {
      std::memcpy(pg + j * row, fc1 + gate_column(j, F, s) * row, row);
      std::memcpy(pu + j * row, fc1 + linear_column(j, F, s) * row, row);
    }
    sd.emplace(per_expert_key(prefix, e, n.gate), std::move(gate));
    sd.emplace(per_expert_key(prefix, e, n.up), std::move(up));
  }
  return sd;
}

}  // namespace moe
