// Checkpoint conversion (include/moe/checkpoint_convert.h).
#include <algorithm>
#include <map>
#include <optional>
#include <set>

#include "checkpoint/dequantize.h"
#include "checkpoint/key_text.h"
#include "moe/checkpoint_convert.h"
#include "moe/checkpoint_hf_fp8.h"
#include "moe/checkpoint_quant.h"
#include "moe/error.h"

namespace moe {

namespace {

constexpr Param kParams[] = {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias};

WeightLayout layout_of(const CheckpointFormat& f) {
  return f.kind == CheckpointFormat::Kind::kPerExpert ? WeightLayout::kPerExpert : WeightLayout::kSingleGrouped;
}

bool selected(const ConvertOptions& o, const std::string& prefix) {
  return o.prefixes.empty() || std::find(o.prefixes.begin(), o.prefixes.end(), prefix) != o.prefixes.end();
}

bool is_weight(Param p) { return p == Param::kFc1Weight || p == Param::kFc2Weight; }

// Our keys of one layer: P.S and P.S{i} for every parameter, and with `companions` the quantized
// weights' P.S{i}_scale_inv, ... too.
std::vector<std::string> our_keys(const StateDict& sd, const std::string& prefix, bool companions = false) {
  std::vector<std::string> keys;
  for (Param p : kParams) {
    const std::string base = expert_param_key(prefix, p);
    for (auto it = sd.lower_bound(base); it != sd.end() && it->first.compare(0, base.size(), base) == 0; ++it) {
      int64_t index;
      if (detail::our_key_rest(it->first.substr(base.size()), companions && is_weight(p), &index))
        keys.push_back(it->first);
    }
  }
  return keys;
}

// The expert index of one of a layer's keys (as our_keys lists them with companions), -1 when grouped.
int64_t expert_index(const std::string& key, const std::string& prefix) {
  for (Param p : kParams) {
    const std::string base = expert_param_key(prefix, p);
    int64_t index;
    if (key.compare(0, base.size(), base) == 0 && detail::our_key_rest(key.substr(base.size()), is_weight(p), &index))
      return index;
  }
  return -1;
}

// The expert layers with a quantized weight, by prefix: parameters "<prefix>fc1.weight" /
// "<prefix>fc2.weight" that the metadata declares and that are stored as experts (a 3-D grouped
// tensor or per-expert keys). Other quantized tensors (a dense layer's) are not experts.
std::map<std::string, std::vector<QuantizedParamDecl>> quantized_expert_layers(const StateDict& sd,
                                                                                const Metadata& metadata) {
  std::map<std::string, std::vector<QuantizedParamDecl>> layers;
  for (const QuantizedParamDecl& d : quantized_params(metadata)) {
    for (Param p : {Param::kFc1Weight, Param::kFc2Weight}) {
      if (!detail::ends_with(d.key, param_name(p))) continue;
      bool experts = false;
      for (QuantPart part : kQuantParts) {
        auto g = sd.find(quant_part_key(d.key, part));
        experts = experts || sd.count(quant_part_key(d.key + "0", part)) || (g != sd.end() && g->second.ndim() == 3);
      }
      if (experts) layers[d.key.substr(0, d.key.size() - std::string(param_name(p)).size())].push_back(d);
    }
  }
  return layers;
}

// One expert's shape of a parameter stored unquantized beside a quantized layer's weights, checked
// like the unquantized layers' tensors: a float dtype, every expert's tensor present with the same
// shape, nothing quantized about it. rank: 2 for a weight, 1 for a bias.
std::vector<int64_t> plain_expert_shape(const StateDict& sd, const std::string& key, int E, WeightLayout layout,
                                        size_t rank, DType* dtype) {
  const std::string companion = find_quant_companion(sd, key);
  MOE_CHECK(companion.empty(), "state dict: '", companion, "' is present, but __metadata__ has no '",
            quant_metadata_key(key), "' recording the format of the quantized '", key, "'");
  std::vector<int64_t> shape;
  for (int e = layout == WeightLayout::kSingleGrouped ? -1 : 0; e < (layout == WeightLayout::kSingleGrouped ? 0 : E);
       ++e) {
    const std::string k = e < 0 ? key : key + std::to_string(e);
    auto it = sd.find(k);
    MOE_CHECK(it != sd.end(), "state dict: missing '", k, "' of the quantized experts' layer");
    const HostTensor& t = it->second;
    MOE_CHECK(t.dtype() == DType::kBF16 || t.dtype() == DType::kFP16 || t.dtype() == DType::kFP32, "state dict: '",
              k, "' has dtype ", dtype_name(t.dtype()), ", expected bf16, fp16 or fp32 (or a quantized format ",
              "declared in __metadata__)");
    std::vector<int64_t> s = t.shape();
    if (e < 0) {
      MOE_CHECK(s.size() == rank + 1 && s[0] == E, "state dict: '", k, "' has shape ", t.shape_string(),
                ", expected ", E, " experts of ", rank, " dimensions");
      s.erase(s.begin());
    }
    MOE_CHECK(s.size() == rank && (shape.empty() || s == shape) && (e <= 0 || t.dtype() == *dtype),
              "state dict: '", k, "' has shape ", t.shape_string(), " / dtype ", dtype_name(t.dtype()),
              ", unlike the other experts' of '", key, "'");
    shape = s;
    *dtype = t.dtype();
  }
  return shape;
}

// The keys of a quantized layer (our_keys with companions), after checking the rest of it: a weight the
// metadata does not declare (dims lacks it) is checked as an unquantized one, both weights and the
// biases must make one expert MLP (fc1 [F or 2F, H], fc2 [H, F], fc1.bias [fc1 rows], fc2.bias [H]),
// and no key may name an expert past E. dims: rows and cols of each declared weight, by key.
std::vector<std::string> checked_layer_keys(const StateDict& sd, const std::string& prefix,
                                            std::map<std::string, std::pair<int64_t, int64_t>> dims, int E,
                                            WeightLayout stored) {
  const std::string w1 = expert_param_key(prefix, Param::kFc1Weight), w2 = expert_param_key(prefix, Param::kFc2Weight);
  DType plain = DType::kFP32;
  for (const std::string& w : {w1, w2})
    if (!dims.count(w)) {
      const std::vector<int64_t> s = plain_expert_shape(sd, w, E, stored, 2, &plain);
      dims[w] = {s[0], s[1]};
    }
  const auto [fc1_rows, H] = dims[w1];
  const auto [fc2_rows, F] = dims[w2];
  MOE_CHECK(fc2_rows == H && (fc1_rows == F || fc1_rows == 2 * F), "state dict: the experts under '", prefix,
            "' do not make one MLP: fc1 [", fc1_rows, ", ", H, "], fc2 [", fc2_rows, ", ", F,
            "] (expected fc1 [F or 2F, H] and fc2 [H, F])");
  for (const auto& [param, want] : {std::pair{Param::kFc1Bias, fc1_rows}, std::pair{Param::kFc2Bias, H}}) {
    const std::string b = expert_param_key(prefix, param);
    const bool present = sd.count(b) || sd.count(b + "0");
    if (!present) continue;
    const std::vector<int64_t> s = plain_expert_shape(sd, b, E, stored, 1, &plain);
    MOE_CHECK(s[0] == want, "state dict: '", b, "' holds ", s[0], " values an expert, expected ", want);
  }
  std::vector<std::string> keys = our_keys(sd, prefix, /*companions=*/true);
  for (const std::string& k : keys)
    MOE_CHECK(expert_index(k, prefix) < E, "state dict: '", k, "' names no expert of the layer's ", E);
  return keys;
}

// A quantized layer changes layout by moving its tensors (data and companions) as they are.
StateDict move_quantized_layer(const StateDict& sd, const std::string& prefix,
                               const std::vector<QuantizedParamDecl>& params, const ConvertOptions& o,
                               std::vector<std::string>* old_keys) {
  std::string formats;
  for (const QuantizedParamDecl& d : params)
    formats += (formats.empty() ? "" : ", ") + d.key.substr(prefix.size()) + " " + quant_format_name(d.config.format);
  int E = o.experts;
  std::optional<WeightLayout> stored;
  std::map<std::string, std::pair<int64_t, int64_t>> dims;  // rows and cols of each weight, by key
  for (const QuantizedParamDecl& d : params) {
    const QuantizedParamInfo info = inspect_quantized_param(sd, d.key, d.config, E);
    E = info.experts;
    MOE_CHECK(!stored || *stored == info.layout, "state dict: the quantized weights under '", prefix,
              "' are stored in different layouts");
    stored = info.layout;
    dims[d.key] = {info.rows, info.cols};
  }
  MOE_CHECK(*stored == layout_of(o.from), "input declared ", o.from.name(), ", but the experts under '", prefix,
            "' are stored ", *stored == WeightLayout::kPerExpert ? "per expert" : "single grouped");
  if (!o.to.ours()) {
    // Hugging Face naming holds FP8 block 128x128 weights (DeepSeek-V3's form), both weights quantized.
    const QuantizedParamDecl* fc1 = nullptr;
    const QuantizedParamDecl* fc2 = nullptr;
    for (const QuantizedParamDecl& d : params)
      (d.key == expert_param_key(prefix, Param::kFc1Weight) ? fc1 : fc2) = &d;
    for (const QuantizedParamDecl& d : params)
      MOE_CHECK(hf_fp8_storable(d.config), "convert: the experts under '", prefix, "' are quantized (", formats,
                "); Hugging Face naming holds FP8 block 128x128 weights with row-major scales only (",
                d.key.substr(prefix.size()), " is ", format_quant_metadata(d.config), ")");
    MOE_CHECK(fc1 && fc2, "convert: the experts under '", prefix, "' have one weight quantized (", formats,
              "); Hugging Face naming stores both FP8 or neither");
    *old_keys = our_keys(sd, prefix, /*companions=*/true);
    StateDict mine;
    for (const std::string& k : *old_keys) mine.emplace(k, sd.at(k));
    return hf_fp8_expert_tensors(mine, prefix, fc1->config, fc2->config, o.to.family, o.from_glu_interleave);
  }
  MOE_CHECK(o.from_glu_interleave == o.to_glu_interleave, "argument 'to_glu_interleave': the experts under '",
            prefix, "' are quantized (", formats, "): moving fc1's rows would cut its quantization blocks (",
            o.from_glu_interleave, " -> ", o.to_glu_interleave, "); requantize from the unquantized weights instead");
  *old_keys = checked_layer_keys(sd, prefix, dims, E, *stored);
  StateDict mine;
  for (const std::string& k : *old_keys) mine.emplace(k, sd.at(k));
  const WeightLayout to = layout_of(o.to);
  normalize_expert_keys(mine, prefix, E, to);
  // Nothing left behind in the old layout (e.g. an unquantized bias stored in both layouts).
  for (const auto& kv : mine)
    MOE_CHECK((expert_index(kv.first, prefix) >= 0) == (to == WeightLayout::kPerExpert), "convert: '", kv.first,
              "' of the experts under '", prefix, "' could not be brought to ", o.to.name(),
              " (it is stored in both layouts)");
  for (const QuantizedParamDecl& d : params) inspect_quantized_param(mine, d.key, d.config, E);
  return mine;
}

// The activation an input in our naming is read with: the target family's when writing Hugging
// Face names (its gating must fit the shapes), otherwise any activation of the right gating --
// a layout change does not depend on which one.
ActivationParams our_activation(const ExpertLayerKeys& l, const ConvertOptions& o) {
  ActivationParams a;
  if (!o.to.ours()) {
    a = hf_activation(o.to.family);
  } else {
    MOE_CHECK(l.fc1_out == 2 * l.ffn || l.fc1_out == l.ffn, "state dict: the experts under '", l.prefix,
              "' have fc1 with ", l.fc1_out, " rows, neither F = ", l.ffn, " nor 2F");
    a.kind = l.fc1_out == 2 * l.ffn ? Activation::kSwiGLU : Activation::kSquaredReLU;
  }
  a.glu_interleave = o.from_glu_interleave;
  return a;
}

struct Layer {
  std::string prefix;
  std::optional<ExpertWeights> weights;  // unquantized layers: loaded, then written in the target form
  StateDict moved;                       // quantized layers: their tensors already in the target layout
  std::vector<std::string> old_keys;
};

void erase_metadata(Metadata& metadata, const std::string& key) {
  metadata.erase(std::remove_if(metadata.begin(), metadata.end(), [&](const auto& kv) { return kv.first == key; }),
                 metadata.end());
}

// A quantized layer of ours (`params` declared under `prefix` in sd), decoded to o.dequantize: an
// unquantized layer from then on, read with our_activation; the input's keys (with companions) are the
// ones it replaces.
Layer dequantized_layer(const StateDict& sd, const std::string& prefix, const std::vector<QuantizedParamDecl>& params,
                        const ConvertOptions& o) {
  int E = o.experts;
  std::map<std::string, std::pair<int64_t, int64_t>> dims;
  std::vector<QuantizedParamInfo> infos;
  for (const QuantizedParamDecl& d : params) {
    infos.push_back(inspect_quantized_param(sd, d.key, d.config, E));
    const QuantizedParamInfo& info = infos.back();
    E = info.experts;
    MOE_CHECK(info.layout == layout_of(o.from), "input declared ", o.from.name(), ", but the experts under '", prefix,
              "' are stored ", info.layout == WeightLayout::kPerExpert ? "per expert" : "single grouped");
    dims[d.key] = {info.rows, info.cols};
  }
  std::vector<std::string> keys = checked_layer_keys(sd, prefix, dims, E, layout_of(o.from));
  const StateDict plain = detail::dequantized_expert_tensors(sd, prefix, infos);
  const std::vector<ExpertLayerKeys> found = find_expert_layers(plain, E);
  MOE_CHECK(found.size() == 1 && found[0].prefix == prefix, "state dict: the quantized experts under '", prefix,
            "' do not make one expert layer");
  const ExpertLayerKeys& l = found[0];
  const ExpertWeightsSpec spec = layer_spec(l, our_activation(l, o), WeightLayout::kSingleGrouped);
  return {prefix, ExpertWeights::from_state_dict(plain, spec, prefix).cast(*o.dequantize), {}, std::move(keys)};
}

}  // namespace

CheckpointFormat CheckpointFormat::parse(const std::string& text, const char* what) {
  CheckpointFormat f;
  if (text == "per-expert") {
    f.kind = Kind::kPerExpert;
  } else if (text == "grouped") {
    f.kind = Kind::kGrouped;
  } else if (text.compare(0, 3, "hf:") == 0) {
    f.kind = Kind::kHuggingFace;
    f.family = hf_family_from_name(text.substr(3), what);
  } else if (text == "hf") {
    f.kind = Kind::kHuggingFace;
    f.family_from_config = true;
  } else {
    std::string families;
    for (const auto& n : hf_family_names()) families += (families.empty() ? "" : "|") + n;
    detail::throw_error("argument '", what, "': expected per-expert, grouped, hf (the model_type of the config.json ",
                        "beside the checkpoint) or hf:{", families, "}, got '", text, "'");
  }
  return f;
}

std::string CheckpointFormat::name() const {
  switch (kind) {
    case Kind::kPerExpert: return "per-expert";
    case Kind::kGrouped: return "grouped";
    case Kind::kHuggingFace: return family_from_config ? "hf" : std::string("hf:") + hf_family_name(family);
  }
  return "?";
}

std::vector<std::string> convert_state_dict(StateDict& sd, const ConvertOptions& o) {
  Metadata none;
  return convert_state_dict(sd, o, none);
}

std::vector<std::string> convert_state_dict(StateDict& sd, const ConvertOptions& o, Metadata& metadata_io) {
  MOE_CHECK(o.experts >= 0, "argument 'experts': expected >= 0, got ", o.experts);
  MOE_CHECK(!o.dequantize || *o.dequantize == DType::kBF16 || *o.dequantize == DType::kFP32,
            "argument 'dequantize': expected bf16 or fp32, got ", dtype_name(*o.dequantize));
  for (const auto& [side, name] : {std::pair{&o.from, "from"}, std::pair{&o.to, "to"}})
    MOE_CHECK(!side->family_from_config, "argument '", name, "': 'hf' takes the family from a config.json, which ",
              "a state dict has none of; give hf:<family> (or resolve it with families_from_config)");
  const Metadata& metadata = metadata_io;
  Metadata metadata_out = metadata_io;  // assigned back once every output is made
  std::vector<Layer> layers;
  if (o.from.ours()) {
    const auto quantized = quantized_expert_layers(sd, metadata);
    // The unquantized layers are found without the quantized layers' tensors.
    StateDict without;
    if (!quantized.empty()) {
      without = sd;
      for (const auto& q : quantized)
        for (const std::string& k : our_keys(sd, q.first, /*companions=*/true)) without.erase(k);
    }
    const StateDict& plain = quantized.empty() ? sd : without;
    for (const ExpertLayerKeys& l : find_expert_layers(plain, o.experts)) {
      if (!selected(o, l.prefix)) continue;
      MOE_CHECK(l.layout == layout_of(o.from), "input declared ", o.from.name(), ", but the experts under '",
                l.prefix, "' are stored ", l.layout == WeightLayout::kPerExpert ? "per expert" : "single grouped");
      for (Param p : {Param::kFc1Weight, Param::kFc2Weight}) {
        const std::string key = expert_param_key(l.prefix, p), companion = find_quant_companion(sd, key);
        MOE_CHECK(companion.empty(), "state dict: '", companion, "' is present, but __metadata__ has no '",
                  quant_metadata_key(key), "' recording the format of the quantized '", key, "'");
      }
      const ExpertWeightsSpec spec = layer_spec(l, our_activation(l, o), l.layout);
      layers.push_back({l.prefix, ExpertWeights::from_state_dict(sd, spec, l.prefix), {}, our_keys(sd, l.prefix)});
    }
    for (const auto& [prefix, params] : quantized) {
      if (!selected(o, prefix)) continue;
      if (o.dequantize) {
        layers.push_back(dequantized_layer(sd, prefix, params, o));
        for (const QuantizedParamDecl& d : params) erase_metadata(metadata_out, quant_metadata_key(d.key));
        continue;
      }
      Layer l{prefix, std::nullopt, {}, {}};
      l.moved = move_quantized_layer(sd, prefix, params, o, &l.old_keys);
      if (!o.to.ours())  // Hugging Face naming declares its FP8 weights by their dtype and companions
        for (const QuantizedParamDecl& d : params) erase_metadata(metadata_out, quant_metadata_key(d.key));
      layers.push_back(std::move(l));
    }
    std::sort(layers.begin(), layers.end(), [](const Layer& a, const Layer& b) { return a.prefix < b.prefix; });
  } else {
    MOE_CHECK(o.from_glu_interleave == 0, "argument 'from_glu_interleave': a Hugging Face input has its own "
              "fc1 layout, got ", o.from_glu_interleave);
    for (const HfExpertLayer& l : find_hf_expert_layers(sd, o.from.family)) {
      if (!selected(o, l.prefix)) continue;
      MOE_CHECK(o.experts == 0 || o.experts == l.experts, "argument 'experts': expected ", o.experts,
                " experts, but the Hugging Face layer '", l.prefix, "' has ", l.experts);
      const int s = o.to.ours() ? o.to_glu_interleave : 0;
      if (l.fp8 && o.dequantize) {
        // Each FP8 weight decoded in the family's own naming, then read as the unquantized layer it is.
        std::vector<std::string> keys = hf_expert_keys(l, o.from.family);
        StateDict decoded;
        for (const std::string& k : keys) decoded.emplace(k, sd.at(k));
        detail::dequantize_fp8_block_tensors(decoded, *o.dequantize, {}, {});
        HfExpertLayer plain = l;
        plain.fp8 = false;
        plain.dtype = *o.dequantize;
        layers.push_back({l.prefix, load_hf_experts(decoded, o.from.family, plain, layout_of(o.to), s), {},
                          std::move(keys)});
        continue;
      }
      if (l.fp8) {
        // FP8 with 128x128 block scales: into our quantized layout (or another family's naming through it).
        Layer q{l.prefix, std::nullopt, {}, hf_expert_keys(l, o.from.family)};
        MOE_CHECK(s % 128 == 0 && (s == 0 || l.ffn % s == 0), "argument 'to_glu_interleave': the experts under '",
                  l.prefix, "' are FP8 with 128x128 block scales, which an interleave of ", s, " would cut (0 or a ",
                  "multiple of 128 dividing F = ", l.ffn, " keeps them)");
        if (o.to.ours()) {
          q.moved = load_hf_fp8_experts(sd, o.from.family, l, layout_of(o.to), s, metadata_out);
        } else {
          Metadata scratch;
          const StateDict ours = load_hf_fp8_experts(sd, o.from.family, l, WeightLayout::kSingleGrouped, 0, scratch);
          q.moved = hf_fp8_expert_tensors(ours, l.prefix, hf_fp8_format(), hf_fp8_format(), o.to.family, 0);
        }
        layers.push_back(std::move(q));
        continue;
      }
      MOE_CHECK(s == 0 || is_gated(hf_activation(o.from.family).kind), "argument 'to_glu_interleave': the ",
                hf_family_name(o.from.family), " experts under '", l.prefix, "' are not gated (fc1 has no gate and ",
                "linear halves to interleave), got ", s);
      ExpertWeights w = load_hf_experts(sd, o.from.family, l, layout_of(o.to), s);
      if (l.mxfp4 && o.dequantize) w = w.cast(*o.dequantize);  // read as bf16, which fp32 holds exactly
      layers.push_back({l.prefix, std::move(w), {}, hf_expert_keys(l, o.from.family)});
    }
  }
  MOE_CHECK(!layers.empty(), "no expert layers in ", o.from.name(), " naming were found",
            o.prefixes.empty() ? "" : " under the given prefixes");
  // Every prefix asked for names a layer (a typo among several would otherwise go unnoticed).
  for (const std::string& prefix : o.prefixes) {
    const bool found = std::any_of(layers.begin(), layers.end(), [&](const auto& l) { return l.prefix == prefix; });
    MOE_CHECK(found, "argument 'prefixes': no expert layer in ", o.from.name(), " naming under '", prefix, "'");
  }
  if (!o.to.ours())
    MOE_CHECK(o.to_glu_interleave == 0, "argument 'to_glu_interleave': a Hugging Face output has its own fc1 "
              "layout, got ", o.to_glu_interleave);

  // Every output is made before the dict is touched: a failed conversion leaves it as it was.
  std::set<std::string> expert_keys;  // every expert layer's input keys, converted or left out
  if (o.dequantize)
    for (const auto& kv : expert_layer_keys(sd, o, metadata)) expert_keys.insert(kv.second.begin(), kv.second.end());
  std::vector<StateDict> outputs;
  std::set<std::string> removed;
  for (const Layer& l : layers) {
    removed.insert(l.old_keys.begin(), l.old_keys.end());
    if (!l.weights) {
      outputs.push_back(l.moved);
    } else if (o.to.ours()) {
      ExpertWeights w = *l.weights;
      if (w.spec().activation.glu_interleave != o.to_glu_interleave) w = w.with_glu_interleave(o.to_glu_interleave);
      if (w.spec().layout != layout_of(o.to)) w = w.with_layout(layout_of(o.to));
      outputs.push_back(w.to_state_dict(l.prefix));
    } else {
      outputs.push_back(hf_expert_tensors(*l.weights, o.to.family, l.prefix));
    }
  }
  for (const StateDict& out : outputs)
    for (const auto& kv : out)
      MOE_CHECK(!sd.count(kv.first) || removed.count(kv.first), "convert: output tensor '", kv.first,
                "' collides with a tensor of the input");
  // The FP8 tensors outside expert layers: checked before any is replaced (a refused dict stays as it
  // was), and the last step that can fail.
  if (o.dequantize) detail::dequantize_fp8_block_tensors(sd, *o.dequantize, expert_keys, metadata);
  for (const std::string& k : removed) sd.erase(k);
  std::vector<std::string> prefixes;
  for (size_t i = 0; i < layers.size(); ++i) {
    for (auto& kv : outputs[i]) sd[kv.first] = std::move(kv.second);
    prefixes.push_back(layers[i].prefix);
  }
  metadata_io = std::move(metadata_out);
  return prefixes;
}

std::map<std::string, std::vector<std::string>> expert_layer_keys(const StateDict& sd, const ConvertOptions& o,
                                                                  const Metadata& metadata) {
  std::map<std::string, std::vector<std::string>> layers;
  if (o.from.ours()) {
    const auto quantized = quantized_expert_layers(sd, metadata);
    StateDict without = sd;  // borrowed tensors: a copy of the dict copies no data
    for (const auto& q : quantized) {
      layers[q.first] = our_keys(sd, q.first, /*companions=*/true);
      for (const std::string& k : layers[q.first]) without.erase(k);
    }
    for (const ExpertLayerKeys& l : find_expert_layers(without, o.experts)) layers[l.prefix] = our_keys(sd, l.prefix);
  } else {
    for (const HfExpertLayer& l : find_hf_expert_layers(sd, o.from.family))
      layers[l.prefix] = hf_expert_keys(l, o.from.family);
  }
  MOE_CHECK(!layers.empty(), "no expert layers in ", o.from.name(), " naming were found");
  return layers;
}

std::vector<std::string> convert_checkpoint(const std::string& in, const std::string& out, const ConvertOptions& o,
                                            const safetensors::ProgressFn& progress) {
  if (is_sharded_checkpoint(in)) return convert_sharded_checkpoint(in, out, o, progress);
  Metadata metadata;
  StateDict sd = load_safetensors(in, &metadata);
  std::vector<std::string> layers = convert_state_dict(sd, families_from_config(o, in), metadata);
  save_safetensors(out, sd, metadata, progress);
  return layers;
}

}  // namespace moe
