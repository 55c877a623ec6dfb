// Hugging Face MoE families: names, activations, biases.
#include "moe/checkpoint_hf.h"
#include "moe/error.h"

namespace moe {

namespace {
struct FamilyName {
  HfFamily family;
  const char* name;
};
constexpr FamilyName kFamilies[] = {
    {HfFamily::kMixtral, "mixtral"}, {HfFamily::kQwen2Moe, "qwen2_moe"}, {HfFamily::kQwen3Moe, "qwen3_moe"},
    {HfFamily::kOlmoe, "olmoe"},     {HfFamily::kDeepseek, "deepseek"},  {HfFamily::kGptOss, "gpt_oss"},
};
}  // namespace

const char* hf_family_name(HfFamily f) {
  for (const auto& n : kFamilies)
    if (n.family == f) return n.name;
  return "unknown";
}

std::vector<std::string> hf_family_names() {
  std::vector<std::string> names;
  for (const auto& n : kFamilies) names.emplace_back(n.name);
  return names;
}

HfFamily hf_family_from_name(const std::string& name, const char* what) {
  for (const auto& n : kFamilies)
    if (name == n.name) return n.family;
  if (name == "deepseek_v2" || name == "deepseek_v3") return HfFamily::kDeepseek;
  std::string known;
  for (const auto& n : kFamilies) known += std::string(known.empty() ? "" : ", ") + n.name;
  detail::throw_error("argument '", what, "': unknown Hugging Face family '", name, "' (known: ", known, ")");
}

ActivationParams hf_activation(HfFamily f) {
  ActivationParams a;
  if (f == HfFamily::kGptOss) {
    // GptOssExperts._apply_gate: gate.clamp(max=7), up.clamp(-7, 7), gate * sigmoid(1.702 gate) * (up + 1).
    a.kind = Activation::kClampedSwiGLU;
    a.alpha = 1.702f;
    a.limit = 7.0f;
    a.offset = 1.0f;
  } else {
    a.kind = Activation::kSwiGLU;  // act_fn(gate) * up with hidden_act = "silu"
  }
  return a;
}

bool hf_has_bias(HfFamily f) { return f == HfFamily::kGptOss; }

}  // namespace moe
