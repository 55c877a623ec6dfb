// Sharded checkpoints (a Hugging Face index and its shards): the index read, validated and written
// in save_pretrained's form, and convert_sharded_checkpoint against converting the same tensors as one
// file -- on the fixture transformers wrote (two Qwen3-MoE layers whose experts spread over four of
// its five shards), to our layouts and back, one layer at a time, with bad indexes and shards refused.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>

#include "moe/checkpoint_convert.h"
#include "moe/checkpoint_hf_fp8.h"
#include "moe/safetensors_index.h"
#include "moe/state_dict.h"
#include "support/expect_error.h"
#include "support/quant_weights.h"

namespace moe {
namespace {

namespace fs = std::filesystem;
using testing::expect_error_naming;

const std::string kFixture = std::string(MOE_TESTS_DIR) + "/fixtures/hf_sharded/qwen3_moe";
const std::string kIndexName = "model.safetensors.index.json";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_text(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// Every tensor of a sharded checkpoint as one dict, and which shard holds each.
struct Loaded {
  StateDict tensors;
  std::map<std::string, std::string> shard_of;
};

// Every tensor of the sharded checkpoint whose index is dir/index_name.
StateDict load_sharded_as(const std::string& dir, const std::string& index_name) {
  StateDict all;
  for (const std::string& file : safetensors::read_index(dir + "/" + index_name).shard_files())
    for (auto& [k, t] : load_safetensors(dir + "/" + file)) all.emplace(k, t);
  return all;
}

Loaded load_sharded(const std::string& dir) {
  Loaded l;
  const safetensors::ShardIndex index = safetensors::read_index(dir + "/" + kIndexName);
  for (const std::string& file : index.shard_files())
    for (auto& [k, t] : load_safetensors(dir + "/" + file)) {
      EXPECT_EQ(index.weight_map.at(k), file) << k;
      l.tensors.emplace(k, t);
      l.shard_of[k] = file;
    }
  EXPECT_EQ(l.tensors.size(), index.weight_map.size());
  return l;
}

void expect_same_tensors(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.size(), b.size());
  for (const auto& [k, t] : a) {
    ASSERT_TRUE(b.count(k)) << k;
    EXPECT_TRUE(t.equals(b.at(k))) << k;
  }
}

class ShardedCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = (fs::temp_directory_path() / ("moe_sharded_" + std::to_string(getpid()))).string();
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string tmp(const std::string& name) const { return dir_ + "/" + name; }
  // A copy of the fixture that a test may spoil.
  std::string fixture_copy(const std::string& name) const {
    const std::string d = tmp(name);
    fs::copy(kFixture, d);
    return d;
  }
  std::string dir_;
};

ConvertOptions options(const std::string& from, const std::string& to) {
  ConvertOptions o;
  o.from = CheckpointFormat::parse(from);
  o.to = CheckpointFormat::parse(to);
  return o;
}

TEST_F(ShardedCheckpoint, IndexIsReadAndWrittenInSavePretrainedsForm) {
  const safetensors::ShardIndex index = safetensors::read_index(kFixture + "/" + kIndexName);
  EXPECT_EQ(index.shard_files().size(), 5u);
  EXPECT_EQ(index.weight_map.size(), 45u);
  EXPECT_EQ(index.weight_map.at("model.layers.0.mlp.experts.0.up_proj.weight"), "model-00002-of-00005.safetensors");
  EXPECT_TRUE(safetensors::is_index_path(kFixture + "/" + kIndexName));
  EXPECT_FALSE(safetensors::is_index_path(kFixture + "/model-00001-of-00005.safetensors"));
  // Written back unchanged, the file is the one transformers wrote, byte for byte.
  safetensors::write_index(tmp("back.safetensors.index.json"), index);
  EXPECT_EQ(read_file(tmp("back.safetensors.index.json")), read_file(kFixture + "/" + kIndexName));
  // total_size is replaced where the metadata has one.
  safetensors::write_index(tmp("sized.safetensors.index.json"), index, 7);
  EXPECT_EQ(safetensors::read_index(tmp("sized.safetensors.index.json")).other_json,
            R"({"metadata":{"total_parameters":76736,"total_size":7}})");
}

TEST_F(ShardedCheckpoint, BadIndexesAreRefusedByName) {
  const std::string p = tmp("x.safetensors.index.json");
  auto refused = [&](const std::string& text, const std::string& message) {
    write_text(p, text);
    expect_error_naming([&] { safetensors::read_index(p); }, message);
  };
  refused("{\"weight_map\": {\"a\": \"s.safetensors\", \"a\": \"t.safetensors\"}}", "repeats the key 'a'");
  refused("{\"weight_map\": {\"a\": \"../s.safetensors\"}}", "expected a file name ending in");
  refused("{\"weight_map\": {\"a\": \"/tmp/s.safetensors\"}}", "expected a file name ending in");
  refused("{\"weight_map\": {\"a\": \"s.bin\"}}", "expected a file name ending in");
  refused("{\"weight_map\": {\"a\": 3}}", "expected a shard file name");
  refused("{\"weight_map\": [\"a\"]}", "\"weight_map\" must be an object");
  refused("{\"metadata\": {}}", "no \"weight_map\"");
  refused("{\"metadata\": 1, \"weight_map\": {}}", "\"metadata\" must be an object");
  refused("[1, 2]", "expected a JSON object");
  refused("{\"weight_map\": {\"a\": \"s.safetensors\"", "not valid JSON");
  refused(std::string(20, '[') + std::string(20, ']'), "nested deeper");
  expect_error_naming([&] { safetensors::read_index(tmp("absent.safetensors.index.json")); }, "cannot read the index");
}

TEST_F(ShardedCheckpoint, HuggingFaceToOursAndBackMatchesOneFileConversion) {
  const Loaded input = load_sharded(kFixture);
  for (const char* ours : {"grouped", "per-expert"}) {
    SCOPED_TRACE(ours);
    const std::string mid = tmp(std::string(ours)), back = tmp(std::string(ours) + "_back");
    // The folder, or the index file itself, names the checkpoint.
    const auto layers = convert_sharded_checkpoint(kFixture, mid, options("hf:qwen3_moe", ours));
    EXPECT_EQ(layers, (std::vector<std::string>{"model.layers.0.mlp.experts.", "model.layers.1.mlp.experts."}));
    const Loaded converted = load_sharded(mid);

    // The same tensors as converting everything as one dict.
    StateDict expected = input.tensors;
    convert_state_dict(expected, options("hf:qwen3_moe", ours));
    expect_same_tensors(converted.tensors, expected);
    // Tensors that are no expert's stay in their shard; each layer is whole in the shard that held its
    // first key (experts.0.down_proj: shards 1 and 3); no shard is left empty.
    for (const auto& [k, shard] : converted.shard_of) {
      if (k.find(".experts.") == std::string::npos) EXPECT_EQ(shard, input.shard_of.at(k)) << k;
      else if (k.rfind("model.layers.0.", 0) == 0) EXPECT_EQ(shard, "model-00001-of-00005.safetensors") << k;
      else EXPECT_EQ(shard, "model-00003-of-00005.safetensors") << k;
    }
    std::set<std::string> shards;
    for (const auto& kv : converted.shard_of) shards.insert(kv.second);
    EXPECT_EQ(shards.size(), 5u);  // each shard keeps tensors that are no expert's
    const safetensors::ShardIndex idx = safetensors::read_index(mid + "/" + kIndexName);
    EXPECT_NE(idx.other_json.find("\"total_size\":153472"), std::string::npos) << idx.other_json;

    // And back: every tensor as transformers wrote it.
    EXPECT_EQ(convert_sharded_checkpoint(mid + "/" + kIndexName, back, options(ours, "hf:qwen3_moe")), layers);
    expect_same_tensors(load_sharded(back).tensors, input.tensors);
  }
}

TEST_F(ShardedCheckpoint, OneLayerConvertedTheOtherGatheredUnchanged) {
  ConvertOptions o = options("hf:qwen3_moe", "grouped");
  o.prefixes = {"model.layers.1.mlp.experts."};
  EXPECT_EQ(convert_sharded_checkpoint(kFixture, tmp("one"), o), o.prefixes);
  const Loaded input = load_sharded(kFixture), out = load_sharded(tmp("one"));
  EXPECT_TRUE(out.tensors.count("model.layers.1.mlp.experts.fc1.weight"));
  for (const auto& [k, t] : input.tensors) {
    if (k.rfind("model.layers.1.mlp.experts.", 0) == 0) {
      EXPECT_FALSE(out.tensors.count(k)) << k;
    } else {
      ASSERT_TRUE(out.tensors.count(k)) << k;
      EXPECT_TRUE(out.tensors.at(k).equals(t)) << k;
    }
  }
  o.prefixes = {"model.layers.7.mlp.experts."};
  expect_error_naming([&] { convert_sharded_checkpoint(kFixture, tmp("none"), o); },
                      "argument 'prefixes': no expert layer in hf:qwen3_moe naming under 'model.layers.7.mlp.experts.'");
  EXPECT_FALSE(fs::exists(tmp("none")));  // found before the output folder is made
}

TEST_F(ShardedCheckpoint, IndexAndShardsThatDisagreeAreRefused) {
  const ConvertOptions o = options("hf:qwen3_moe", "grouped");
  // A tensor the index maps to a shard that does not hold it.
  {
    const std::string d = fixture_copy("moved");
    std::string text = read_file(d + "/" + kIndexName);
    const std::string from = "\"lm_head.weight\": \"model-00001-of-00005.safetensors\"";
    ASSERT_NE(text.find(from), std::string::npos);
    text.replace(text.find(from), from.size(), "\"lm_head.weight\": \"model-00005-of-00005.safetensors\"");
    write_text(d + "/" + kIndexName, text);
    expect_error_naming([&] { convert_sharded_checkpoint(d, tmp("out1"), o); },
                        "tensor 'lm_head.weight' is mapped to model-00005-of-00005.safetensors by the index");
  }
  // A tensor of a shard that the index leaves out.
  {
    const std::string d = fixture_copy("unlisted");
    std::string text = read_file(d + "/" + kIndexName);
    const std::string entry = "    \"lm_head.weight\": \"model-00001-of-00005.safetensors\",\n";
    ASSERT_NE(text.find(entry), std::string::npos);
    text.erase(text.find(entry), entry.size());
    write_text(d + "/" + kIndexName, text);
    expect_error_naming([&] { convert_sharded_checkpoint(d, tmp("out2"), o); }, "tensor 'lm_head.weight' is not in the index");
  }
  // A shard that is missing.
  {
    const std::string d = fixture_copy("missing");
    fs::remove(d + "/model-00004-of-00005.safetensors");
    expect_error_naming([&] { convert_sharded_checkpoint(d, tmp("out3"), o); }, "model-00004-of-00005.safetensors");
  }
  // An incomplete layer (a shard's expert tensors gone from both the shard set and the index).
  {
    const std::string d = fixture_copy("incomplete");
    const safetensors::ShardIndex index = safetensors::read_index(d + "/" + kIndexName);
    safetensors::ShardIndex fewer = index;
    for (auto it = fewer.weight_map.begin(); it != fewer.weight_map.end();)
      it = it->second == "model-00004-of-00005.safetensors" ? fewer.weight_map.erase(it) : std::next(it);
    fs::remove(d + "/model-00004-of-00005.safetensors");
    safetensors::write_index(d + "/" + kIndexName, fewer);
    expect_error_naming([&] { convert_sharded_checkpoint(d, tmp("out4"), o); }, "incomplete");
    EXPECT_FALSE(fs::exists(tmp("out4") + "/" + kIndexName));
  }
  // The output may not be the input's folder; a folder without an index is not a sharded checkpoint.
  {
    const std::string d = fixture_copy("same");
    expect_error_naming([&] { convert_sharded_checkpoint(d, d, o); }, "is the input's folder");
    fs::create_directories(tmp("empty"));
    expect_error_naming([&] { convert_sharded_checkpoint(tmp("empty"), tmp("out5"), o); },
                        "holds no *.safetensors.index.json");
    expect_error_naming([&] { convert_sharded_checkpoint(d, tmp("merged.safetensors"), o); }, "give a folder");
    EXPECT_FALSE(fs::exists(tmp("merged.safetensors")));
    write_text(tmp("file.safetensors.index.json.out"), "x");
    expect_error_naming([&] { convert_sharded_checkpoint(d, tmp("file.safetensors.index.json.out"), o); },
                        "is written into a folder");
  }
}

TEST_F(ShardedCheckpoint, AShardLeftWithoutTensorsIsNotWritten) {
  // The fixture's tensors resharded: "a" holds every tensor but layer 1's experts 2 and 3, which "b"
  // holds alone; converted, layer 1 goes whole into "a" (its first key, experts.0.down_proj, is there).
  const Loaded input = load_sharded(kFixture);
  StateDict a, b;
  safetensors::ShardIndex index;
  index.other_json = R"({"metadata":{"total_size":153472}})";
  for (const auto& [k, t] : input.tensors) {
    const bool late = k.rfind("model.layers.1.mlp.experts.2.", 0) == 0 || k.rfind("model.layers.1.mlp.experts.3.", 0) == 0;
    (late ? b : a).emplace(k, t);
    index.weight_map[k] = late ? "b.safetensors" : "a.safetensors";
  }
  const std::string d = tmp("ab");
  fs::create_directories(d);
  save_safetensors(d + "/a.safetensors", a);
  save_safetensors(d + "/b.safetensors", b);
  safetensors::write_index(d + "/weights.safetensors.index.json", index);
  convert_sharded_checkpoint(d, tmp("ab_out"), options("hf:qwen3_moe", "per-expert"));
  EXPECT_TRUE(fs::exists(tmp("ab_out") + "/a.safetensors"));
  EXPECT_FALSE(fs::exists(tmp("ab_out") + "/b.safetensors"));
  // The index keeps its file name and maps nothing to the shard not written.
  const safetensors::ShardIndex out = safetensors::read_index(tmp("ab_out") + "/weights.safetensors.index.json");
  EXPECT_EQ(out.shard_files(), std::vector<std::string>{"a.safetensors"});
  EXPECT_EQ(out.weight_map.at("model.layers.1.mlp.experts.fc1.weight3"), "a.safetensors");
}

TEST_F(ShardedCheckpoint, QuantizedLayersDeclarationsGoWithTheirTensors) {
  // The FP8 fixture (one DeepSeek-V3 layer, F8_E4M3 experts with 128x128 scales) in two shards, the
  // layer's experts 0-1 in "a" and 2-3 in "b" (b also holds the norms). Into our FP8 layout: the layer
  // whole in "a", its two "moe.quant." entries in a's __metadata__ only; back: no entry anywhere.
  Metadata meta;
  const StateDict all = load_safetensors(std::string(MOE_TESTS_DIR) + "/fixtures/hf/deepseek_v3_fp8/model.safetensors", &meta);
  const std::string p = "model.layers.0.mlp.experts.";
  StateDict a, b;
  safetensors::ShardIndex index;
  for (const auto& [k, t] : all) {
    const bool first = k.rfind(p + "0.", 0) == 0 || k.rfind(p + "1.", 0) == 0 || k.find("attn") != std::string::npos;
    (first ? a : b).emplace(k, t);
    index.weight_map[k] = first ? "a.safetensors" : "b.safetensors";
  }
  const std::string d = tmp("fp8");
  fs::create_directories(d);
  save_safetensors(d + "/a.safetensors", a, meta);
  save_safetensors(d + "/b.safetensors", b, meta);
  safetensors::write_index(d + "/model.safetensors.index.json", index);
  // Progress counts the input's bytes, although the output holds more (the columnwise copies).
  uint64_t last = 0, total = 0;
  convert_sharded_checkpoint(d, tmp("fp8_ours"), options("hf:deepseek", "grouped"), [&](uint64_t done, uint64_t all) {
    EXPECT_GE(done, last);
    EXPECT_LE(done, all);
    last = done;
    total = all;
  });
  uint64_t input = 0;
  for (const auto& kv : all) input += static_cast<uint64_t>(kv.second.nbytes());
  EXPECT_EQ(total, input);
  EXPECT_EQ(last, input);
  Metadata ma, mb;
  const StateDict oa = load_safetensors(tmp("fp8_ours") + "/a.safetensors", &ma);
  load_safetensors(tmp("fp8_ours") + "/b.safetensors", &mb);
  EXPECT_TRUE(oa.count(p + "fc2.weight_columnwise_scale_inv"));
  EXPECT_EQ(*safetensors::find_metadata(ma, "moe.quant." + p + "fc1.weight"), format_quant_metadata(hf_fp8_format()));
  EXPECT_NE(safetensors::find_metadata(ma, "moe.quant." + p + "fc2.weight"), nullptr);
  EXPECT_EQ(mb, meta);  // b keeps its own entries ({"format": "pt"}) and gets none of the layer's
  // Back, in per-expert layout on the way: the tensors of the input, and the metadata of the input.
  convert_sharded_checkpoint(tmp("fp8_ours"), tmp("fp8_pe"), options("grouped", "per-expert"));
  Metadata mpe;
  load_safetensors(tmp("fp8_pe") + "/a.safetensors", &mpe);
  EXPECT_NE(safetensors::find_metadata(mpe, "moe.quant." + p + "fc1.weight"), nullptr);
  convert_sharded_checkpoint(tmp("fp8_pe"), tmp("fp8_back"), options("per-expert", "hf:deepseek"));
  Metadata back_a;
  load_safetensors(tmp("fp8_back") + "/a.safetensors", &back_a);
  EXPECT_EQ(back_a, meta);
  expect_same_tensors(load_sharded_as(tmp("fp8_back"), "model.safetensors.index.json"), all);
  // Dequantized to bf16: no FP8 weight or scale left in either shard -- the layer's, gathered into "a",
  // nor the shared experts' in "b", which holds no expert layer.
  ConvertOptions dq = options("hf:deepseek", "hf:deepseek");
  dq.dequantize = DType::kBF16;
  convert_sharded_checkpoint(d, tmp("fp8_bf16"), dq);
  const StateDict out = load_sharded_as(tmp("fp8_bf16"), "model.safetensors.index.json");
  size_t scales = 0;
  for (const auto& [k, t] : all) {
    if (k.find("_scale_inv") != std::string::npos) {
      ++scales;
      EXPECT_FALSE(out.count(k)) << k;
    } else {
      ASSERT_TRUE(out.count(k)) << k;
      EXPECT_EQ(out.at(k).dtype(), t.dtype() == DType::kFP8E4M3 ? DType::kBF16 : t.dtype()) << k;
    }
  }
  EXPECT_GT(scales, 0u);
  EXPECT_EQ(out.size() + scales, all.size());
  EXPECT_TRUE(out.count("model.layers.0.mlp.shared_experts.gate_proj.weight"));
}

// Writes the tensors of `shards` (file -> tensors, each with `meta`) and their index into folder d.
void write_sharded(const std::string& d, const std::map<std::string, StateDict>& shards, const Metadata& meta = {}) {
  fs::create_directories(d);
  safetensors::ShardIndex index;
  for (const auto& [file, tensors] : shards) {
    save_safetensors(d + "/" + file, tensors, meta);
    for (const auto& kv : tensors) index.weight_map[kv.first] = file;
  }
  safetensors::write_index(d + "/" + kIndexName, index);
}

TEST_F(ShardedCheckpoint, ColumnwiseOnlyWeightsKeepTheirDeclarations) {
  // A quantized weight stored with its columnwise copy only has no "<key>" tensor: its "moe.quant." entry
  // still goes with its companions.
  const int E = 2;
  const int64_t H = 128, F = 128;
  QuantConfig col;
  col.format = QuantFormat::kFP8Block;
  col.rowwise = false;
  col.columnwise = true;
  const std::string p = "layers.0.mlp.experts.";
  StateDict a;
  Metadata meta;
  testing::add_grouped_layer(a, meta, p, col, testing::expert_matrices(E, 2 * F, H, 1),
                             testing::expert_matrices(E, H, F, 2), E, H, F);
  StateDict b;
  b.emplace("norm.weight", HostTensor(DType::kBF16, {H}));
  write_sharded(tmp("col"), {{"a.safetensors", a}, {"b.safetensors", b}}, meta);
  convert_sharded_checkpoint(tmp("col"), tmp("col_pe"), options("grouped", "per-expert"));
  Metadata ma;
  const StateDict pe = load_safetensors(tmp("col_pe") + "/a.safetensors", &ma);
  EXPECT_TRUE(pe.count(p + "fc1.weight1_columnwise"));
  EXPECT_NE(safetensors::find_metadata(ma, "moe.quant." + p + "fc1.weight"), nullptr);
  EXPECT_NE(safetensors::find_metadata(ma, "moe.quant." + p + "fc2.weight"), nullptr);
  // And back, which needs those declarations.
  convert_sharded_checkpoint(tmp("col_pe"), tmp("col_back"), options("per-expert", "grouped"));
  EXPECT_TRUE(load_safetensors(tmp("col_back") + "/a.safetensors").at(p + "fc1.weight_columnwise").equals(
      a.at(p + "fc1.weight_columnwise")));
}

TEST_F(ShardedCheckpoint, OutputKeysThatNameAnotherShardsTensorAreRefused) {
  // Shard a holds a layer in Hugging Face naming, shard b a stray tensor under the name the converted
  // layer would take: refused, as the single-file conversion refuses it, and no index written.
  const Loaded input = load_sharded(kFixture);
  StateDict a, b;
  for (const auto& [k, t] : input.tensors) a.emplace(k, t);
  b.emplace("model.layers.0.mlp.experts.fc1.weight", HostTensor(DType::kBF16, {2, 2}));
  write_sharded(tmp("clash"), {{"a.safetensors", a}, {"b.safetensors", b}});
  expect_error_naming([&] { convert_sharded_checkpoint(tmp("clash"), tmp("clash_out"), options("hf:qwen3_moe", "grouped")); },
                      "output tensor 'model.layers.0.mlp.experts.fc1.weight' of a.safetensors collides with a tensor "
                      "of b.safetensors");
  EXPECT_FALSE(fs::exists(tmp("clash_out") + "/" + kIndexName));
}

TEST_F(ShardedCheckpoint, AFailedRunLeavesNoIndexOfAnEarlierOne) {
  // A first conversion into the folder succeeds; a second one into the same folder fails: the folder
  // then holds no index (not the first run's, which would name shards the second may have overwritten).
  convert_sharded_checkpoint(kFixture, tmp("again"), options("hf:qwen3_moe", "grouped"));
  ASSERT_TRUE(fs::exists(tmp("again") + "/" + kIndexName));
  const std::string d = fixture_copy("late_failure");
  // The last shard gets a stray tensor under the name the first layer takes when converted.
  Metadata m;
  StateDict last = load_safetensors(d + "/model-00005-of-00005.safetensors", &m);
  last.emplace("model.layers.0.mlp.experts.fc1.weight", HostTensor(DType::kBF16, {2, 2}));
  save_safetensors(d + "/model-00005-of-00005.safetensors", last, m);
  safetensors::ShardIndex index = safetensors::read_index(d + "/" + kIndexName);
  index.weight_map["model.layers.0.mlp.experts.fc1.weight"] = "model-00005-of-00005.safetensors";
  safetensors::write_index(d + "/" + kIndexName, index);
  expect_error_naming([&] { convert_sharded_checkpoint(d, tmp("again"), options("hf:qwen3_moe", "grouped")); },
                      "collides");
  EXPECT_FALSE(fs::exists(tmp("again") + "/" + kIndexName));
}

TEST_F(ShardedCheckpoint, ConvertCheckpointTakesAFolderOrAnIndex) {
  EXPECT_TRUE(is_sharded_checkpoint(kFixture));
  EXPECT_TRUE(is_sharded_checkpoint(kFixture + "/" + kIndexName));
  EXPECT_FALSE(is_sharded_checkpoint(kFixture + "/model-00001-of-00005.safetensors"));
  uint64_t last = 0, total = 0;
  const auto layers = convert_checkpoint(kFixture + "/" + kIndexName, tmp("g"), options("hf:qwen3_moe", "grouped"),
                                         [&](uint64_t done, uint64_t all) {
                                           EXPECT_GE(done, last);
                                           last = done;
                                           total = all;
                                         });
  EXPECT_EQ(layers.size(), 2u);
  EXPECT_EQ(last, 153472u);  // every tensor byte of every shard
  EXPECT_EQ(total, 153472u);
}

TEST_F(ShardedCheckpoint, DequantizingReadsAnFp8WeightsScalesFromAnyShard) {
  // The FP8 fixture with a shared expert's weight in "a" and its block scales in "b" (save_pretrained
  // splits by size, so a pair can straddle shards): dequantized in "a", nothing FP8 left. With a bad
  // scale, nothing is written.
  Metadata meta;
  const StateDict all = load_safetensors(std::string(MOE_TESTS_DIR) + "/fixtures/hf/deepseek_v3_fp8/model.safetensors", &meta);
  const std::string w = "model.layers.0.mlp.shared_experts.gate_proj.weight";
  auto split = [&](const std::string& d, const StateDict& tensors) {
    StateDict a, b;
    for (const auto& [k, t] : tensors) (k == w + "_scale_inv" || k.find("norm") != std::string::npos ? b : a).emplace(k, t);
    write_sharded(d, {{"a.safetensors", a}, {"b.safetensors", b}}, meta);
  };
  split(tmp("straddle"), all);
  ConvertOptions dq = options("hf:deepseek", "hf:deepseek");
  dq.dequantize = DType::kFP32;
  convert_sharded_checkpoint(tmp("straddle"), tmp("straddle_fp32"), dq);
  const StateDict out = load_sharded_as(tmp("straddle_fp32"), "model.safetensors.index.json");
  ASSERT_TRUE(out.count(w));
  EXPECT_EQ(out.at(w).dtype(), DType::kFP32);
  testing::expect_no_fp8_left(out);
  StateDict bad = all;
  bad.at(w + "_scale_inv") = HostTensor(DType::kFP32, {3, 3});
  split(tmp("bad"), bad);
  expect_error_naming([&] { convert_sharded_checkpoint(tmp("bad"), tmp("bad_out"), dq); },
                      "'" + w + "_scale_inv' has dtype fp32 and shape [3, 3]");
  EXPECT_FALSE(fs::exists(tmp("bad_out") + "/a.safetensors"));
  EXPECT_FALSE(fs::exists(tmp("bad_out") + "/b.safetensors"));
}

}  // namespace
}  // namespace moe
