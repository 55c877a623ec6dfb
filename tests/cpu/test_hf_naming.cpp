// Hugging Face expert naming <-> our layout on synthetic state dicts: every element lands where the
// family's forward reads it (gate/up rows, GLU interleave, GPT-OSS's interleaved columns and
// transposes, biases), conversion back is the identity, and broken layers are clear errors.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "moe/checkpoint_convert.h"
#include "moe/checkpoint_hf.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "support/expect_error.h"

namespace moe {
namespace {

using ::moe::testing::expect_error_naming;

constexpr int64_t E = 3, H = 4, F = 16;

// Element i of a tensor tagged `tag`: unique across tensors, exact in fp32.
float code(int tag, int64_t i) { return static_cast<float>(tag * 10000 + i); }

HostTensor tagged(std::vector<int64_t> shape, int tag, DType dtype = DType::kFP32) {
  HostTensor t(dtype, std::move(shape));
  uint8_t* p = t.mutable_data();
  for (int64_t i = 0; i < t.numel(); ++i) {
    if (dtype == DType::kFP32) {
      const float v = code(tag, i);
      std::memcpy(p + 4 * i, &v, 4);
    } else {  // 2-byte dtypes: a unique bit pattern
      const uint16_t v = static_cast<uint16_t>(tag * 977 + i);
      std::memcpy(p + 2 * i, &v, 2);
    }
  }
  return t;
}

float f32(const uint8_t* p, int64_t i) {
  float v;
  std::memcpy(&v, p + 4 * i, 4);
  return v;
}

// Per-expert dict of a Mixtral/Qwen-style family; tags: 100 e + {1 gate, 2 up, 3 down}.
StateDict per_expert_dict(HfFamily f, const std::string& prefix, DType dtype = DType::kFP32) {
  const bool mixtral = f == HfFamily::kMixtral;
  StateDict sd;
  for (int e = 0; e < E; ++e) {
    const std::string p = prefix + std::to_string(e) + ".";
    sd.emplace(p + (mixtral ? "w1" : "gate_proj") + ".weight", tagged({F, H}, 100 * e + 1, dtype));
    sd.emplace(p + (mixtral ? "w3" : "up_proj") + ".weight", tagged({F, H}, 100 * e + 2, dtype));
    sd.emplace(p + (mixtral ? "w2" : "down_proj") + ".weight", tagged({H, F}, 100 * e + 3, dtype));
  }
  return sd;
}

StateDict gpt_oss_dict(const std::string& prefix) {
  StateDict sd;
  sd.emplace(prefix + "gate_up_proj", tagged({E, H, 2 * F}, 1));
  sd.emplace(prefix + "gate_up_proj_bias", tagged({E, 2 * F}, 2));
  sd.emplace(prefix + "down_proj", tagged({E, F, H}, 3));
  sd.emplace(prefix + "down_proj_bias", tagged({E, H}, 4));
  return sd;
}

void expect_same(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, t] : a) {
    auto it = b.find(k);
    ASSERT_NE(it, b.end()) << k;
    EXPECT_TRUE(t.equals(it->second)) << k;
  }
}

