// FP8 expert weights between Hugging Face's per-expert form (F8_E4M3 + 128x128 "weight_scale_inv") and
// our quantized layout, on synthetic state dicts: partial column blocks, bf16 scales, every layer
// whose blocks could not move as they are refused by name. (The real thing, written by transformers'
// own quantizer and reproduced through the reference layer, is in test_hf_fixtures.cpp.)
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "moe/checkpoint_convert.h"
#include "moe/checkpoint_hf_fp8.h"
#include "support/expect_error.h"
#include "support/quant_weights.h"

namespace moe {
namespace {

using ::moe::testing::expect_error_naming;

const std::string kPrefix = "model.layers.3.mlp.experts.";

// A byte pattern of `t` that differs from tensor to tensor (FP8 codes are any byte).
HostTensor filled(DType dtype, std::vector<int64_t> shape, int tag) {
  HostTensor t(dtype, std::move(shape));
  for (int64_t i = 0; i < t.nbytes(); ++i) t.mutable_data()[i] = static_cast<uint8_t>(tag * 31 + i * 7 + i / 251);
  return t;
}

HostTensor scales(std::vector<int64_t> shape, int tag) {
  HostTensor t(DType::kFP32, std::move(shape));
  for (int64_t i = 0; i < t.numel(); ++i) reinterpret_cast<float*>(t.mutable_data())[i] = 0.5f + tag + 0.25f * i;
  return t;
}

// Experts of `names` (gate, up, down) in FP8: H = 200 (a partial last column block), F = `F`.
StateDict fp8_layer(int E, int64_t H, int64_t F, const char* gate = "gate_proj", const char* up = "up_proj",
                    const char* down = "down_proj") {
  StateDict sd;
  auto b = [](int64_t n) { return (n + 127) / 128; };
  for (int e = 0; e < E; ++e) {
    int tag = 10 * e;
    for (const char* proj : {gate, up}) {
      const std::string k = kPrefix + std::to_string(e) + "." + proj + ".weight";
      sd.emplace(k, filled(DType::kFP8E4M3, {F, H}, ++tag));
      sd.emplace(k + "_scale_inv", scales({b(F), b(H)}, tag));
    }
    const std::string k = kPrefix + std::to_string(e) + "." + down + ".weight";
    sd.emplace(k, filled(DType::kFP8E4M3, {H, F}, ++tag));
    sd.emplace(k + "_scale_inv", scales({b(H), b(F)}, tag));
  }
  sd.emplace("model.norm.weight", filled(DType::kBF16, {H}, 99));
  return sd;
}

ConvertOptions opts(const char* from, const char* to, int to_s = 0, int from_s = 0) {
  ConvertOptions o;
  o.from = CheckpointFormat::parse(from);
  o.to = CheckpointFormat::parse(to);
  o.to_glu_interleave = to_s;
  o.from_glu_interleave = from_s;
  return o;
}

TEST(HfFp8Naming, BytesLandInBothCopiesAndComeBack) {
  const int E = 2;
  const int64_t H = 200, F = 256;
  for (const char* family : {"hf:qwen3_moe", "hf:mixtral"}) {
    const bool mixtral = std::string(family) == "hf:mixtral";
    const StateDict in = mixtral ? fp8_layer(E, H, F, "w1", "w3", "w2") : fp8_layer(E, H, F);
    for (int s : {0, 128}) {
      SCOPED_TRACE(std::string(family) + " interleave " + std::to_string(s));
      StateDict sd = in;
      Metadata meta = {{"format", "pt"}};
      convert_state_dict(sd, opts(family, "grouped", s), meta);
      const std::string w1 = kPrefix + "fc1.weight";
      ASSERT_NE(safetensors::find_metadata(meta, quant_metadata_key(w1)), nullptr);
      EXPECT_EQ(*safetensors::find_metadata(meta, quant_metadata_key(w1)), format_quant_metadata(hf_fp8_format()));
      EXPECT_EQ(sd.at(w1).shape(), (std::vector<int64_t>{E, 2 * F, H}));
      EXPECT_EQ(sd.at(w1 + "_scale_inv").shape(), (std::vector<int64_t>{E, 4, 2}));
      EXPECT_EQ(sd.at(w1 + "_columnwise").shape(), (std::vector<int64_t>{E, H, 2 * F}));
      EXPECT_EQ(sd.at(w1 + "_columnwise_scale_inv").shape(), (std::vector<int64_t>{E, 2, 4}));
      // Expert 1's up row 130 is fc1 row linear_column(130): F + 130 without interleave, 2 x 128 + 130 with
      // 128; its scale block row (130 / 128 = 1) moves with it, and the columnwise copy holds the transpose.
      const std::string up = kPrefix + "1." + (mixtral ? "w3" : "up_proj") + ".weight";
      const int64_t row = s == 0 ? F + 130 : 2 * 128 + 130;
      const uint8_t* d = sd.at(w1).data() + (2 * F + row) * H;  // expert 1
      EXPECT_EQ(std::memcmp(d, in.at(up).data() + 130 * H, H), 0);
      const float* sc = reinterpret_cast<const float*>(sd.at(w1 + "_scale_inv").data()) + (4 + row / 128) * 2;
      EXPECT_EQ(std::memcmp(sc, in.at(up + "_scale_inv").data() + 1 * 2 * 4, 8), 0);
      const uint8_t* cd = sd.at(w1 + "_columnwise").data() + H * 2 * F;  // expert 1, [H, 2F]
      for (int64_t h = 0; h < H; ++h) ASSERT_EQ(cd[h * 2 * F + row], d[h]) << h;
      const float* csc = reinterpret_cast<const float*>(sd.at(w1 + "_columnwise_scale_inv").data()) + 2 * 4;
      EXPECT_EQ(csc[1 * 4 + row / 128], sc[1]);  // block (row / 128, 1) at (1, row / 128)
      // Per expert and back to Hugging Face: the input again, and the metadata as it was.
      convert_state_dict(sd, opts("grouped", "per-expert", s, s), meta);
      EXPECT_TRUE(sd.count(w1 + "1_columnwise_scale_inv"));
      convert_state_dict(sd, opts("per-expert", family, 0, s), meta);
      EXPECT_EQ(meta, (Metadata{{"format", "pt"}}));
      ASSERT_EQ(sd.size(), in.size());
      for (const auto& [k, t] : in) EXPECT_TRUE(sd.count(k) && sd.at(k).equals(t)) << k;
    }
  }
  // Between the families' namings directly: the same bytes under the other names.
  StateDict sd = fp8_layer(E, H, F);
  convert_state_dict(sd, opts("hf:qwen3_moe", "hf:mixtral"));
  EXPECT_TRUE(sd.at(kPrefix + "1.w3.weight").equals(fp8_layer(E, H, F).at(kPrefix + "1.up_proj.weight")));
  EXPECT_TRUE(sd.at(kPrefix + "0.w2.weight_scale_inv").equals(fp8_layer(E, H, F).at(kPrefix + "0.down_proj.weight_scale_inv")));
}

TEST(HfFp8Naming, Bf16ScalesAreReadExactly) {
  StateDict sd = fp8_layer(1, 128, 128);
  const std::string k = kPrefix + "0.gate_proj.weight_scale_inv";
  HostTensor bf(DType::kBF16, {1, 1});
  const uint16_t bits = 0x3FC0;  // 1.5
  std::memcpy(bf.mutable_data(), &bits, 2);
  sd.at(k) = bf;
  Metadata meta;
  convert_state_dict(sd, opts("hf:qwen3_moe", "grouped"), meta);
  EXPECT_EQ(reinterpret_cast<const float*>(sd.at(kPrefix + "fc1.weight_scale_inv").data())[0], 1.5f);
}

TEST(HfFp8Naming, LayersWhoseBlocksCannotMoveAreRefused) {
  Metadata meta;
  // F not a multiple of 128: one 128-row block of fc1 would hold gate and up rows.
  StateDict f64 = fp8_layer(1, 128, 64);
  expect_error_naming([&] { convert_state_dict(f64, opts("hf:qwen3_moe", "grouped"), meta); },
                      "have F = 64, not a multiple of 128");
  // An interleave that cuts the blocks.
  StateDict sd = fp8_layer(1, 128, 256);
  expect_error_naming([&] { convert_state_dict(sd, opts("hf:qwen3_moe", "grouped", 64), meta); },
                      "argument 'to_glu_interleave'");
  // Missing or misshapen scales; a scale where the weight is not FP8.
  StateDict missing = sd;
  missing.erase(kPrefix + "0.down_proj.weight_scale_inv");
  expect_error_naming([&] { convert_state_dict(missing, opts("hf:qwen3_moe", "grouped"), meta); },
                      "missing '" + kPrefix + "0.down_proj.weight_scale_inv'");
  StateDict shaped = sd;
  shaped.at(kPrefix + "0.up_proj.weight_scale_inv") = scales({1, 1}, 3);
  expect_error_naming([&] { convert_state_dict(shaped, opts("hf:qwen3_moe", "grouped"), meta); },
                      "'" + kPrefix + "0.up_proj.weight_scale_inv' has shape [1, 1], expected [2, 1]");
  StateDict plain;
  for (const char* proj : {"gate_proj", "up_proj"}) plain.emplace(kPrefix + "0." + proj + ".weight", filled(DType::kBF16, {128, 128}, 1));
  plain.emplace(kPrefix + "0.down_proj.weight", filled(DType::kBF16, {128, 128}, 2));
  plain.emplace(kPrefix + "0.down_proj.weight_scale_inv", scales({1, 1}, 1));
  expect_error_naming([&] { convert_state_dict(plain, opts("hf:qwen3_moe", "grouped"), meta); },
                      "is none of their tensors");
  // An interleave that is a multiple of 128 but does not divide F names the command's option.
  StateDict f384 = fp8_layer(1, 128, 384);
  expect_error_naming([&] { convert_state_dict(f384, opts("hf:qwen3_moe", "grouped", 256), meta); },
                      "argument 'to_glu_interleave'");
  // Dimensions from an untrusted file are checked before any arithmetic on them.
  StateDict huge;
  huge.emplace(kPrefix + "0.gate_proj.weight", HostTensor(DType::kFP8E4M3, {INT64_MAX, 0}));
  huge.emplace(kPrefix + "0.up_proj.weight", HostTensor(DType::kFP8E4M3, {INT64_MAX, 0}));
  huge.emplace(kPrefix + "0.down_proj.weight", HostTensor(DType::kFP8E4M3, {0, INT64_MAX}));
  for (const char* proj : {"gate_proj", "up_proj", "down_proj"})
    huge.emplace(kPrefix + "0." + proj + ".weight_scale_inv", HostTensor(DType::kFP32, {1, 1}));
  expect_error_naming([&] { convert_state_dict(huge, opts("hf:qwen3_moe", "grouped"), meta); }, "has shape");
  EXPECT_TRUE(meta.empty());  // nothing declared by the failed conversions
}

TEST(HfFp8Naming, OurQuantizedLayersOtherThanFp8BlocksStayOurs) {
  // FP8 1x128 (the activations' blocking) has no Hugging Face form; a columnwise copy that is not the
  // transpose would be lost; one weight quantized and the other not cannot be written either.
  const int E = 2;
  const int64_t H = 128, F = 128;
  QuantConfig one_d;
  one_d.format = QuantFormat::kFP8Block;
  one_d.columnwise = true;
  const auto x1 = testing::expert_matrices(E, 2 * F, H, 5), x2 = testing::expert_matrices(E, H, F, 6);
  StateDict sd;
  Metadata meta;
  testing::add_grouped_layer(sd, meta, kPrefix, one_d, x1, x2, E, H, F);
  expect_error_naming([&] { convert_state_dict(sd, opts("grouped", "hf:deepseek"), meta); },
                      "Hugging Face naming holds FP8 block 128x128 weights with row-major scales only");
  // Hugging Face names are written under the experts module's name only (as for unquantized layers).
  {
    StateDict other;
    Metadata m;
    testing::add_grouped_layer(other, m, "layers.0.moe.", hf_fp8_format(), x1, x2, E, H, F);
    expect_error_naming([&] { convert_state_dict(other, opts("grouped", "hf:qwen3_moe"), m); },
                        "the experts' prefix must end in 'experts.'");
  }

  StateDict blocks;
  const QuantConfig c = hf_fp8_format();
  Metadata m2;
  testing::add_grouped_layer(blocks, m2, kPrefix, c, x1, x2, E, H, F);
  StateDict ok = blocks;
  Metadata m_ok = m2;
  convert_state_dict(ok, opts("grouped", "hf:deepseek"), m_ok);  // the quantizer's columnwise copy is the transpose
  EXPECT_TRUE(ok.count(kPrefix + "1.down_proj.weight_scale_inv"));
  EXPECT_TRUE(m_ok.empty());

  // Families stored fused or in GPT-OSS's layout have no FP8 form: the layer stays ours, by name.
  for (const char* fused : {"hf:mistral4", "hf:inkling_mm_model", "hf:openai_privacy_filter"}) {
    StateDict f8 = blocks;
    Metadata mf = m2;
    expect_error_naming([&] { convert_state_dict(f8, opts("grouped", fused), mf); },
                        "are written for the gated per-expert families only");
  }

  StateDict spoiled = blocks;
  HostTensor col(DType::kFP8E4M3, spoiled.at(kPrefix + "fc2.weight_columnwise").shape());
  std::memcpy(col.mutable_data(), spoiled.at(kPrefix + "fc2.weight_columnwise").data(), col.nbytes());
  col.mutable_data()[col.nbytes() - 1] ^= 1;
  spoiled.at(kPrefix + "fc2.weight_columnwise") = col;
  expect_error_naming([&] { convert_state_dict(spoiled, opts("grouped", "hf:deepseek"), m2); },
                      "columnwise copy of '" + kPrefix + "fc2.weight' (expert 1) is not the transpose");

  StateDict half = blocks;
  Metadata m3;
  set_quant_metadata(m3, kPrefix + "fc1.weight", c);
  for (QuantPart part : {QuantPart::kScale, QuantPart::kColumnwiseData, QuantPart::kColumnwiseScale})
    half.erase(quant_part_key(kPrefix + "fc2.weight", part));
  half.at(kPrefix + "fc2.weight") = HostTensor(DType::kBF16, {E, H, F});
  expect_error_naming([&] { convert_state_dict(half, opts("grouped", "hf:deepseek"), m3); },
                      "Hugging Face naming stores both FP8 or neither");
}

}  // namespace
}  // namespace moe
