// `moe-engine convert` end to end: the Hugging Face fixture files (written by transformers'
// save_pretrained) go to our layouts and back bit for bit, quantized expert weights (made by the
// CPU reference quantizer) go between grouped and per expert bit for bit, and bad invocations
// fail cleanly.
//
// Runs the built tool: $MOE_ENGINE_BIN, else <build>/tools/moe-engine next to this test's
// <build>/tests/ directory (the tool is part of the default build).
#include <gtest/gtest.h>

#include <unistd.h>

#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "moe/checkpoint_hf.h"
#include "moe/checkpoint_quant.h"
#include "moe/state_dict.h"
#include "support/quant_weights.h"

namespace moe {
namespace {

std::string fixtures() {
  // The tests/ folder of the source tree (tests/CMakeLists.txt): __FILE__ may be relative to the
  // build folder (ccache base_dir), and the tests run elsewhere.
  return std::string(MOE_TESTS_DIR) + "/fixtures/hf/";
}

std::string tool() {
  if (const char* env = std::getenv("MOE_ENGINE_BIN")) return env;
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n <= 0) return "moe-engine";
  std::string exe(self, n);
  std::string dir = exe.substr(0, exe.rfind('/'));  // <build>/tests
  return dir.substr(0, dir.rfind('/')) + "/tools/moe-engine";
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool exists(const std::string& path) { return access(path.c_str(), F_OK) == 0; }

struct Result {
  int status;
  std::string output;  // stdout and stderr
};

Result run(const std::string& args) {
  const std::string cmd = "'" + tool() + "' " + args + " 2>&1";
  std::FILE* p = popen(cmd.c_str(), "r");
  if (!p) return {-1, "popen failed"};
  std::string out;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int rc = pclose(p);
  return {WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, out};
}

class ConvertCli : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(exists(tool())) << "moe-engine not found at " << tool()
                                << ": build the moe-engine target (or set MOE_ENGINE_BIN)";
    dir_ = std::string(std::getenv("TMPDIR") ? std::getenv("TMPDIR") : "/tmp") + "/moe_convert_cli_" +
           std::to_string(getpid());
    ASSERT_EQ(std::system(("mkdir -p '" + dir_ + "'").c_str()), 0);
  }
  void TearDown() override { std::system(("rm -rf '" + dir_ + "'").c_str()); }
  std::string tmp(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

struct Fixture {
  const char* dir;
  const char* family;
};
constexpr Fixture kFixtures[] = {{"mixtral", "mixtral"}, {"qwen2_moe", "qwen2_moe"}, {"qwen3_moe", "qwen3_moe"},
                                 {"olmoe", "olmoe"},     {"deepseek_v3", "deepseek"}, {"gpt_oss", "gpt_oss"},
                                 {"glm4_moe", "glm4_moe"}, {"jamba", "jamba"}, {"nemotron_h", "nemotron_h"},
                                 {"mistral4", "mistral4"}, {"gemma4", "gemma4"},     {"granitemoe", "granitemoe"},
                                 {"qwen3_vl_moe", "qwen3_vl_moe"}, {"deepseek_v4", "deepseek_v4"},
                                 {"hy_v4", "hy_v4"},       {"glm5_next", "glm5_next"},  {"minimax_m3_vl", "minimax_m3_vl"},
                                 {"minimax_m3_vl_text", "minimax_m3_vl_text"}, {"inkling_mm_model", "inkling_mm_model"},
                                 {"openai_privacy_filter", "openai_privacy_filter"}, {"llama4", "llama4"}};

TEST_F(ConvertCli, HuggingFaceFilesRoundTripBitForBit) {
  for (const Fixture& fx : kFixtures) {
    const std::string hf = fixtures() + fx.dir + "/model.safetensors";
    const std::string family = std::string("hf:") + fx.family;
    SCOPED_TRACE(hf);
    const bool gated = is_gated(hf_activation(hf_family_from_name(fx.family)).kind);
    for (const char* ours : {"grouped", "per-expert"}) {
      for (const char* interleave : {"0", "8"}) {
        if (!gated && std::string(interleave) != "0") continue;  // fc1 has no halves to interleave
        const std::string mid = tmp(std::string(fx.dir) + "_" + ours + ".safetensors");
        const std::string back = tmp(std::string(fx.dir) + "_back.safetensors");
        Result r = run("convert --from " + family + " --to " + ours + " --glu-interleave " + interleave + " '" + hf +
                       "' '" + mid + "'");
        ASSERT_EQ(r.status, 0) << r.output;
        EXPECT_NE(r.output.find("converted 1 expert layer"), std::string::npos) << r.output;
        r = run("convert -q --from " + std::string(ours) + " --to " + family + " --glu-interleave " + interleave +
                " '" + mid + "' '" + back + "'");
        ASSERT_EQ(r.status, 0) << r.output;
        EXPECT_EQ(r.output, "");  // -q
        // The whole file, header and metadata included, is what transformers wrote.
        EXPECT_TRUE(read_file(back) == read_file(hf)) << ours << " interleave " << interleave;

        // The intermediate file holds our keys, and every other tensor unchanged.
        const StateDict in = load_safetensors(hf), out = load_safetensors(mid);
        const auto layers = find_hf_expert_layers(in, hf_family_from_name(fx.family));
        ASSERT_EQ(layers.size(), 1u);
        const std::string p = layers[0].prefix;
        const int64_t E = layers[0].experts, F = layers[0].ffn, H = layers[0].hidden;
        if (std::string(ours) == "grouped") {
          ASSERT_TRUE(out.count(p + "fc1.weight"));
          EXPECT_EQ(out.at(p + "fc1.weight").shape(), (std::vector<int64_t>{E, gated ? 2 * F : F, H}));
          EXPECT_EQ(out.at(p + "fc2.weight").shape(), (std::vector<int64_t>{E, H, F}));
          EXPECT_EQ(out.count(p + "fc1.bias"), hf_has_bias(hf_family_from_name(fx.family)) ? 1u : 0u);
        } else {
          ASSERT_TRUE(out.count(p + "fc1.weight" + std::to_string(E - 1)));
          EXPECT_EQ(out.at(p + "fc2.weight0").shape(), (std::vector<int64_t>{H, F}));
        }
        const std::vector<std::string> hf_keys = hf_expert_keys(layers[0], hf_family_from_name(fx.family));
        for (const auto& [k, t] : in) {
          if (std::find(hf_keys.begin(), hf_keys.end(), k) != hf_keys.end()) {
            EXPECT_FALSE(out.count(k)) << k;
          } else {
            ASSERT_TRUE(out.count(k)) << k;
            EXPECT_TRUE(out.at(k).equals(t)) << k;
          }
        }
      }
    }
  }
}

TEST_F(ConvertCli, GroupedAndPerExpertConvertIntoEachOther) {
  const std::string hf = fixtures() + "gpt_oss/model.safetensors";
  const std::string g = tmp("g.safetensors"), pe = tmp("pe.safetensors"), g2 = tmp("g2.safetensors");
  ASSERT_EQ(run("convert -q --from hf:gpt_oss --to grouped '" + hf + "' '" + g + "'").status, 0);
  Result r = run("convert --from grouped --to per-expert '" + g + "' '" + pe + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  ASSERT_EQ(run("convert -q --from per-expert --to grouped '" + pe + "' '" + g2 + "'").status, 0);
  EXPECT_TRUE(read_file(g2) == read_file(g));
  // Re-interleaving fc1 on the way and back is the identity too.
  const std::string i16 = tmp("i16.safetensors"), i0 = tmp("i0.safetensors");
  ASSERT_EQ(run("convert -q --from grouped --to grouped --to-glu-interleave 16 '" + g + "' '" + i16 + "'").status, 0);
  EXPECT_FALSE(read_file(i16) == read_file(g));
  ASSERT_EQ(run("convert -q --from grouped --to grouped --from-glu-interleave 16 '" + i16 + "' '" + i0 + "'").status, 0);
  EXPECT_TRUE(read_file(i0) == read_file(g));
}

TEST_F(ConvertCli, QuantizedExpertsRoundTripBitForBit) {
  // One layer, fc1 NVFP4 (1-D, swizzled scales) and fc2 FP8 block (128x128), both copies each,
  // an unquantized bias, the formats in __metadata__, and a tensor that is not an expert's.
  const int E = 4;
  const int64_t H = 128, F = 64;
  QuantConfig fc1;
  fc1.format = QuantFormat::kNVFP4;
  fc1.scale_layout = ScaleLayout::kSwizzled128x4;
  fc1.columnwise = true;
  QuantConfig fc2;
  fc2.format = QuantFormat::kFP8Block;
  fc2.blocking = QuantBlocking::k2D;
  fc2.columnwise = true;
  const std::string p = "model.layers.0.mlp.experts.";
  const auto x1 = testing::expert_matrices(E, 2 * F, H, 31), x2 = testing::expert_matrices(E, H, F, 32);
  StateDict grouped, per_expert;
  testing::add_grouped(grouped, p + "fc1.weight", fc1, x1, E, 2 * F, H);
  testing::add_grouped(grouped, p + "fc2.weight", fc2, x2, E, H, F);
  testing::add_per_expert(per_expert, p + "fc1.weight", fc1, x1, E, 2 * F, H);
  testing::add_per_expert(per_expert, p + "fc2.weight", fc2, x2, E, H, F);
  HostTensor bias(DType::kBF16, {E, H});
  for (int64_t i = 0; i < bias.nbytes(); ++i) bias.mutable_data()[i] = static_cast<uint8_t>(i * 7);
  grouped.emplace(p + "fc2.bias", bias);
  for (int e = 0; e < E; ++e)
    per_expert.emplace(p + "fc2.bias" + std::to_string(e),
                       HostTensor::borrow(DType::kBF16, {H}, bias.data() + e * 2 * H, nullptr));
  grouped.emplace("model.embed_tokens.weight", HostTensor(DType::kBF16, {16, H}));
  per_expert.emplace("model.embed_tokens.weight", HostTensor(DType::kBF16, {16, H}));
  Metadata meta = {{"format", "pt"}};
  set_quant_metadata(meta, p + "fc1.weight", fc1);
  set_quant_metadata(meta, p + "fc2.weight", fc2);
  const std::string g = tmp("q_grouped.safetensors"), pe = tmp("q_pe.safetensors"), g2 = tmp("q_g2.safetensors");
  const std::string expected_pe = tmp("q_expected_pe.safetensors");
  save_safetensors(g, grouped, meta);
  save_safetensors(expected_pe, per_expert, meta);

  Result r = run("convert --from grouped --to per-expert '" + g + "' '" + pe + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("converted 1 expert layer"), std::string::npos) << r.output;
  // The per-expert file is exactly what quantizing each expert on its own and saving gives:
  // every tensor's bytes, dtypes and shapes, and the metadata (which names the grouped keys in
  // both layouts, so it is carried unchanged).
  EXPECT_TRUE(read_file(pe) == read_file(expected_pe));
  Metadata pe_meta;
  const StateDict out = load_safetensors(pe, &pe_meta);
  EXPECT_EQ(pe_meta, meta);
  EXPECT_EQ(out.size(), per_expert.size());
  EXPECT_EQ(out.at(p + "fc1.weight3_amax").ndim(), 0);
  EXPECT_EQ(out.at(p + "fc2.weight1_columnwise_scale_inv").shape(), (std::vector<int64_t>{1, 1}));

  r = run("convert -q --from per-expert --to grouped '" + pe + "' '" + g2 + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(read_file(g2) == read_file(g));

  // What would need requantization fails, naming the layer, and writes nothing.
  const std::string never = tmp("q_never.safetensors");
  r = run("convert --from grouped --to hf:mixtral '" + g + "' '" + never + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("the experts under 'model.layers.0.mlp.experts.' are quantized"), std::string::npos)
      << r.output;
  r = run("convert --from grouped --to grouped --to-glu-interleave 16 '" + g + "' '" + never + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("quantization blocks"), std::string::npos) << r.output;
  // A missing companion is named.
  StateDict broken = grouped;
  broken.erase(p + "fc2.weight_columnwise_scale_inv");
  const std::string b = tmp("q_broken.safetensors");
  save_safetensors(b, broken, meta);
  r = run("convert --from grouped --to per-expert '" + b + "' '" + never + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("missing '" + p + "fc2.weight_columnwise_scale_inv'"), std::string::npos) << r.output;
  EXPECT_FALSE(exists(never));
}

TEST_F(ConvertCli, Fp8CheckpointRoundTripsBitForBit) {
  // DeepSeek-V3's FP8 form (F8_E4M3 experts with 128x128 weight_scale_inv) to our FP8 layer and back:
  // the file transformers' quantizer wrote, header and metadata included.
  const std::string hf = fixtures() + "deepseek_v3_fp8/model.safetensors";
  for (const char* ours : {"grouped", "per-expert"}) {
    for (const char* interleave : {"0", "128"}) {
      SCOPED_TRACE(std::string(ours) + " interleave " + interleave);
      const std::string mid = tmp(std::string("fp8_") + ours + ".safetensors"), back = tmp("fp8_back.safetensors");
      Result r = run("convert --from hf:deepseek --to " + std::string(ours) + " --glu-interleave " + interleave +
                     " '" + hf + "' '" + mid + "'");
      ASSERT_EQ(r.status, 0) << r.output;
      Metadata meta;
      const StateDict out = load_safetensors(mid, &meta);
      const std::string key = "model.layers.0.mlp.experts.fc1.weight";
      ASSERT_NE(safetensors::find_metadata(meta, quant_metadata_key(key)), nullptr);
      EXPECT_EQ(out.count(std::string(ours) == "grouped" ? key + "_columnwise" : key + "3_columnwise"), 1u);
      r = run("convert -q --from " + std::string(ours) + " --to hf:deepseek --glu-interleave " + interleave + " '" +
              mid + "' '" + back + "'");
      ASSERT_EQ(r.status, 0) << r.output;
      EXPECT_TRUE(read_file(back) == read_file(hf));
    }
  }
  Result r = run("convert --from hf:deepseek --to grouped --glu-interleave 16 '" + hf + "' '" + tmp("x.safetensors") + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("argument 'to-glu-interleave'"), std::string::npos) << r.output;
  // --dequantize: the values, in bf16, with no FP8 tensor or scale left (the values themselves are
  // checked in test_hf_fixtures.cpp); any interleave is then a move of values. Only bf16 and fp32.
  r = run("convert -q --from hf:deepseek --to grouped --glu-interleave 16 --dequantize bf16 '" + hf + "' '" +
          tmp("bf16.safetensors") + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  Metadata meta;
  const StateDict out = load_safetensors(tmp("bf16.safetensors"), &meta);
  EXPECT_EQ(out.at("model.layers.0.mlp.experts.fc1.weight").dtype(), DType::kBF16);
  testing::expect_no_fp8_left(out);
  EXPECT_TRUE(quantized_params(meta).empty());
  r = run("convert --from hf:deepseek --to grouped --dequantize fp16 '" + hf + "' '" + tmp("x.safetensors") + "'");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--dequantize"), std::string::npos) << r.output;
}

TEST_F(ConvertCli, ShardedCheckpointsConvertFolderToFolder) {
  // The fixture's folder (two layers spread over five shards) to a folder of grouped shards and back; the
  // tensors are checked one by one in test_convert_sharded.cpp.
  const std::string in = std::string(MOE_TESTS_DIR) + "/fixtures/hf_sharded/qwen3_moe";
  Result r = run("convert --from hf:qwen3_moe --to grouped '" + in + "' '" + tmp("grouped") + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("converted 2 expert layers (hf:qwen3_moe -> grouped) into " + tmp("grouped")),
            std::string::npos) << r.output;
  EXPECT_TRUE(exists(tmp("grouped") + "/model.safetensors.index.json"));
  const StateDict shard = load_safetensors(tmp("grouped") + "/model-00001-of-00005.safetensors");
  EXPECT_TRUE(shard.count("model.layers.0.mlp.experts.fc1.weight"));
  r = run("convert -q --from grouped --to hf:qwen3_moe '" + tmp("grouped") + "/model.safetensors.index.json' '" +
          tmp("back") + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(r.output, "");
  EXPECT_EQ(read_file(tmp("back") + "/model-00005-of-00005.safetensors"),
            read_file(in + "/model-00005-of-00005.safetensors"));  // a shard without experts, as it was
  // Into the input's own folder: refused, nothing written.
  r = run("convert --from grouped --to hf:qwen3_moe '" + tmp("grouped") + "' '" + tmp("grouped") + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("is the input's folder"), std::string::npos) << r.output;
}

TEST_F(ConvertCli, HfAloneTakesTheFamilyFromTheConfigBesideTheInput) {
  // The fixtures' config.json say "model_type": "glm4_moe" (read as qwen2_moe's naming), and for the
  // sharded folder "qwen3_moe".
  Result r = run("convert --from hf --to grouped '" + fixtures() + "glm4_moe/model.safetensors' '" + tmp("g.safetensors") + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("(hf:qwen2_moe -> grouped)"), std::string::npos) << r.output;
  r = run("convert --from hf --to per-expert '" + std::string(MOE_TESTS_DIR) + "/fixtures/hf_sharded/qwen3_moe' '" +
          tmp("sharded") + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("(hf:qwen3_moe -> per-expert)"), std::string::npos) << r.output;
  // Our file has no config.json beside it; one whose model_type no family reads is named.
  r = run("convert --from grouped --to hf '" + tmp("g.safetensors") + "' '" + tmp("back.safetensors") + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("config.json: cannot read it"), std::string::npos) << r.output;
  std::ofstream(tmp("config.json")) << "{\"model_type\": \"llama\"}";
  r = run("convert --from grouped --to hf '" + tmp("g.safetensors") + "' '" + tmp("back.safetensors") + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("config.json model_type': unknown Hugging Face family 'llama'"), std::string::npos)
      << r.output;
  std::ofstream(tmp("config.json")) << "{\"model_type\": \"glm4_moe\"}";
  r = run("convert -q --from grouped --to hf '" + tmp("g.safetensors") + "' '" + tmp("back.safetensors") + "'");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_TRUE(read_file(tmp("back.safetensors")) == read_file(fixtures() + "glm4_moe/model.safetensors"));
}

TEST_F(ConvertCli, BadInvocationsFailCleanly) {
  const std::string hf = fixtures() + "mixtral/model.safetensors";
  const std::string out = tmp("never.safetensors");
  Result r = run("convert --from hf:gpt_oss --to grouped '" + hf + "' '" + out + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("error: no expert layers in hf:gpt_oss naming"), std::string::npos) << r.output;
  EXPECT_FALSE(exists(out));
  EXPECT_FALSE(exists(out + ".tmp"));

  r = run("convert --from megatron --to grouped '" + hf + "' '" + out + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("argument 'from'"), std::string::npos) << r.output;

  r = run("convert --from grouped --to hf:mixtral '" + tmp("missing.safetensors") + "' '" + out + "'");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("missing.safetensors"), std::string::npos) << r.output;

  r = run("convert --from hf:mixtral '" + hf + "' '" + out + "'");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("--to"), std::string::npos) << r.output;

  r = run("convert --from hf:mixtral --to grouped --glu-interleave 12 '" + hf + "' '" + out + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("interleave"), std::string::npos) << r.output;

  // An untrusted file that is not safetensors at all.
  const std::string junk = tmp("junk.safetensors");
  std::ofstream(junk, std::ios::binary) << "this is not a checkpoint";
  r = run("convert --from grouped --to per-expert '" + junk + "' '" + out + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("header length"), std::string::npos) << r.output;

  r = run("frobnicate");
  EXPECT_NE(r.status, 0);
  EXPECT_FALSE(exists(out));
}

// Options that would have been misread or ignored are refused by name: integers in octal or hex
// (CLI11 reads "010" as 8), options that do not apply to a Hugging Face side, a --layer that names
// no layer, a directory as the output.
TEST_F(ConvertCli, MisreadOptionsAreRefused) {
  const std::string hf = fixtures() + "mixtral/model.safetensors";
  const std::string out = tmp("o.safetensors");
  const std::string convert = "convert -q --from hf:mixtral --to grouped ";
  Result r = run(convert + "--experts 0x4 '" + hf + "' '" + out + "'");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(r.output.find("decimal integer"), std::string::npos) << r.output;
  r = run(convert + "--experts 3 '" + hf + "' '" + out + "'");  // the file has 4
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("argument 'experts'"), std::string::npos) << r.output;
  r = run(convert + "--experts 04 '" + hf + "' '" + out + "'");  // decimal, leading zero
  EXPECT_EQ(r.status, 0) << r.output;
  r = run(convert + "--from-glu-interleave 16 '" + hf + "' '" + out + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("argument 'from-glu-interleave'"), std::string::npos) << r.output;  // the option's name
  r = run("convert -q --from hf:mixtral --to hf:mixtral --glu-interleave 8 '" + hf + "' '" + out + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("glu-interleave"), std::string::npos) << r.output;
  r = run(convert + "--layer typo --layer model.layers.0.block_sparse_moe.experts. '" + hf + "' '" + out + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("'typo'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("argument 'layer'"), std::string::npos) << r.output;
  r = run(convert + "'" + hf + "' '" + dir_ + "'");
  EXPECT_EQ(r.status, 1);
  EXPECT_NE(r.output.find("not a regular file"), std::string::npos) << r.output;
}

// bench checks its options and shapes before it looks for a GPU (so these fail the same way on any
// machine, and none of them starts a run), and a failed run leaves no empty --png file behind.
TEST_F(ConvertCli, BenchRefusesBadOptionsBeforeLookingForAGpu) {
  const std::string png = tmp("chart.png");
  const struct {
    const char* args;
    const char* says;
  } cases[] = {{"--align 0x20", "decimal integer"},
               {"--repeats 010x", "decimal integer"},
               {"--skew nan", "finite number"},
               {"--activation bogus", "argument 'activation'"},
               {"--fp8-weights on-request", "argument 'fp8-weights'"},
               {"--shape 2147483648,4096,1024,8,2", "max_tokens"},
               {"--shape 4096,64,60,8,2", "ffn"}};
  for (const auto& c : cases) {
    Result r = run(std::string("bench --png '") + png + "' " + c.args);
    EXPECT_NE(r.status, 0) << c.args;
    EXPECT_NE(r.output.find(c.says), std::string::npos) << c.args << ": " << r.output;
    EXPECT_FALSE(exists(png)) << c.args;
  }
}

TEST_F(ConvertCli, ProgressBarOnlyWhenAsked) {
  const std::string hf = fixtures() + "olmoe/model.safetensors";
  // Not a terminal and a small file: no bar.
  Result r = run("convert -q --from hf:olmoe --to grouped '" + hf + "' '" + tmp("a.safetensors") + "'");
  ASSERT_EQ(r.status, 0);
  EXPECT_EQ(r.output, "");
  r = run("convert -q --progress --from hf:olmoe --to grouped '" + hf + "' '" + tmp("b.safetensors") + "'");
  ASSERT_EQ(r.status, 0);
  EXPECT_NE(r.output.find("100%"), std::string::npos) << r.output;
  r = run("convert -q --progress --no-progress --from hf:olmoe --to grouped '" + hf + "' '" + tmp("c.safetensors") +
          "'");
  EXPECT_EQ(r.output, "");
}

}  // namespace
}  // namespace moe