TEST(HfFamily, NamesActivationsBiases) {
  EXPECT_EQ(hf_family_from_name("mixtral"), HfFamily::kMixtral);
  EXPECT_EQ(hf_family_from_name("deepseek_v3"), HfFamily::kDeepseek);
  EXPECT_EQ(hf_family_from_name("deepseek_v2"), HfFamily::kDeepseek);
  for (const std::string& n : hf_family_names()) EXPECT_EQ(hf_family_name(hf_family_from_name(n)), n);
  expect_error_naming([] { hf_family_from_name("llama", "to"); }, "argument 'to': unknown Hugging Face family 'llama'");
  // Model types read in a family's naming; those whose experts are no family's are refused.
  EXPECT_EQ(hf_family_from_name("glm4_moe"), HfFamily::kQwen2Moe);
  EXPECT_EQ(hf_family_from_name("qwen3_next"), HfFamily::kQwen2Moe);
  EXPECT_EQ(hf_family_from_name("deepseek_v32"), HfFamily::kDeepseek);
  EXPECT_EQ(hf_family_from_name("minimax_m2"), HfFamily::kMixtral);
  for (HfFamily f : {HfFamily::kMixtral, HfFamily::kQwen2Moe, HfFamily::kQwen3Moe, HfFamily::kOlmoe,
                     HfFamily::kDeepseek, HfFamily::kGptOss})
    for (const std::string& t : hf_model_types(f)) EXPECT_EQ(hf_family_from_name(t), f) << t;
  EXPECT_EQ(hf_model_types(HfFamily::kMixtral).size(), 5u);
  EXPECT_TRUE(hf_model_types(HfFamily::kGptOss).empty());
  EXPECT_EQ(hf_activation(HfFamily::kNemotronH).kind, Activation::kSquaredReLU);
  EXPECT_EQ(hf_activation(HfFamily::kGlm5Next).kind, Activation::kClampedSwiGLU);
  EXPECT_EQ(hf_activation(HfFamily::kDeepseekV4).alpha, 1.0f);
  EXPECT_EQ(hf_activation(HfFamily::kHyV4).offset, 0.0f);
  EXPECT_EQ(hf_family_from_name("glm5_next_text"), HfFamily::kHyV4);
  EXPECT_EQ(hf_family_from_name("llama4_text"), HfFamily::kQwen3VlMoe);
  EXPECT_EQ(hf_activation(HfFamily::kMinimaxM3).offset, 1.0f);
  EXPECT_FALSE(hf_has_bias(HfFamily::kMinimaxM3));
  for (HfFamily f : {HfFamily::kMinimaxM3Text, HfFamily::kOpenaiPrivacyFilter}) {
    const ActivationParams a = hf_activation(f);
    EXPECT_EQ(a.kind, Activation::kClampedSwiGLU);
    EXPECT_FLOAT_EQ(a.alpha, 1.702f);
    EXPECT_FLOAT_EQ(a.offset, 1.0f);
  }
  EXPECT_FALSE(hf_has_bias(HfFamily::kMinimaxM3Text));
  EXPECT_TRUE(hf_has_bias(HfFamily::kOpenaiPrivacyFilter));
  EXPECT_EQ(hf_activation(HfFamily::kInkling).kind, Activation::kSwiGLU);
  EXPECT_FALSE(hf_has_bias(HfFamily::kInkling));
  for (const char* no : {"inkling", "llama"})
    expect_error_naming([&] { hf_family_from_name(no); }, std::string("unknown Hugging Face family '") + no + "'");
  EXPECT_EQ(hf_activation(HfFamily::kQwen3Moe).kind, Activation::kSwiGLU);
  const ActivationParams g = hf_activation(HfFamily::kGptOss);
  EXPECT_EQ(g.kind, Activation::kClampedSwiGLU);
  EXPECT_FLOAT_EQ(g.alpha, 1.702f);
  EXPECT_FLOAT_EQ(g.limit, 7.0f);
  EXPECT_FLOAT_EQ(g.offset, 1.0f);
  EXPECT_TRUE(hf_has_bias(HfFamily::kGptOss));
  EXPECT_FALSE(hf_has_bias(HfFamily::kOlmoe));
}

TEST(HfNaming, PerExpertFamiliesPlaceGateAndUpRows) {
  for (HfFamily f : {HfFamily::kMixtral, HfFamily::kQwen2Moe, HfFamily::kQwen3Moe, HfFamily::kOlmoe,
                     HfFamily::kDeepseek}) {
    SCOPED_TRACE(hf_family_name(f));
    const std::string prefix =
        f == HfFamily::kMixtral ? "model.layers.7.block_sparse_moe.experts." : "model.layers.7.mlp.experts.";
    const StateDict sd = per_expert_dict(f, prefix);
    const auto layers = find_hf_expert_layers(sd, f);
    ASSERT_EQ(layers.size(), 1u);
    EXPECT_EQ(layers[0].prefix, prefix);
    EXPECT_EQ(layers[0].experts, E);
    EXPECT_EQ(layers[0].hidden, H);
    EXPECT_EQ(layers[0].ffn, F);
    EXPECT_FALSE(layers[0].fused);
    for (int s : {0, 8}) {
      for (WeightLayout layout : {WeightLayout::kSingleGrouped, WeightLayout::kPerExpert}) {
        const ExpertWeights w = load_hf_experts(sd, f, layers[0], layout, s);
        EXPECT_EQ(w.spec().activation.kind, Activation::kSwiGLU);
        EXPECT_FALSE(w.spec().bias);
        for (int e = 0; e < E; ++e) {
          const uint8_t* fc1 = w.expert_data(Param::kFc1Weight, e);
          const uint8_t* fc2 = w.expert_data(Param::kFc2Weight, e);
          for (int64_t j = 0; j < F; ++j)
            for (int64_t h = 0; h < H; ++h) {
              // Gate row j of the checkpoint is our row gate_column(j); up row j is linear_column(j).
              ASSERT_EQ(f32(fc1, gate_column(j, F, s) * H + h), code(100 * e + 1, j * H + h));
              ASSERT_EQ(f32(fc1, linear_column(j, F, s) * H + h), code(100 * e + 2, j * H + h));
            }
          for (int64_t i = 0; i < H * F; ++i) ASSERT_EQ(f32(fc2, i), code(100 * e + 3, i));
        }
        expect_same(hf_expert_tensors(w, f, prefix), sd);
      }
    }
  }
}

