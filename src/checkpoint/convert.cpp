// Checkpoint conversion (include/moe/checkpoint_convert.h).
#include <algorithm>
#include <set>

#include "moe/checkpoint_convert.h"
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

// Our keys of one layer: P.S and P.S{i} for every parameter.
std::vector<std::string> our_keys(const StateDict& sd, const std::string& prefix) {
  std::vector<std::string> keys;
  for (Param p : kParams) {
    const std::string base = expert_param_key(prefix, p);
    for (auto it = sd.lower_bound(base); it != sd.end() && it->first.compare(0, base.size(), base) == 0; ++it) {
      const std::string rest = it->first.substr(base.size());
      if (rest.find_first_not_of("0123456789") == std::string::npos) keys.push_back(it->first);
    }
  }
  return keys;
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
  ExpertWeights weights;
  std::vector<std::string> old_keys;
};

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
  } else {
    std::string families;
    for (const auto& n : hf_family_names()) families += (families.empty() ? "" : "|") + n;
    detail::throw_error("argument '", what, "': expected per-expert, grouped or hf:{", families, "}, got '", text,
                        "'");
  }
  return f;
}

std::string CheckpointFormat::name() const {
  switch (kind) {
    case Kind::kPerExpert: return "per-expert";
    case Kind::kGrouped: return "grouped";
    case Kind::kHuggingFace: return std::string("hf:") + hf_family_name(family);
  }
  return "?";
}

std::vector<std::string> convert_state_dict(StateDict& sd, const ConvertOptions& o) {
  MOE_CHECK(o.experts >= 0, "argument 'experts': expected >= 0, got ", o.experts);
  std::vector<Layer> layers;
  if (o.from.ours()) {
    for (const ExpertLayerKeys& l : find_expert_layers(sd, o.experts)) {
      if (!selected(o, l.prefix)) continue;
      MOE_CHECK(l.layout == layout_of(o.from), "input declared ", o.from.name(), ", but the experts under '",
                l.prefix, "' are stored ", l.layout == WeightLayout::kPerExpert ? "per expert" : "single grouped");
      const ExpertWeightsSpec spec = layer_spec(l, our_activation(l, o), l.layout);
      layers.push_back({l.prefix, ExpertWeights::from_state_dict(sd, spec, l.prefix), our_keys(sd, l.prefix)});
    }
  } else {
    MOE_CHECK(o.from_glu_interleave == 0, "argument 'from_glu_interleave': a Hugging Face input has its own "
              "fc1 layout, got ", o.from_glu_interleave);
    for (const HfExpertLayer& l : find_hf_expert_layers(sd, o.from.family)) {
      if (!selected(o, l.prefix)) continue;
      const int s = o.to.ours() ? o.to_glu_interleave : 0;
      layers.push_back({l.prefix, load_hf_experts(sd, o.from.family, l, layout_of(o.to), s),
                        hf_expert_keys(l, o.from.family)});
    }
  }
  MOE_CHECK(!layers.empty(), "no expert layers in ", o.from.name(), " naming were found",
            o.prefixes.empty() ? "" : " under the given prefixes");
  if (!o.to.ours())
    MOE_CHECK(o.to_glu_interleave == 0, "argument 'to_glu_interleave': a Hugging Face output has its own fc1 "
              "layout, got ", o.to_glu_interleave);

  // Every output is made before the dict is touched: a failed conversion leaves it as it was.
  std::vector<StateDict> outputs;
  std::set<std::string> removed;
  for (const Layer& l : layers) {
    removed.insert(l.old_keys.begin(), l.old_keys.end());
    if (o.to.ours()) {
      ExpertWeights w = l.weights;
      if (w.spec().activation.glu_interleave != o.to_glu_interleave) w = w.with_glu_interleave(o.to_glu_interleave);
      if (w.spec().layout != layout_of(o.to)) w = w.with_layout(layout_of(o.to));
      outputs.push_back(w.to_state_dict(l.prefix));
    } else {
      outputs.push_back(hf_expert_tensors(l.weights, o.to.family, l.prefix));
    }
  }
  for (const StateDict& out : outputs)
    for (const auto& kv : out)
      MOE_CHECK(!sd.count(kv.first) || removed.count(kv.first), "convert: output tensor '", kv.first,
                "' collides with a tensor of the input");
  for (const std::string& k : removed) sd.erase(k);
  std::vector<std::string> prefixes;
  for (size_t i = 0; i < layers.size(); ++i) {
    for (auto& kv : outputs[i]) sd[kv.first] = std::move(kv.second);
    prefixes.push_back(layers[i].prefix);
  }
  return prefixes;
}

std::vector<std::string> convert_checkpoint(const std::string& in, const std::string& out, const ConvertOptions& o,
                                            const safetensors::ProgressFn& progress) {
  Metadata metadata;
  StateDict sd = load_safetensors(in, &metadata);
  std::vector<std::string> layers = convert_state_dict(sd, o);
  save_safetensors(out, sd, metadata, progress);
  return layers;
}

}  // namespace moe
