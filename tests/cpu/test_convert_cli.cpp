// `moe-engine convert` end to end: the Hugging Face fixture files (written by transformers'
// save_pretrained) go to our layouts and back bit for bit, and bad invocations fail cleanly.
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
#include "moe/state_dict.h"

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
                                 {"olmoe", "olmoe"},     {"deepseek_v3", "deepseek"}, {"gpt_oss", "gpt_oss"}};

TEST_F(ConvertCli, HuggingFaceFilesRoundTripBitForBit) {
  for (const Fixture& fx : kFixtures) {
    const std::string hf = fixtures() + fx.dir + "/model.safetensors";
    const std::string family = std::string("hf:") + fx.family;
    SCOPED_TRACE(hf);
    for (const char* ours : {"grouped", "per-expert"}) {
      for (const char* interleave : {"0", "16"}) {
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
          EXPECT_EQ(out.at(p + "fc1.weight").shape(), (std::vector<int64_t>{E, 2 * F, H}));
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