TEST(HfNaming, UngatedExpertsKeepTheirUpProjectionAsFc1) {
  // Nemotron-H: <e>.up_proj [F, H] and <e>.down_proj [H, F], squared ReLU.
  const std::string prefix = "backbone.layers.2.mixer.experts.";
  StateDict sd;
  for (int e = 0; e < E; ++e) {
    sd.emplace(prefix + std::to_string(e) + ".up_proj.weight", tagged({F, H}, 100 * e + 2));
    sd.emplace(prefix + std::to_string(e) + ".down_proj.weight", tagged({H, F}, 100 * e + 3));
  }
  const auto layers = find_hf_expert_layers(sd, HfFamily::kNemotronH);
  ASSERT_EQ(layers.size(), 1u);
  EXPECT_EQ(hf_expert_keys(layers[0], HfFamily::kNemotronH).size(), static_cast<size_t>(2 * E));
  const ExpertWeights w = load_hf_experts(sd, HfFamily::kNemotronH, layers[0], WeightLayout::kSingleGrouped);
  EXPECT_EQ(w.spec().fc1_out(), F);
  EXPECT_EQ(f32(w.expert_data(Param::kFc1Weight, 2), 5), code(202, 5));
  EXPECT_EQ(f32(w.expert_data(Param::kFc2Weight, 1), 7), code(103, 7));
  const StateDict back = hf_expert_tensors(w, HfFamily::kNemotronH, prefix);
  ASSERT_EQ(back.size(), sd.size());
  for (const auto& [k, t] : sd) EXPECT_TRUE(back.at(k).equals(t)) << k;
  expect_error_naming([&] { load_hf_experts(sd, HfFamily::kNemotronH, layers[0], WeightLayout::kSingleGrouped, 16); },
                      "argument 'glu_interleave': the nemotron_h experts are not gated");
  // A gate projection under ungated experts is none of their tensors.
  StateDict gated = sd;
  gated.emplace(prefix + "0.gate_proj.weight", tagged({F, H}, 1));
  expect_error_naming([&] { find_hf_expert_layers(gated, HfFamily::kNemotronH); },
                      "is none of their tensors (<e>.up_proj.weight, <e>.down_proj.weight for e in 0..2)");
}

TEST(HfNaming, Qwen3VlMoeReadsBothFusedOrientationsAndWritesTheReleasedOne) {
  // Released: gate_up [E, H, 2F] (x @ W, halves), down [E, F, H]; transformers 5.17's save: [E, 2F, H],
  // [E, H, F]. gate_up is square (H = 2F) in the second case too: down's shape tells them apart.
  for (int64_t h : {H, 2 * F}) {
    SCOPED_TRACE("H = " + std::to_string(h));
    const std::string p = "model.language_model.layers.0.mlp.experts.";
    StateDict released, saved;
    released.emplace(p + "gate_up_proj", tagged({E, h, 2 * F}, 1));
    released.emplace(p + "down_proj", tagged({E, F, h}, 2));
    HostTensor gu(DType::kFP32, {E, 2 * F, h}), dn(DType::kFP32, {E, h, F});
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < h; ++i)
        for (int64_t j = 0; j < 2 * F; ++j) {
          std::memcpy(gu.mutable_data() + 4 * ((e * 2 * F + j) * h + i),
                      released.at(p + "gate_up_proj").data() + 4 * ((e * h + i) * 2 * F + j), 4);
          if (j < F)
            std::memcpy(dn.mutable_data() + 4 * ((e * h + i) * F + j),
                        released.at(p + "down_proj").data() + 4 * ((e * F + j) * h + i), 4);
        }
    saved.emplace(p + "gate_up_proj", gu);
    saved.emplace(p + "down_proj", dn);
    const auto lr = find_hf_expert_layers(released, HfFamily::kQwen3VlMoe);
    const auto ls = find_hf_expert_layers(saved, HfFamily::kQwen3VlMoe);
    ASSERT_EQ(lr.size(), 1u);
    ASSERT_EQ(ls.size(), 1u);
    EXPECT_TRUE(lr[0].transposed);
    EXPECT_FALSE(ls[0].transposed);
    EXPECT_EQ(lr[0].hidden, h);
    EXPECT_EQ(ls[0].ffn, F);
    const ExpertWeights a = load_hf_experts(released, HfFamily::kQwen3VlMoe, lr[0], WeightLayout::kSingleGrouped, 8);
    const ExpertWeights b = load_hf_experts(saved, HfFamily::kQwen3VlMoe, ls[0], WeightLayout::kSingleGrouped, 8);
    for (Param q : {Param::kFc1Weight, Param::kFc2Weight})
      for (int e = 0; e < E; ++e)
        EXPECT_EQ(std::memcmp(a.expert_data(q, e), b.expert_data(q, e), a.spec().expert_shape(q)[0] *
                                                                            a.spec().expert_shape(q)[1] * 4), 0);
    // Gate j of expert 1 is column j of its gate_up, up j column F + j.
    EXPECT_EQ(f32(a.expert_data(Param::kFc1Weight, 1), gate_column(3, F, 8) * h + 2), code(1, (1 * h + 2) * 2 * F + 3));
    EXPECT_EQ(f32(a.expert_data(Param::kFc1Weight, 1), linear_column(3, F, 8) * h + 2),
              code(1, (1 * h + 2) * 2 * F + F + 3));
    const StateDict back = hf_expert_tensors(b, HfFamily::kQwen3VlMoe, p);
    ASSERT_EQ(back.size(), 2u);
    for (const auto& [k, t] : released) EXPECT_TRUE(back.at(k).equals(t)) << k;
  }
}

