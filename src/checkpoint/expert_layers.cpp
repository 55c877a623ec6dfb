// Finding expert layers stored with our key names (include/moe/checkpoint.h).
#include <cstdint>
#include <algorithm>

#include "checkpoint/key_text.h"
#include "moe/checkpoint.h"
#include "moe/error.h"

namespace moe {

namespace {

const HostTensor* lookup(const StateDict& sd, const std::string& key) {
  auto it = sd.find(key);
  return it == sd.end() ? nullptr : &it->second;
}

bool has_bias(const StateDict& sd, const std::string& prefix) {
  return lookup(sd, expert_param_key(prefix, Param::kFc1Bias)) || lookup(sd, expert_param_key(prefix, Param::kFc1Bias, 0)) ||
         lookup(sd, expert_param_key(prefix, Param::kFc2Bias)) || lookup(sd, expert_param_key(prefix, Param::kFc2Bias, 0));
}

}  // namespace

std::vector<ExpertLayerKeys> find_expert_layers(const StateDict& sd, int experts) {
  MOE_CHECK(experts >= 0, "argument 'experts': expected >= 0, got ", experts);
  std::vector<ExpertLayerKeys> layers;
  const std::string fc1_per = std::string(param_name(Param::kFc1Weight)) + "0";
  const std::string fc1_grouped = param_name(Param::kFc1Weight);
  for (const auto& [key, t] : sd) {
    ExpertLayerKeys l;
    if (detail::ends_with(key, fc1_per)) {
      l.prefix = key.substr(0, key.size() - fc1_per.size());
      l.layout = WeightLayout::kPerExpert;
      int E = 0;
      while (lookup(sd, expert_param_key(l.prefix, Param::kFc1Weight, E))) ++E;
      l.experts = experts > 0 ? experts : E;
      const HostTensor* fc2 = lookup(sd, expert_param_key(l.prefix, Param::kFc2Weight, 0));
      MOE_CHECK(t.ndim() == 2, "state dict: '", key, "' has shape ", t.shape_string(), ", expected [fc1_out, H]");
      MOE_CHECK(fc2 && fc2->ndim() == 2, "state dict: '", key, "' has no matching '",
                expert_param_key(l.prefix, Param::kFc2Weight, 0), "' [H, F]");
      l.fc1_out = t.size(0);
      l.hidden = t.size(1);
      l.ffn = fc2->size(1);
    } else if (detail::ends_with(key, fc1_grouped)) {
      l.prefix = key.substr(0, key.size() - fc1_grouped.size());
      l.layout = WeightLayout::kSingleGrouped;
      const HostTensor* fc2 = lookup(sd, expert_param_key(l.prefix, Param::kFc2Weight));
      if (!fc2) continue;
      if (t.ndim() == 3 && fc2->ndim() == 3) {
        MOE_CHECK(t.size(0) <= INT32_MAX, "state dict: '", key, "' ", t.shape_string(), " holds more experts than ",
                  "a layer can (2^31 - 1)");
        l.experts = static_cast<int>(t.size(0));
        MOE_CHECK(experts == 0 || l.experts == experts, "state dict: '", key, "' ", t.shape_string(), " holds ",
                  l.experts, " experts, expected ", experts);
        MOE_CHECK(fc2->size(0) == l.experts, "state dict: '", key, "' ", t.shape_string(), " and '",
                  expert_param_key(l.prefix, Param::kFc2Weight), "' ", fc2->shape_string(),
                  " disagree on the number of experts");
        l.fc1_out = t.size(1);
        l.hidden = t.size(2);
        l.ffn = fc2->size(2);
      } else if (experts > 0 && t.ndim() == 2 && fc2->ndim() == 2 && t.size(0) % experts == 0 &&
                 fc2->size(0) % experts == 0) {
        l.experts = experts;
        l.fc1_out = t.size(0) / experts;
        l.hidden = t.size(1);
        l.ffn = fc2->size(1);
      } else {
        continue;  // an ordinary (non-expert) fc1/fc2 pair
      }
    } else {
      continue;
    }
    l.bias = has_bias(sd, l.prefix);
    l.dtype = t.dtype();
    layers.push_back(l);
  }
  std::sort(layers.begin(), layers.end(), [](const auto& a, const auto& b) { return a.prefix < b.prefix; });
  for (size_t i = 1; i < layers.size(); ++i)
    MOE_CHECK(layers[i].prefix != layers[i - 1].prefix, "state dict: the experts under '", layers[i].prefix,
              "' are stored both single grouped (fc1.weight) and per expert (fc1.weight0)");
  return layers;
}

ExpertWeightsSpec layer_spec(const ExpertLayerKeys& l, const ActivationParams& activation, WeightLayout layout) {
  ExpertWeightsSpec s;
  s.hidden = l.hidden;
  s.ffn = l.ffn;
  s.experts = l.experts;
  s.activation = activation;
  s.bias = l.bias;
  s.layout = layout;
  // Named here, by the layer: the spec's own check would name its fields, which no file has.
  MOE_CHECK(l.experts > 0 && l.hidden > 0 && l.ffn > 0, "state dict: the experts under '", l.prefix,
            "' are empty (", l.experts, " experts, hidden size ", l.hidden, ", FFN size ", l.ffn,
            ", from the shapes of their weights)");
  MOE_CHECK(s.fc1_out() == l.fc1_out, "state dict: the experts under '", l.prefix, "' have fc1 with ", l.fc1_out,
            " rows and F = ", l.ffn, ", but ", activation_name(activation.kind), " needs ", s.fc1_out());
  return s;
}

}  // namespace moe
