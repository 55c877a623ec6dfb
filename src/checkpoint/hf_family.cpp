// Hugging Face MoE families: names, activations, biases.
#include "checkpoint/hf_names.h"
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
    {HfFamily::kNemotronH, "nemotron_h"}, {HfFamily::kMistral4, "mistral4"}, {HfFamily::kGemma4, "gemma4"},
    {HfFamily::kGraniteMoe, "granitemoe"}, {HfFamily::kQwen3VlMoe, "qwen3_vl_moe"},
    {HfFamily::kDeepseekV4, "deepseek_v4"}, {HfFamily::kGlm5Next, "glm5_next"}, {HfFamily::kHyV4, "hy_v4"},
    {HfFamily::kMinimaxM3, "minimax_m3_vl"}, {HfFamily::kMinimaxM3Text, "minimax_m3_vl_text"},
    {HfFamily::kInkling, "inkling_mm_model"}, {HfFamily::kOpenaiPrivacyFilter, "openai_privacy_filter"},
};
// Hugging Face model types (config.json's "model_type") whose save_pretrained writes a family's naming
// with its activation (no biases), checked against transformers 5.17 by saving a tiny model
// of each: the per-expert gate_proj / up_proj / down_proj of Qwen2-MoE (transformers itself maps most
// of them to "qwen2_moe" when loading), or Mixtral's w1 / w3 / w2, SiLU-gated; the fused families';
// and glm5_next_text (stored fused, clamped as glm5_next: read as hy_v4).
constexpr FamilyName kModelTypes[] = {
    {HfFamily::kDeepseek, "deepseek_v2"},      {HfFamily::kDeepseek, "deepseek_v3"},
    {HfFamily::kDeepseek, "deepseek_v32"},     {HfFamily::kQwen2Moe, "qwen3_next"},
    {HfFamily::kQwen2Moe, "qwen3_5_moe"},      {HfFamily::kQwen2Moe, "qwen3_5_moe_text"},
    {HfFamily::kQwen2Moe, "qwen4_exp"},        {HfFamily::kQwen2Moe, "qwen4_exp_text"},
    {HfFamily::kQwen2Moe, "qwen3_omni_moe"},   {HfFamily::kQwen2Moe, "glm4_moe"},
    {HfFamily::kQwen2Moe, "glm4_moe_lite"},    {HfFamily::kQwen2Moe, "glm_moe_dsa"},
    {HfFamily::kQwen2Moe, "glm4v_moe"},        {HfFamily::kQwen2Moe, "dots1"},
    {HfFamily::kQwen2Moe, "solar_open"},       {HfFamily::kQwen2Moe, "exaone_moe"},
    {HfFamily::kQwen2Moe, "afmoe"},            {HfFamily::kQwen2Moe, "axk1"},
    {HfFamily::kQwen2Moe, "axk2"},             {HfFamily::kQwen2Moe, "mimo_v2_flash"},
    {HfFamily::kQwen2Moe, "hy_v3"},            {HfFamily::kQwen2Moe, "laguna"},
    {HfFamily::kQwen2Moe, "mellum"},           {HfFamily::kQwen2Moe, "cohere2_moe"},
    {HfFamily::kQwen2Moe, "ernie4_5_moe"},     {HfFamily::kQwen2Moe, "ernie4_5_vl_moe"},
    {HfFamily::kQwen2Moe, "hunyuan_v1_moe"},   {HfFamily::kQwen2Moe, "flex_olmo"},
    {HfFamily::kQwen2Moe, "deepseek_ocr2"},    {HfFamily::kQwen2Moe, "jamba"},
    {HfFamily::kMixtral, "minimax"},           {HfFamily::kMixtral, "minimax_m2"},
    {HfFamily::kMixtral, "phimoe"},            {HfFamily::kMixtral, "kimi_linear"},
    {HfFamily::kMixtral, "lfm2_moe"},
    // Stored fused, as held in memory (no conversion registered for them).
    {HfFamily::kMistral4, "zaya"},             {HfFamily::kMistral4, "granitemoe_swa"},
    {HfFamily::kMistral4, "qwen3_vl_moe_text"}, {HfFamily::kMistral4, "inkling_text"},
    {HfFamily::kMistral4, "deepseek_ocr2_text"}, {HfFamily::kMistral4, "glm4v_moe_text"},
    {HfFamily::kMistral4, "ernie4_5_vl_moe_text"}, {HfFamily::kGemma4, "gemma4_text"},
    {HfFamily::kGemma4, "diffusion_gemma"},    {HfFamily::kGraniteMoe, "granitemoeshared"},
    {HfFamily::kGraniteMoe, "granitemoehybrid"}, {HfFamily::kHyV4, "glm5_next_text"},
    // Stored as qwen3_vl_moe's released files are: fused, x @ W (gate_up [E, H, 2F] halves), SiLU-gated.
    {HfFamily::kQwen3VlMoe, "llama4"},         {HfFamily::kQwen3VlMoe, "llama4_text"},
};

}  // namespace

std::vector<std::string> hf_model_types(HfFamily f) {
  std::vector<std::string> names;
  for (const auto& n : kModelTypes)
    if (n.family == f) names.emplace_back(n.name);
  return names;
}

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
  for (const auto& n : kModelTypes)
    if (name == n.name) return n.family;
  std::string known;
  for (const auto& n : kFamilies) known += std::string(known.empty() ? "" : ", ") + n.name;
  detail::throw_error("argument '", what, "': unknown Hugging Face family '", name, "' (known: ", known,
                      ", and the model types that use their naming, e.g. glm4_moe, qwen3_next, minimax; see ",
                      "docs/checkpoints.md)");
}

ActivationParams hf_activation(HfFamily f) {
  ActivationParams a;
  if (f == HfFamily::kGptOss || f == HfFamily::kMinimaxM3 || f == HfFamily::kMinimaxM3Text ||
      f == HfFamily::kOpenaiPrivacyFilter) {
    // GptOssExperts._apply_gate (MiniMax-M3's and the privacy filter's experts apply it to the gate and up
    // halves): gate.clamp(max=7), up.clamp(-7, 7), gate * sigmoid(1.702 gate) * (up + 1).
    a.kind = Activation::kClampedSwiGLU;
    a.alpha = 1.702f;
    a.limit = 7.0f;
    a.offset = 1.0f;
  } else if (f == HfFamily::kDeepseekV4 || f == HfFamily::kGlm5Next || f == HfFamily::kHyV4) {
    // silu(min(gate, L)) * clamp(up, -L, L): clamped swiglu with alpha 1 and no offset; L = swiglu_limit.
    a.kind = Activation::kClampedSwiGLU;
    a.alpha = 1.0f;
    a.limit = 10.0f;
    a.offset = 0.0f;
  } else if (f == HfFamily::kGemma4) {
    a.kind = Activation::kGeGLU;  // act_fn(gate) * up with hidden_activation = "gelu_pytorch_tanh"
  } else if (f == HfFamily::kNemotronH) {
    a.kind = Activation::kSquaredReLU;  // down(relu(up x)^2), mlp_hidden_act = "relu2"
  } else {
    a.kind = Activation::kSwiGLU;  // act_fn(gate) * up with hidden_act = "silu"
  }
  return a;
}

bool hf_has_bias(HfFamily f) { return stored_as_gpt_oss(f); }

}  // namespace moe