TEST(HfNaming, GptOssMxfp4DecodesEveryCodeAndScale) {
  // One expert, F = 32 (64 gate / up rows, gate = even rows), H = 32 (one block of 32 per row).
  const std::string p = "model.layers.0.mlp.experts.";
  const int64_t f = 32, h = 32;
  StateDict sd;
  HostTensor gub(DType::kUInt8, {1, 2 * f, 1, 16}), gus(DType::kUInt8, {1, 2 * f, 1});
  HostTensor dnb(DType::kUInt8, {1, h, 1, 16}), dns(DType::kUInt8, {1, h, 1});
  for (int64_t i = 0; i < 2 * f; ++i) gus.mutable_data()[i] = 127;
  for (int64_t i = 0; i < h; ++i) dns.mutable_data()[i] = 127;
  auto row = [&](int64_t r) { return gub.mutable_data() + r * 16; };
  row(0)[0] = 0x7F;                       // gate 0: element 0 low nibble 0xF (-6), element 1 high 0x7 (6)
  row(2)[0] = 0x01;                       // gate 1: 0.5 x 2^(0 - 127) = 2^-128, a bf16 subnormal
  gus.mutable_data()[2] = 0;
  row(4)[0] = 0x17;                       // gate 2: scale 255 (NaN in the MX format), read as torch.ldexp does: 2^128
  gus.mutable_data()[4] = 255;
  row(6)[0] = 0x17;                       // gate 3: 6 x 2^127 (code 7) overflows to inf, 0.5 x 2^127 = 2^126
  gus.mutable_data()[6] = 254;
  row(8)[0] = 0x08;                       // gate 4: -0.0
  row(1)[15] = 0xC0;                      // up 0: element 31 (high nibble of byte 15) code 0xC = -2
  sd.emplace(p + "gate_up_proj_blocks", gub);
  sd.emplace(p + "gate_up_proj_scales", gus);
  sd.emplace(p + "down_proj_blocks", dnb);
  sd.emplace(p + "down_proj_scales", dns);
  sd.emplace(p + "gate_up_proj_bias", HostTensor(DType::kBF16, {1, 2 * f}));
  sd.emplace(p + "down_proj_bias", HostTensor(DType::kBF16, {1, h}));
  const auto layers = find_hf_expert_layers(sd, HfFamily::kGptOss);
  ASSERT_EQ(layers.size(), 1u);
  EXPECT_EQ(layers[0].hidden, h);
  EXPECT_EQ(layers[0].ffn, f);
  const ExpertWeights w = load_hf_experts(sd, HfFamily::kGptOss, layers[0], WeightLayout::kSingleGrouped);
  const auto* fc1 = reinterpret_cast<const uint16_t*>(w.expert_data(Param::kFc1Weight, 0));
  auto at = [&](int64_t r, int64_t c) { return fc1[r * h + c]; };  // fc1 [2F, H]: gate j at row j, up j at F + j
  EXPECT_EQ(bf16_bits_to_float(at(0, 0)), -6.0f);
  EXPECT_EQ(bf16_bits_to_float(at(0, 1)), 6.0f);
  EXPECT_EQ(at(1, 0), 0x0020);  // 2^-128
  // transformers' convert_moe_packed_tensors (torch 2.11) gives 0x7f80 (inf) for 6 x 2^128, 0x7f00 for
  // 0.5 x 2^128, 0 for code 0 at scale 255.
  EXPECT_EQ(at(2, 0), 0x7f80);
  EXPECT_EQ(at(2, 1), 0x7f00);
  EXPECT_EQ(at(2, 2), 0x0000);
  EXPECT_TRUE(std::isinf(bf16_bits_to_float(at(3, 0))));
  EXPECT_EQ(bf16_bits_to_float(at(3, 1)), std::ldexp(1.0f, 126));
  EXPECT_EQ(at(4, 0), 0x8000);  // -0.0
  EXPECT_EQ(bf16_bits_to_float(at(f + 0, 31)), -2.0f);
  EXPECT_EQ(at(5, 0), 0x0000);
  // A stray form beside it, or blocks of the wrong shape, are refused by name.
  StateDict both = sd;
  both.emplace(p + "gate_up_proj", HostTensor(DType::kBF16, {1, h, 2 * f}));
  expect_error_naming([&] { find_hf_expert_layers(both, HfFamily::kGptOss); }, "both in MXFP4");
  StateDict bad = sd;
  bad.at(p + "gate_up_proj_scales") = HostTensor(DType::kUInt8, {1, 2 * f, 2});
  expect_error_naming([&] { find_hf_expert_layers(bad, HfFamily::kGptOss); }, "gate_up_proj_scales' has shape");
  StateDict huge = sd;  // a valid header's empty tensor with a dimension no arithmetic may take
  huge.at(p + "gate_up_proj_blocks") = HostTensor(DType::kUInt8, {0, 2, int64_t{1} << 62, 16});
  expect_error_naming([&] { find_hf_expert_layers(huge, HfFamily::kGptOss); }, "gate_up_proj_blocks' has shape");
  // MXFP4 is GPT-OSS's release form only: the privacy filter, in the same layout, refuses it by name.
  expect_error_naming([&] { find_hf_expert_layers(sd, HfFamily::kOpenaiPrivacyFilter); },
                      "MXFP4 experts are read for gpt_oss only, not for openai_privacy_filter");
  // FP8 experts come per expert with block scales: stored fused or in GPT-OSS's layout they are named.
  for (HfFamily f : {HfFamily::kMistral4, HfFamily::kInkling, HfFamily::kOpenaiPrivacyFilter}) {
    StateDict fp8;
    const std::string gu = std::string("model.layers.0.mlp.experts.") + (f == HfFamily::kInkling ? "w13_weight" : "gate_up_proj");
    fp8.emplace(gu, HostTensor(DType::kFP8E4M3, {2, 64, 64}));
    expect_error_naming([&] { find_hf_expert_layers(fp8, f); }, "'" + gu + "' has dtype fp8_e4m3; experts stored fused");
  }
  // A fused family's tensor of the wrong rank is named.
  StateDict scalar;
  scalar.emplace("model.layers.0.mlp.experts.gate_up_proj", HostTensor(DType::kBF16, {}));
  expect_error_naming([&] { find_hf_expert_layers(scalar, HfFamily::kMistral4); },
                      "'model.layers.0.mlp.experts.gate_up_proj' has shape");
}

