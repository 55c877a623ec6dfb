// Hugging Face expert naming <-> our layout (docs/semantics.md, Weight layouts and checkpoints).
//
// What each family's save_pretrained writes (checked against transformers 5.17, which converts
// the fused in-memory experts back to these names on save; fixtures in tests/fixtures/hf/):
//
//   mixtral              <P>experts.{e}.w1.weight [F, H] (gate), w3 (up = linear), w2 [H, F] (down)
//                        with P = "model.layers.{l}.block_sparse_moe."
//   qwen2_moe, qwen3_moe, olmoe, deepseek
//                        <P>experts.{e}.gate_proj.weight [F, H], up_proj [F, H], down_proj [H, F]
//                        with P = "model.layers.{l}.mlp." (shared experts are not routed experts
//                        and are left alone)
//   nemotron_h           <P>experts.{e}.up_proj.weight [F, H], down_proj [H, F]: not gated (squared
//                        ReLU), P = "backbone.layers.{l}.mixer."
//   mistral4, gemma4     <P>experts.gate_up_proj [E, 2F, H] = [gate ; up] rows, <P>experts.down_proj
//                        [E, H, F], stored as held in memory (gemma4: GeGLU, P = "model.layers.{l}.")
//   granitemoe           <P>input_linear.weight [E, 2F, H] = [gate ; up], <P>output_linear.weight [E, H, F]
//                        with P = "model.layers.{l}.block_sparse_moe."
//   deepseek_v4          mixtral's w1 / w3 / w2 naming with P = "model.layers.{l}.ffn."; glm5_next:
//                        qwen's with P = "model.language_model.layers.{l}.mlp."; hy_v4: mistral4's fused
//                        form (all three: SiLU-gated experts clamped at swiglu_limit)
//   minimax_m3_vl        mixtral's w1 / w3 / w2 naming, P = "language_model.model.layers.{l}.block_sparse_moe."
//                        (GPT-OSS's clamped SwiGLU on the gate and up halves, no biases)
//   qwen3_vl_moe         <P>experts.gate_up_proj [E, H, 2F] (x @ W: gate = columns [0, F), up = [F, 2F)),
//                        <P>experts.down_proj [E, F, H], P = "model.language_model.layers.{l}.mlp." -- the
//                        released files' form (transformers 5.17 saves [E, 2F, H] / [E, H, F]: read too)
//   gpt_oss              <P>experts.gate_up_proj [E, H, 2F]: x @ W, gate = columns 0::2, up = 1::2;
//                        or the released MXFP4 form, <P>experts.gate_up_proj_blocks [E, 2F, H / 32, 16]
//                        with _scales [E, 2F, H / 32] (down_proj the same, [E, H, F / 32, 16]), read as
//                        the bf16 values it decodes to (exact);
//                        gate_up_proj_bias [E, 2F] (same interleave); down_proj [E, F, H] (act @ W);
//                        down_proj_bias [E, H]
//
// For the first five families the fused form transformers >= 5 holds in memory is read as well
// (<P>experts.gate_up_proj [E, 2F, H] = [gate ; up] rows, <P>experts.down_proj [E, H, F]), e.g.
// from a raw model.state_dict(); writing always produces what save_pretrained writes.
//
// Our side: the layer's keys are the experts module's path plus our names --
// "model.layers.0.mlp.experts." + "fc1.weight" -- so that converting back restores every key.
// fc1 of expert e is [2F, H] with the gate rows at gate_column(j) and the linear (up) rows at
// linear_column(j) (GLU interleave s, include/moe/activation.h); fc2 is [H, F]. Every conversion
// moves bytes only: values and dtype are preserved exactly, and HF -> ours -> HF is the identity.
#pragma once

#include <string>
#include <vector>

#include "moe/activation.h"
#include "moe/checkpoint.h"
#include "moe/state_dict.h"