TEST(HfNaming, GptOssInterleavedColumnsTransposesAndBiases) {
  const std::string prefix = "model.layers.0.mlp.experts.";
  const StateDict sd = gpt_oss_dict(prefix);
  const auto layers = find_hf_expert_layers(sd, HfFamily::kGptOss);
  ASSERT_EQ(layers.size(), 1u);
  EXPECT_EQ(layers[0].experts, E);
  EXPECT_EQ(layers[0].hidden, H);
  EXPECT_EQ(layers[0].ffn, F);
  for (int s : {0, 8, 16}) {
    const ExpertWeights w = load_hf_experts(sd, HfFamily::kGptOss, layers[0], WeightLayout::kSingleGrouped, s);
    EXPECT_EQ(w.spec().activation.kind, Activation::kClampedSwiGLU);
    EXPECT_TRUE(w.spec().bias);
    for (int e = 0; e < E; ++e) {
      const uint8_t* fc1 = w.expert_data(Param::kFc1Weight, e);
      const uint8_t* b1 = w.expert_data(Param::kFc1Bias, e);
      const uint8_t* fc2 = w.expert_data(Param::kFc2Weight, e);
      const uint8_t* b2 = w.expert_data(Param::kFc2Bias, e);
      for (int64_t j = 0; j < F; ++j) {
        // x @ gate_up_proj[e]: gate j is column 2j, up j is column 2j + 1 of the [H, 2F] matrix.
        for (int64_t h = 0; h < H; ++h) {
          ASSERT_EQ(f32(fc1, gate_column(j, F, s) * H + h), code(1, e * H * 2 * F + h * 2 * F + 2 * j));
          ASSERT_EQ(f32(fc1, linear_column(j, F, s) * H + h), code(1, e * H * 2 * F + h * 2 * F + 2 * j + 1));
        }
        ASSERT_EQ(f32(b1, gate_column(j, F, s)), code(2, e * 2 * F + 2 * j));
        ASSERT_EQ(f32(b1, linear_column(j, F, s)), code(2, e * 2 * F + 2 * j + 1));
      }
      // act @ down_proj[e] ([F, H]) == W2 act with W2 = down_proj[e]^T ([H, F]).
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t j = 0; j < F; ++j) ASSERT_EQ(f32(fc2, h * F + j), code(3, e * F * H + j * H + h));
        ASSERT_EQ(f32(b2, h), code(4, e * H + h));
      }
    }
    expect_same(hf_expert_tensors(w, HfFamily::kGptOss, prefix), sd);
    expect_same(hf_expert_tensors(w.with_layout(WeightLayout::kPerExpert), HfFamily::kGptOss, prefix), sd);
  }
}

TEST(HfNaming, FusedInMemoryFormIsRead) {
  // transformers >= 5 holds gate_up_proj [E, 2F, H] = [gate ; up] and down_proj [E, H, F].
  const std::string prefix = "model.layers.0.mlp.experts.";
  const StateDict per = per_expert_dict(HfFamily::kQwen3Moe, prefix);
  HostTensor gu(DType::kFP32, {E, 2 * F, H}), dn(DType::kFP32, {E, H, F});
  for (int e = 0; e < E; ++e) {
    const std::string p = prefix + std::to_string(e) + ".";
    std::memcpy(gu.mutable_data() + e * 2 * F * H * 4, per.at(p + "gate_proj.weight").data(), F * H * 4);
    std::memcpy(gu.mutable_data() + (e * 2 + 1) * F * H * 4, per.at(p + "up_proj.weight").data(), F * H * 4);
    std::memcpy(dn.mutable_data() + e * H * F * 4, per.at(p + "down_proj.weight").data(), H * F * 4);
  }
  StateDict fused;
  fused.emplace(prefix + "gate_up_proj", gu);
  fused.emplace(prefix + "down_proj", dn);
  const auto layers = find_hf_expert_layers(fused, HfFamily::kQwen3Moe);
  ASSERT_EQ(layers.size(), 1u);
  EXPECT_TRUE(layers[0].fused);
  EXPECT_EQ(hf_expert_keys(layers[0], HfFamily::kQwen3Moe).size(), 2u);
  const ExpertWeights w = load_hf_experts(fused, HfFamily::kQwen3Moe, layers[0], WeightLayout::kPerExpert, 8);
  // Written back in the per-expert form save_pretrained writes.
  expect_same(hf_expert_tensors(w, HfFamily::kQwen3Moe, prefix), per);
  // Both forms under one prefix are ambiguous.
  StateDict both = per;
  both.emplace(prefix + "gate_up_proj", gu);
  expect_error_naming([&] { find_hf_expert_layers(both, HfFamily::kQwen3Moe); }, "both per expert and fused");
}

TEST(HfNaming, FindsEveryLayerAndIgnoresOtherTensors) {
  StateDict sd = per_expert_dict(HfFamily::kDeepseek, "model.layers.1.mlp.experts.");
  for (auto& kv : per_expert_dict(HfFamily::kDeepseek, "model.layers.0.mlp.experts.")) sd.insert(kv);
  // Shared experts, the router and dense MLPs are not routed experts.
  sd.emplace("model.layers.0.mlp.shared_experts.gate_proj.weight", tagged({F, H}, 7));
  sd.emplace("model.layers.0.mlp.shared_expert.up_proj.weight", tagged({F, H}, 7));
  sd.emplace("model.layers.0.mlp.gate.weight", tagged({E, H}, 8));
  sd.emplace("model.layers.2.mlp.gate_proj.weight", tagged({F, H}, 9));
  const auto layers = find_hf_expert_layers(sd, HfFamily::kDeepseek);
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[0].prefix, "model.layers.0.mlp.experts.");
  EXPECT_EQ(layers[1].prefix, "model.layers.1.mlp.experts.");
  EXPECT_TRUE(find_hf_expert_layers(sd, HfFamily::kMixtral).empty());
  EXPECT_TRUE(find_hf_expert_layers(sd, HfFamily::kGptOss).empty());
}