namespace moe {

enum class HfFamily : uint8_t {
  kMixtral, kQwen2Moe, kQwen3Moe, kOlmoe, kDeepseek, kGptOss, kNemotronH,
  kMistral4, kGemma4, kGraniteMoe, kQwen3VlMoe,  // stored fused
  kDeepseekV4, kGlm5Next, kHyV4,                  // SwiGLU clamped at a limit (hy_v4 stored fused)
  kMinimaxM3,                                      // GPT-OSS's clamped SwiGLU in Mixtral's naming
  kMinimaxM3Text,                                  // the same clamp, stored fused
  kInkling,                                        // stored fused, gate and up rows interleaved
  kOpenaiPrivacyFilter,                            // GPT-OSS's layout with [gate | up] halves
};

// "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek", "gpt_oss", "nemotron_h", "mistral4",
// "gemma4", "granitemoe", "qwen3_vl_moe", "deepseek_v4", "glm5_next", "hy_v4", "minimax_m3_vl",
// "minimax_m3_vl_text", "inkling_mm_model", "openai_privacy_filter".
const char* hf_family_name(HfFamily f);
// Accepts the names above and the Hugging Face model types whose checkpoints use a family's naming
// (hf_model_types: "glm4_moe", "qwen3_next", "deepseek_v3", "minimax", "jamba", ...); throws
// moe::Error naming `what` otherwise.
HfFamily hf_family_from_name(const std::string& name, const char* what = "family");
std::vector<std::string> hf_family_names();
// The other model types read and written as family f (checked against transformers 5.17: their
// save_pretrained writes f's per-expert naming, SiLU-gated experts without biases).
std::vector<std::string> hf_model_types(HfFamily f);
// The family's expert activation: swiglu, geglu (gemma4), GPT-OSS's clamped swiglu (alpha 1.702,
// limit 7, +1; also minimax_m3_vl's and minimax_m3_vl_text's, their config's defaults, and
// openai_privacy_filter's), the clamped SiLU of deepseek_v4 / glm5_next / hy_v4 (clamped swiglu with alpha 1,
// offset 0 and their configs' default swiglu_limit, 10: a model's config may set another, which a
// conversion, moving bytes, does not depend on), or Nemotron-H's squared ReLU (not gated).
ActivationParams hf_activation(HfFamily f);
// GPT-OSS's and openai_privacy_filter's experts have biases; the others have none.
bool hf_has_bias(HfFamily f);

// One expert layer of a Hugging Face state dict.
struct HfExpertLayer {
  std::string prefix;  // the experts module with a trailing dot, e.g. "model.layers.0.mlp.experts."
  int experts = 0;
  int64_t hidden = 0;
  int64_t ffn = 0;
  DType dtype = DType::kBF16;
  bool fused = false;  // gate_up / down tensors of all experts (the fused families; the others' in-memory form)
  bool transposed = false;  // fused in the x @ W form: gate_up [E, H, 2F], down [E, F, H] (qwen3_vl_moe)
  // (gpt_oss and openai_privacy_filter, always in that form, have neither flag set.)
  // GPT-OSS's released MXFP4 form (gate_up_proj_blocks / _scales, down_proj_blocks / _scales, bf16
  // biases): read as the bf16 values it decodes to, exactly; written back as bf16 (dtype bf16 here).
  bool mxfp4 = false;
  // Per-expert FP8 E4M3 weights, each with its 128x128 block scales "<proj>.weight_scale_inv" (the form
  // DeepSeek-V3, Kimi-K2 and the Qwen3 / MiniMax FP8 checkpoints are released in).
  bool fp8 = false;
};

// The suffix of an FP8 weight's block scales in Hugging Face checkpoints: "<proj>.weight_scale_inv".
inline constexpr const char kFp8ScaleSuffix[] = "_scale_inv";

// Every expert layer of `sd` in the family's naming, sorted by prefix. Incomplete or
// inconsistent layers (a missing expert or projection, shapes that disagree) are moe::Errors
// naming the keys.
std::vector<HfExpertLayer> find_hf_expert_layers(const StateDict& sd, HfFamily f);

// One layer's experts in our layout, with GLU interleave `glu_interleave` (not for FP8 layers: see
// load_hf_fp8_experts in moe/checkpoint_hf_fp8.h).
ExpertWeights load_hf_experts(const StateDict& sd, HfFamily f, const HfExpertLayer& layer, WeightLayout layout,
                              int glu_interleave = 0);
// The tensors the family's save_pretrained writes for these experts, keyed under `prefix` (which
// must end in "experts.", the name of Hugging Face's expert modules).
StateDict hf_expert_tensors(const ExpertWeights& w, HfFamily f, const std::string& prefix);
// The HF keys of one layer (those load_hf_experts reads), to remove them from a dict.
std::vector<std::string> hf_expert_keys(const HfExpertLayer& layer, HfFamily f);

}  // namespace moe