TEST(HfNaming, BrokenLayersAreErrorsNamingTheKeys) {
  const std::string p = "m.experts.";
  {
    StateDict sd = per_expert_dict(HfFamily::kMixtral, p);
    sd.erase(p + "1.w3.weight");
    expect_error_naming([&] { find_hf_expert_layers(sd, HfFamily::kMixtral); }, "missing 'm.experts.1.w3.weight'");
  }
  {
    StateDict sd = per_expert_dict(HfFamily::kMixtral, p);
    for (const char* w : {"w1", "w2", "w3"}) sd.erase(p + "1." + w + ".weight");  // a whole expert
    expect_error_naming([&] { find_hf_expert_layers(sd, HfFamily::kMixtral); }, "'m.experts.1.w1.weight'");
  }
  {
    StateDict sd = per_expert_dict(HfFamily::kOlmoe, p);
    sd[p + "2.down_proj.weight"] = tagged({H, F + 1}, 0);
    expect_error_naming([&] { find_hf_expert_layers(sd, HfFamily::kOlmoe); },
                        "'m.experts.2.down_proj.weight' has shape [4, 17], expected [4, 16]");
  }
  {
    StateDict sd = per_expert_dict(HfFamily::kOlmoe, p);
    sd[p + "1.up_proj.weight"] = tagged({F, H}, 0, DType::kBF16);
    expect_error_naming([&] { find_hf_expert_layers(sd, HfFamily::kOlmoe); }, "'m.experts.1.up_proj.weight' has dtype bf16");
  }
  {
    StateDict sd = gpt_oss_dict(p);
    sd.erase(p + "down_proj_bias");
    expect_error_naming([&] { find_hf_expert_layers(sd, HfFamily::kGptOss); }, "missing 'm.experts.down_proj_bias'");
  }
  {
    StateDict sd = gpt_oss_dict(p);
    sd[p + "gate_up_proj"] = tagged({E, H, 2 * F + 1}, 0);
    expect_error_naming([&] { find_hf_expert_layers(sd, HfFamily::kGptOss); }, "expected [E, H, 2F]");
  }
  // Writing: the family's activation and biases must match the weights.
  const StateDict sd = per_expert_dict(HfFamily::kMixtral, p);
  const ExpertWeights w = load_hf_experts(sd, HfFamily::kMixtral, find_hf_expert_layers(sd, HfFamily::kMixtral)[0],
                                          WeightLayout::kSingleGrouped);
  expect_error_naming([&] { hf_expert_tensors(w, HfFamily::kGptOss, p); }, "clamped");
  const StateDict g = gpt_oss_dict(p);
  const ExpertWeights wg =
      load_hf_experts(g, HfFamily::kGptOss, find_hf_expert_layers(g, HfFamily::kGptOss)[0], WeightLayout::kPerExpert);
  ExpertWeightsSpec s = wg.spec();
  s.activation = hf_activation(HfFamily::kMixtral);
  const ExpertWeights biased = ExpertWeights::from_state_dict(wg.to_state_dict(), s);
  expect_error_naming([&] { hf_expert_tensors(biased, HfFamily::kMixtral, p); }, "biases");
  // Keys under a layer that are none of its experts' tensors are refused by name, not left behind.
  for (const char* stray : {"1234567.w1.weight", "01.w2.weight", "0.w1.weight_scale_inv", "0.w1.bias",
                            "1.w4.weight"}) {
    StateDict extra = per_expert_dict(HfFamily::kMixtral, p);
    extra.emplace(p + stray, HostTensor(DType::kFP32, {1}));
    expect_error_naming([&] { find_hf_expert_layers(extra, HfFamily::kMixtral); },
                        "'" + p + stray + "' lies under the mixtral experts");
  }
  // Under a prefix that is no expert module's, the names written would be no family's.
  expect_error_naming([&] { hf_expert_tensors(w, HfFamily::kMixtral, "model.layers.0.mlp."); }, "'experts.'");
  expect_error_naming([&] { hf_expert_tensors(w, HfFamily::kMixtral, "model.layers.0.mlp.myexperts."); },
                      "'experts.'");
}

TEST(HfNaming, TwoByteDtypesMoveBitExactly) {
  const std::string prefix = "model.layers.0.block_sparse_moe.experts.";
  const StateDict sd = per_expert_dict(HfFamily::kMixtral, prefix, DType::kBF16);
  const auto layers = find_hf_expert_layers(sd, HfFamily::kMixtral);
  ASSERT_EQ(layers.size(), 1u);
  EXPECT_EQ(layers[0].dtype, DType::kBF16);
  const ExpertWeights w = load_hf_experts(sd, HfFamily::kMixtral, layers[0], WeightLayout::kSingleGrouped, 16);
  EXPECT_EQ(w.dtype(), DType::kBF16);
  expect_same(hf_expert_tensors(w, HfFamily::kMixtral, prefix), sd);
}

// ---------------------------------------------------------------------------------------------
// convert_state_dict

ConvertOptions opts(const std::string& from, const std::string& to) {
  ConvertOptions o;
  o.from = CheckpointFormat::parse(from, "from");
  o.to = CheckpointFormat::parse(to, "to");
  return o;
}

TEST(ConvertStateDict, HfAloneNeedsAConfig) {
  const CheckpointFormat f = CheckpointFormat::parse("hf");
  EXPECT_TRUE(f.family_from_config);
  EXPECT_EQ(f.name(), "hf");
  ConvertOptions o;
  o.from = f;
  o.to = CheckpointFormat::parse("grouped");
  StateDict sd;
  expect_error_naming([&] { convert_state_dict(sd, o); }, "argument 'from': 'hf' takes the family from a config.json");
}

TEST(ConvertStateDict, FormatsParse) {
  EXPECT_EQ(CheckpointFormat::parse("hf:gpt_oss").family, HfFamily::kGptOss);
  EXPECT_EQ(CheckpointFormat::parse("hf:deepseek_v3").name(), "hf:deepseek");
  EXPECT_EQ(CheckpointFormat::parse("per-expert").kind, CheckpointFormat::Kind::kPerExpert);
  expect_error_naming([] { CheckpointFormat::parse("megatron", "from"); }, "argument 'from'");
  expect_error_naming([] { CheckpointFormat::parse("hf:bert", "to"); }, "argument 'to'");
}

TEST(ConvertStateDict, HfToOursAndBackKeepsEverythingElse) {
  StateDict sd = per_expert_dict(HfFamily::kMixtral, "model.layers.0.block_sparse_moe.experts.");
  for (auto& kv : per_expert_dict(HfFamily::kMixtral, "model.layers.1.block_sparse_moe.experts.")) sd.insert(kv);
  sd.emplace("model.layers.0.block_sparse_moe.gate.weight", tagged({E, H}, 50));
  sd.emplace("lm_head.weight", tagged({8, H}, 51));
  const StateDict original = sd;

  StateDict g = sd;
  ConvertOptions o = opts("hf:mixtral", "grouped");
  o.to_glu_interleave = 8;
  EXPECT_EQ(convert_state_dict(g, o).size(), 2u);
  EXPECT_EQ(g.size(), 2u + 2u * 2u);  // two untouched tensors + fc1/fc2 of two layers
  EXPECT_EQ(g.at("model.layers.1.block_sparse_moe.experts.fc1.weight").shape(), (std::vector<int64_t>{E, 2 * F, H}));
  EXPECT_TRUE(g.at("lm_head.weight").equals(original.at("lm_head.weight")));

  StateDict pe = g;
  ConvertOptions o2 = opts("grouped", "per-expert");
  o2.from_glu_interleave = 8;
  o2.to_glu_interleave = 0;
  convert_state_dict(pe, o2);
  EXPECT_EQ(pe.size(), 2u + 2u * 2u * E);
  EXPECT_TRUE(pe.count("model.layers.0.block_sparse_moe.experts.fc2.weight2"));

  ConvertOptions o3 = opts("per-expert", "hf:mixtral");
  convert_state_dict(pe, o3);
  expect_same(pe, original);

  // Straight back from grouped (interleave 8) too.
  ConvertOptions o4 = opts("grouped", "hf:mixtral");
  o4.from_glu_interleave = 8;
  convert_state_dict(g, o4);
  expect_same(g, original);
}

TEST(ConvertStateDict, LayerSelectionCollisionsAndMismatches) {
  StateDict sd = per_expert_dict(HfFamily::kQwen2Moe, "a.experts.");
  for (auto& kv : per_expert_dict(HfFamily::kQwen2Moe, "b.experts.")) sd.insert(kv);
  {
    StateDict one = sd;
    ConvertOptions o = opts("hf:qwen2_moe", "grouped");
    o.prefixes = {"b.experts."};
    EXPECT_EQ(convert_state_dict(one, o), (std::vector<std::string>{"b.experts."}));
    EXPECT_TRUE(one.count("a.experts.0.gate_proj.weight"));
    EXPECT_TRUE(one.count("b.experts.fc1.weight"));
    // Declared per-expert, stored grouped.
    expect_error_naming([&] { convert_state_dict(one, opts("per-expert", "grouped")); },
                        "input declared per-expert, but the experts under 'b.experts.' are stored single grouped");
  }
  {
    StateDict clash = sd;
    clash.emplace("a.experts.fc1.weight", tagged({1}, 0));
    expect_error_naming([&] { convert_state_dict(clash, opts("hf:qwen2_moe", "grouped")); },
                        "'a.experts.fc1.weight' collides");
  }
  {
    StateDict none = sd;
    expect_error_naming([&] { convert_state_dict(none, opts("hf:mixtral", "grouped")); },
                        "no expert layers in hf:mixtral naming");
    expect_error_naming([&] { convert_state_dict(none, opts("grouped", "per-expert")); }, "no expert layers");
  }
  {
    StateDict g = sd;
    convert_state_dict(g, opts("hf:qwen2_moe", "grouped"));
    const StateDict before = g;
    ConvertOptions o = opts("grouped", "hf:gpt_oss");
    expect_error_naming([&] { convert_state_dict(g, o); }, "biases");
    expect_same(g, before);  // a failed conversion leaves the dict as it was
    ConvertOptions bad = opts("grouped", "hf:qwen2_moe");
    bad.to_glu_interleave = 8;
    expect_error_naming([&] { convert_state_dict(g, bad); }, "to_glu_interleave");
  }
}

}  // namespace
}  // namespace moe
