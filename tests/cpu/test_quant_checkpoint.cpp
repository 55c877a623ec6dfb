// Checkpoints of quantized expert weights: names and metadata, grouped <-> per expert moving data
// and every companion tensor bit for bit (through a safetensors file too), per-expert
// quantization equal to slicing the grouped one (and where a different blocking would break it),
// errors naming the key, and convert_state_dict on quantized layers.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "moe/checkpoint_convert.h"
#include "moe/checkpoint_quant.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "moe/state_dict.h"
#include "reference/quantize_ref.h"
#include "support/expect_error.h"
#include "support/quant_weights.h"

namespace moe {
namespace {

using ::moe::testing::add_grouped;
using ::moe::testing::add_per_expert;
using ::moe::testing::expect_error_naming;
using ::moe::testing::expect_values;
using ::moe::testing::expert_matrices;

QuantConfig config(QuantFormat f, QuantBlocking b, ScaleLayout l = ScaleLayout::kRowMajor, bool rowwise = true,
                   bool columnwise = true) {
  QuantConfig c;
  c.format = f;
  c.blocking = b;
  c.scale_layout = l;
  c.rowwise = rowwise;
  c.columnwise = columnwise;
  return c;
}

// Every format, blocking and scale layout, with both copies; and one-copy variants.
struct Case {
  QuantConfig config;
  int64_t M, K;  // a shape the format accepts with both copies, partial blocks where allowed
};
std::vector<Case> cases() {
  using F = QuantFormat;
  using B = QuantBlocking;
  using L = ScaleLayout;
  std::vector<Case> v = {
      {config(F::kFP8Block, B::k1D), 136, 200},        {config(F::kFP8Block, B::k1D, L::kMNMajor), 136, 200},
      {config(F::kFP8Block, B::k2D), 136, 200},        {config(F::kMXFP8, B::k1D), 64, 96},
      {config(F::kMXFP8, B::k1D, L::kSwizzled128x4), 64, 96},
      {config(F::kNVFP4, B::k1D), 48, 80},             {config(F::kNVFP4, B::k1D, L::kSwizzled128x4), 48, 80},
      {config(F::kNVFP4, B::k2D), 48, 80},
      {config(F::kMXFP8, B::k1D, L::kRowMajor, true, false), 64, 96},
      {config(F::kNVFP4, B::k1D, L::kRowMajor, false, true), 48, 80},
  };
  QuantConfig pow2 = config(F::kFP8Block, B::k2D);
  pow2.pow2_scale = true;
  v.push_back({pow2, 136, 200});
  return v;
}

std::vector<std::string> keys(const StateDict& sd) {
  std::vector<std::string> k;
  for (const auto& kv : sd) k.push_back(kv.first);
  return k;
}

void expect_same(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(keys(a), keys(b));
  for (const auto& [k, t] : a) {
    const HostTensor& u = b.at(k);
    EXPECT_EQ(t.dtype(), u.dtype()) << k;
    EXPECT_EQ(t.shape(), u.shape()) << k;
    EXPECT_TRUE(t.equals(u)) << k << ": bytes differ";
  }
}

std::string tmp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/moe_quant_ckpt_" + std::to_string(getpid()) + "_" + name;
}

constexpr int kE = 3;

// ---------------------------------------------------------------------------------------------
// Names and metadata

TEST(QuantCheckpoint, PartKeys) {
  EXPECT_EQ(quant_part_key("l.fc1.weight", QuantPart::kData), "l.fc1.weight");
  EXPECT_EQ(quant_part_key("l.fc1.weight", QuantPart::kScale), "l.fc1.weight_scale_inv");
  EXPECT_EQ(quant_part_key("l.fc1.weight3", QuantPart::kColumnwiseData), "l.fc1.weight3_columnwise");
  EXPECT_EQ(quant_part_key("fc2.weight", QuantPart::kColumnwiseScale), "fc2.weight_columnwise_scale_inv");
  EXPECT_EQ(quant_part_key("fc2.weight0", QuantPart::kGlobalAmax), "fc2.weight0_amax");
  EXPECT_EQ(quant_metadata_key("l.fc1.weight"), "moe.quant.l.fc1.weight");
}

TEST(QuantCheckpoint, MetadataStrings) {
  EXPECT_EQ(format_quant_metadata(config(QuantFormat::kMXFP8, QuantBlocking::k1D)),
            "mxfp8;block=1x32;scale=e8m0;layout=row_major;copies=rowwise,columnwise");
  EXPECT_EQ(format_quant_metadata(config(QuantFormat::kFP8Block, QuantBlocking::k2D)),
            "fp8_block;block=128x128;scale=f32;layout=row_major;copies=rowwise,columnwise");
  EXPECT_EQ(format_quant_metadata(config(QuantFormat::kNVFP4, QuantBlocking::k1D, ScaleLayout::kSwizzled128x4, true,
                                         false)),
            "nvfp4;block=1x16;scale=e4m3;layout=swizzled_128x4;copies=rowwise");
  EXPECT_EQ(format_quant_metadata(config(QuantFormat::kFP8Block, QuantBlocking::k1D, ScaleLayout::kMNMajor, false,
                                         true)),
            "fp8_block;block=1x128;scale=f32;layout=mn_major;copies=columnwise");
  // Every configuration reads back as itself (fields in any order).
  for (const Case& k : cases()) {
    const std::string s = format_quant_metadata(k.config);
    const QuantConfig c = parse_quant_metadata(s, "m");
    EXPECT_EQ(format_quant_metadata(c), s);
    EXPECT_EQ(c.format, k.config.format);
    EXPECT_EQ(c.blocking, k.config.blocking);
    EXPECT_EQ(c.scale_layout, k.config.scale_layout);
    EXPECT_EQ(c.rowwise, k.config.rowwise);
    EXPECT_EQ(c.columnwise, k.config.columnwise);
    EXPECT_EQ(c.pow2_scale, k.config.pow2_scale);
  }
  // The columnwise copy in its own layout.
  QuantConfig own = config(QuantFormat::kFP8Block, QuantBlocking::k1D);
  own.columnwise_scale_layout = ScaleLayout::kMNMajor;
  const std::string own_s = format_quant_metadata(own);
  EXPECT_EQ(own_s, "fp8_block;block=1x128;scale=f32;layout=row_major;columnwise_layout=mn_major;copies=rowwise,columnwise");
  EXPECT_EQ(parse_quant_metadata(own_s, "m").columnwise_scale_layout, ScaleLayout::kMNMajor);
  EXPECT_FALSE(parse_quant_metadata("mxfp8;block=1x32;scale=e8m0;layout=row_major;copies=rowwise", "m")
                   .columnwise_scale_layout.has_value());
  const QuantConfig r = parse_quant_metadata("nvfp4;copies=columnwise;layout=row_major;scale=e4m3;block=16x16", "m");
  EXPECT_EQ(r.blocking, QuantBlocking::k2D);
  EXPECT_FALSE(r.rowwise);
}

TEST(QuantCheckpoint, BadMetadataIsAnErrorNamingTheEntry) {
  const std::string w = "__metadata__ 'moe.quant.fc1.weight'";
  const std::string ok = ";block=1x32;scale=e8m0;layout=row_major;copies=rowwise";
  expect_error_naming([&] { parse_quant_metadata("mxfp4" + ok, w); }, w + " = 'mxfp4;");
  expect_error_naming([&] { parse_quant_metadata("mxfp4" + ok, w); }, "unknown format 'mxfp4'");
  expect_error_naming([&] { parse_quant_metadata("mxfp8" + ok + ";seed=3", w); }, "unknown field 'seed'");
  expect_error_naming([&] { parse_quant_metadata("mxfp8" + ok + ";scale=e8m0", w); }, "'scale' given twice");
  expect_error_naming([&] { parse_quant_metadata("mxfp8;block=1x32;scale=e8m0;copies=rowwise", w); },
                      "missing field 'layout'");
  expect_error_naming([&] { parse_quant_metadata("mxfp8;block=1x32;scale=e8m0;layout;copies=rowwise", w); },
                      "not name=value");
  expect_error_naming([&] { parse_quant_metadata("mxfp8;block=1x16;scale=e8m0;layout=row_major;copies=rowwise", w); },
                      "block '1x16' is not a mxfp8 block");
  expect_error_naming([&] { parse_quant_metadata("mxfp8;block=32x32;scale=e8m0;layout=row_major;copies=rowwise", w); },
                      "2-D blocks exist for fp8_block");
  expect_error_naming([&] { parse_quant_metadata("mxfp8;block=1x32;scale=f32;layout=row_major;copies=rowwise", w); },
                      "scale 'f32' is not the mxfp8 scale 'e8m0'");
  expect_error_naming([&] { parse_quant_metadata("mxfp8;block=1x32;scale=e8m0;layout=mn_major;copies=rowwise", w); },
                      "mn_major is for fp8_block");
  expect_error_naming([&] { parse_quant_metadata("mxfp8;block=1x32;scale=e8m0;layout=row_major;copies=both", w); },
                      "copies 'both'");
  expect_error_naming([&] { parse_quant_metadata("nvfp4;block=1x16;scale=e4m3;layout=row;copies=rowwise", w); },
                      "unknown layout 'row'");
  expect_error_naming(
      [&] { parse_quant_metadata("mxfp8;block=1x32;scale=e8m0;layout=row_major;columnwise_layout=mn_major;copies=rowwise", w); },
      "columnwise_scale_layout': mn_major is for fp8_block");
  expect_error_naming([&] { parse_quant_metadata("mxfp8" + ok + ";pow2_scale=1", w); }, "pow2_scale");
  // quantized_params parses every moe.quant.* entry and ignores the others.
  const Metadata m = {{"format", "pt"}, {"moe.quant.a.fc1.weight", "mxfp8" + ok}};
  const auto params = quantized_params(m);
  ASSERT_EQ(params.size(), 1u);
  EXPECT_EQ(params[0].key, "a.fc1.weight");
  EXPECT_EQ(params[0].config.format, QuantFormat::kMXFP8);
  expect_error_naming([] { quantized_params({{"moe.quant.x", "fp8"}}); }, "__metadata__ 'moe.quant.x'");
}

TEST(QuantCheckpoint, PartLayouts) {
  // FP8 block 128x128 weight [M=136, K=200]: DeepSeek-V3's weight / weight_scale_inv layout.
  const QuantConfig fp8 = config(QuantFormat::kFP8Block, QuantBlocking::k2D);
  QuantPartLayout l = quant_part_layout(fp8, QuantPart::kData, 136, 200);
  EXPECT_EQ(l.dtype, DType::kFP8E4M3);
  EXPECT_EQ(l.shape, (std::vector<int64_t>{136, 200}));
  l = quant_part_layout(fp8, QuantPart::kScale, 136, 200);
  EXPECT_EQ(l.dtype, DType::kFP32);
  EXPECT_EQ(l.shape, (std::vector<int64_t>{2, 2}));
  l = quant_part_layout(fp8, QuantPart::kColumnwiseData, 136, 200);
  EXPECT_EQ(l.shape, (std::vector<int64_t>{200, 136}));
  // NVFP4: packed U8 data, E4M3 scales, 0-d fp32 amax.
  const QuantConfig nv = config(QuantFormat::kNVFP4, QuantBlocking::k1D, ScaleLayout::kSwizzled128x4);
  l = quant_part_layout(nv, QuantPart::kData, 48, 80);
  EXPECT_EQ(l.dtype, DType::kUInt8);
  EXPECT_EQ(l.shape, (std::vector<int64_t>{48, 40}));
  l = quant_part_layout(nv, QuantPart::kColumnwiseScale, 48, 80);
  EXPECT_EQ(l.dtype, DType::kFP8E4M3);
  EXPECT_EQ(l.shape, (std::vector<int64_t>{128, 4}));  // [80 rows -> 128, 3 blocks -> 4]
  l = quant_part_layout(nv, QuantPart::kGlobalAmax, 48, 80);
  EXPECT_EQ(l.dtype, DType::kFP32);
  EXPECT_TRUE(l.shape.empty());
  EXPECT_EQ(quant_part_layout(config(QuantFormat::kMXFP8, QuantBlocking::k1D), QuantPart::kScale, 64, 96).dtype,
            DType::kE8M0);
  expect_error_naming([&] { quant_part_layout(fp8, QuantPart::kGlobalAmax, 4, 4); }, "stores no global amax");
}

// ---------------------------------------------------------------------------------------------
// Grouped <-> per expert, bit for bit

TEST(QuantCheckpoint, PerExpertQuantizationIsTheSliceOfTheGroupedOne) {
  // Our quantization treats each matrix of a batch on its own (blocks never cross matrices, one
  // NVFP4 global amax per matrix, every scale layout padded per matrix), so splitting the grouped
  // tensors gives exactly the per-expert quantization, in every format and layout.
  for (const Case& k : cases()) {
    const std::string fmt = format_quant_metadata(k.config);
    SCOPED_TRACE(fmt);
    const std::vector<uint16_t> x = expert_matrices(kE, k.M, k.K, 7);
    StateDict grouped, per_expert;
    add_grouped(grouped, "l.fc1.weight", k.config, x, kE, k.M, k.K);
    add_per_expert(per_expert, "l.fc1.weight", k.config, x, kE, k.M, k.K);
    // Grouped: one [E, ...] tensor per stored part; per expert: E tensors each.
    int parts = 0;
    for (QuantPart p : kQuantParts) parts += quant_stores(k.config, p);
    EXPECT_EQ(grouped.size(), static_cast<size_t>(parts));
    EXPECT_EQ(per_expert.size(), static_cast<size_t>(parts * kE));

    StateDict split = grouped;
    normalize_expert_keys(split, "l.", kE, WeightLayout::kPerExpert);
    expect_same(split, per_expert);
    normalize_expert_keys(split, "l.", kE, WeightLayout::kSingleGrouped);
    expect_same(split, grouped);

    const QuantizedParamInfo g = inspect_quantized_param(grouped, "l.fc1.weight", k.config);
    EXPECT_EQ(g.layout, WeightLayout::kSingleGrouped);
    EXPECT_EQ(g.experts, kE);
    EXPECT_EQ(g.rows, k.M);
    EXPECT_EQ(g.cols, k.K);
    const QuantizedParamInfo p = inspect_quantized_param(per_expert, "l.fc1.weight", k.config);
    EXPECT_EQ(p.layout, WeightLayout::kPerExpert);
    EXPECT_EQ(p.experts, kE);
    EXPECT_EQ(p.rows, k.M);
    EXPECT_EQ(p.cols, k.K);
  }
}

TEST(QuantCheckpoint, WhereSlicingWouldNotHold) {
  // The per-matrix blocking is what makes a slice equal the expert's own quantization. A grouped
  // weight quantized as ONE matrix [E * M, K] (a flattened Megatron weight handed to a quantizer
  // as a single tensor) breaks it:
  const int64_t M = 48, K = 96;
  const std::vector<uint16_t> x = expert_matrices(kE, M, K, 11);
  // NVFP4: one global amax for all experts instead of one per expert changes every expert's
  // encode scale, so data and block scales differ from the per-expert quantization.
  const QuantConfig nv = config(QuantFormat::kNVFP4, QuantBlocking::k1D, ScaleLayout::kRowMajor, true, false);
  const ref::Quantized flat = ref::quantize(nv, x, 1, kE * M, K);
  const ref::Quantized batched = ref::quantize(nv, x, kE, M, K);
  ASSERT_EQ(flat.rowwise_data.size(), batched.rowwise_data.size());
  EXPECT_EQ(flat.global_amax.size(), 1u);
  EXPECT_NE(flat.rowwise_data, batched.rowwise_data);
  EXPECT_NE(flat.rowwise_scale, batched.rowwise_scale);
  // ... while the expert with the largest values (the last) sets the shared amax and agrees.
  const int64_t bytes = M * K / 2;
  EXPECT_EQ(flat.global_amax[0], batched.global_amax[kE - 1]);
  EXPECT_TRUE(std::equal(flat.rowwise_data.end() - bytes, flat.rowwise_data.end(), batched.rowwise_data.end() - bytes));
  // FP8 1x128 and MXFP8 1x32 rowwise blocks lie inside one row and have no per-matrix scale: the
  // flattened rowwise copy is bitwise the batched one (with row-major scales).
  for (QuantFormat f : {QuantFormat::kFP8Block, QuantFormat::kMXFP8}) {
    const QuantConfig c = config(f, QuantBlocking::k1D, ScaleLayout::kRowMajor, true, false);
    const ref::Quantized a = ref::quantize(c, x, 1, kE * M, K), b = ref::quantize(c, x, kE, M, K);
    EXPECT_EQ(a.rowwise_data, b.rowwise_data);
    EXPECT_EQ(a.rowwise_scale, b.rowwise_scale);
  }
  // 2-D blocks whose rows cross expert boundaries (M = 48 is not a multiple of 128) and scale
  // layouts padded per matrix (swizzled to 128 rows, mn_major to 4) give other scale shapes:
  // such a tensor cannot even be split by experts.
  const QuantConfig fp8_2d = config(QuantFormat::kFP8Block, QuantBlocking::k2D, ScaleLayout::kRowMajor, true, false);
  EXPECT_NE(ref::quantize(fp8_2d, x, 1, kE * M, K).rowwise_scale.size(),
            ref::quantize(fp8_2d, x, kE, M, K).rowwise_scale.size());
  // The splitter refuses a companion whose first dimension is not E (chunks of rows would cut it).
  StateDict sd;
  sd.emplace("fc1.weight", HostTensor(DType::kFP8E4M3, {kE * M, K}));
  sd.emplace("fc1.weight_scale_inv", HostTensor(DType::kFP32, {kE * M, 1}));
  expect_error_naming([&] { normalize_expert_keys(sd, "", kE, WeightLayout::kPerExpert); },
                      "cannot split 'fc1.weight");
  EXPECT_EQ(keys(sd), (std::vector<std::string>{"fc1.weight", "fc1.weight_scale_inv"}));  // nothing moved
}

TEST(QuantCheckpoint, SafetensorsRoundTripThenSplitAndStackBitForBit) {
  // A layer as a checkpoint holds it: fc1 and fc2 quantized (different formats), biases in fp32,
  // the formats in __metadata__, and an unrelated tensor.
  for (const Case& k : cases()) {
    const std::string fmt = format_quant_metadata(k.config);
    SCOPED_TRACE(fmt);
    const std::string p = "model.layers.0.mlp.experts.";
    const int64_t H = k.K, F = k.M / 2;  // fc1 [2F, H] = [M, K], fc2 [H, F]
    const QuantConfig fc2c = config(QuantFormat::kFP8Block, QuantBlocking::k2D);  // takes any [H, F]
    StateDict grouped;
    add_grouped(grouped, p + "fc1.weight", k.config, expert_matrices(kE, 2 * F, H, 1), kE, 2 * F, H);
    add_grouped(grouped, p + "fc2.weight", fc2c, expert_matrices(kE, H, F, 2), kE, H, F);
    grouped.emplace(p + "fc1.bias", HostTensor(DType::kFP32, {kE, 2 * F}));
    grouped.emplace("model.norm.weight", HostTensor(DType::kBF16, {H}));
    Metadata meta = {{"format", "pt"}};
    set_quant_metadata(meta, p + "fc1.weight", k.config);
    set_quant_metadata(meta, p + "fc2.weight", fc2c);

    const std::string path = tmp_path("grouped.safetensors");
    save_safetensors(path, grouped, meta);
    Metadata back_meta;
    const StateDict loaded = load_safetensors(path, &back_meta);
    std::remove(path.c_str());
    expect_same(loaded, grouped);
    EXPECT_EQ(back_meta, meta);
    const auto declared = quantized_params(back_meta);
    ASSERT_EQ(declared.size(), 2u);
    EXPECT_EQ(format_quant_metadata(declared[0].config), fmt);

    StateDict per_expert;
    add_per_expert(per_expert, p + "fc1.weight", k.config, expert_matrices(kE, 2 * F, H, 1), kE, 2 * F, H);
    add_per_expert(per_expert, p + "fc2.weight", fc2c, expert_matrices(kE, H, F, 2), kE, H, F);
    for (int e = 0; e < kE; ++e)
      per_expert.emplace(p + "fc1.bias" + std::to_string(e), HostTensor(DType::kFP32, {2 * F}));
    per_expert.emplace("model.norm.weight", HostTensor(DType::kBF16, {H}));

    StateDict sd = loaded;
    normalize_expert_keys(sd, p, kE, WeightLayout::kPerExpert);
    expect_same(sd, per_expert);
    normalize_expert_keys(sd, p, kE, WeightLayout::kPerExpert);  // twice: nothing changes
    expect_same(sd, per_expert);
    normalize_expert_keys(sd, p, kE, WeightLayout::kSingleGrouped);
    expect_same(sd, grouped);
  }
}

TEST(QuantCheckpoint, QuantizationDtypesSurviveAFile) {
  // Every byte value in each dtype the formats store (E4M3 NaN 0x7F/0xFF, E8M0 255, ...), and
  // E5M2 and F4, through a file and back.
  std::vector<uint8_t> all(256);
  for (int i = 0; i < 256; ++i) all[i] = static_cast<uint8_t>(i);
  StateDict sd;
  for (DType t : {DType::kFP8E4M3, DType::kFP8E5M2, DType::kE8M0, DType::kUInt8}) {
    HostTensor h(t, {16, 16});
    std::memcpy(h.mutable_data(), all.data(), 256);
    sd.emplace(std::string("t_") + dtype_name(t), h);
  }
  HostTensor f4(DType::kFP4E2M1, {16, 32});
  std::memcpy(f4.mutable_data(), all.data(), 256);
  sd.emplace("t_f4", f4);
  const std::string path = tmp_path("dtypes.safetensors");
  save_safetensors(path, sd);
  const StateDict back = load_safetensors(path);
  std::remove(path.c_str());
  expect_same(back, sd);
  EXPECT_EQ(safetensors::dtype_to_string(back.at("t_e8m0").dtype()), std::string("F8_E8M0"));
}

// ---------------------------------------------------------------------------------------------
// Errors naming the key

struct Layer {
  StateDict grouped, per_expert;
  QuantConfig qc = config(QuantFormat::kNVFP4, QuantBlocking::k1D, ScaleLayout::kSwizzled128x4);
  Layer() {
    const std::vector<uint16_t> x = expert_matrices(kE, 48, 80, 5);
    add_grouped(grouped, "p.fc1.weight", qc, x, kE, 48, 80);
    add_per_expert(per_expert, "p.fc1.weight", qc, x, kE, 48, 80);
  }
};

TEST(QuantCheckpoint, MissingCompanionsAreNamed) {
  const Layer l;
  for (const char* gone : {"p.fc1.weight_scale_inv", "p.fc1.weight_columnwise", "p.fc1.weight_columnwise_scale_inv",
                           "p.fc1.weight_amax"}) {
    StateDict sd = l.grouped;
    sd.erase(gone);
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); },
                        std::string("missing '") + gone + "'");
  }
  StateDict sd = l.per_expert;
  sd.erase("p.fc1.weight1_columnwise_scale_inv");
  sd.erase("p.fc1.weight2_amax");
  expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); },
                      "missing 'p.fc1.weight1_columnwise_scale_inv', 'p.fc1.weight2_amax'");
  // The data itself.
  sd = l.per_expert;
  sd.erase("p.fc1.weight0");
  expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); }, "missing 'p.fc1.weight0'");
  expect_error_naming([&] { inspect_quantized_param(StateDict{}, "p.fc1.weight", l.qc); },
                      "quantized 'p.fc1.weight' (nvfp4;block=1x16;scale=e4m3;layout=swizzled_128x4;"
                      "copies=rowwise,columnwise): no tensor of it is present");
  // Stacking an incomplete per-expert set names the missing key and moves nothing, the data
  // included (every check runs before any tensor moves).
  sd = l.per_expert;
  sd.erase("p.fc1.weight2_scale_inv");
  const StateDict before = sd;
  expect_error_naming([&] { normalize_expert_keys(sd, "p.", kE, WeightLayout::kSingleGrouped); },
                      "cannot stack 'p.fc1.weight_scale_inv' for 3 experts: 2 per-expert keys are present, missing "
                      "'p.fc1.weight2_scale_inv'");
  expect_same(sd, before);
}

// A quantized expert weight without data (zero rows or columns) is refused: its expert count would not
// be bounded by the file's bytes (a 280-byte file could declare 2^31 experts of zero bytes each, and
// every per-expert step after the inspection would run, and allocate, that many times).
TEST(QuantCheckpoint, EmptyQuantizedWeightsAreRefused) {
  QuantConfig fp8;
  fp8.format = QuantFormat::kFP8Block;
  fp8.rowwise = true;
  fp8.columnwise = false;
  for (const std::vector<int64_t>& shape : {std::vector<int64_t>{1 << 30, 0, 128}, std::vector<int64_t>{4, 16, 0}}) {
    StateDict sd;
    sd["p.fc1.weight"] = HostTensor(DType::kFP8E4M3, shape);
    sd["p.fc1.weight_scale_inv"] = HostTensor(DType::kFP32, {shape[0], 0, 1});
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", fp8); }, "holds no weights");
  }
}

TEST(QuantCheckpoint, InconsistentTensorsAreNamed) {
  const Layer l;
  {
    StateDict sd = l.grouped;
    sd["p.fc1.weight_scale_inv"] = HostTensor(DType::kFP8E4M3, {kE, 48, 5});
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); },
                        "'p.fc1.weight_scale_inv' (rowwise scales) has shape [3, 48, 5], expected [3, 128, 8]");
  }
  {
    StateDict sd = l.grouped;
    sd["p.fc1.weight_amax"] = HostTensor(DType::kFP32, {kE + 1});
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); }, "'p.fc1.weight_amax'");
  }
  {
    StateDict sd = l.grouped;
    sd["p.fc1.weight_columnwise_scale_inv"] = HostTensor(DType::kFP32, {kE, 128, 4});
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); },
                        "'p.fc1.weight_columnwise_scale_inv' (columnwise scales) has dtype F32, expected F8_E4M3");
  }
  {
    StateDict sd = l.grouped;
    sd["p.fc1.weight"] = HostTensor(DType::kBF16, {kE, 48, 80});
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); },
                        "'p.fc1.weight' (rowwise data) has dtype BF16, expected U8");
  }
  {
    // One expert's scales of another shape: named, and stacking refuses it too.
    StateDict sd = l.per_expert;
    sd["p.fc1.weight1_scale_inv"] = HostTensor(DType::kFP8E4M3, {128, 4});
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); },
                        "'p.fc1.weight1_scale_inv' (rowwise scales) has shape [128, 4], expected [128, 8]");
    expect_error_naming([&] { normalize_expert_keys(sd, "p.", kE, WeightLayout::kSingleGrouped); },
                        "'p.fc1.weight1_scale_inv' is fp8_e4m3 [128, 4]");
  }
  {
    // A part the format does not store.
    StateDict sd = l.grouped;
    const QuantConfig rowwise_only = config(QuantFormat::kNVFP4, QuantBlocking::k1D, ScaleLayout::kSwizzled128x4,
                                            true, false);
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", rowwise_only); },
                        "'p.fc1.weight_columnwise' is present, but the format stores no columnwise data");
    const QuantConfig mx = config(QuantFormat::kMXFP8, QuantBlocking::k1D);
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", mx); },
                        "'p.fc1.weight_amax' is present, but the format stores no global amax");
  }
  {
    // Both layouts at once, an expert past E, a wrong expert count.
    StateDict sd = l.grouped;
    sd.emplace("p.fc1.weight0_amax", HostTensor(DType::kFP32, {}));
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); },
                        "stored both single grouped ('p.fc1.weight') and per expert ('p.fc1.weight0_amax')");
    sd = l.per_expert;
    sd.emplace("p.fc1.weight3_amax", HostTensor(DType::kFP32, {}));
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc, kE); },
                        "'p.fc1.weight3_amax' names no expert of the layer's 3");
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); },
                        "missing 'p.fc1.weight3' (rowwise data) while 'p.fc1.weight3_amax' is present");
    sd = l.per_expert;  // a gap: expert 1's data
    sd.erase("p.fc1.weight1");
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc); },
                        "missing 'p.fc1.weight1' (rowwise data) while 'p.fc1.weight1_amax' is present");
    expect_error_naming([&] { inspect_quantized_param(sd, "p.fc1.weight", l.qc, kE); }, "missing 'p.fc1.weight1'");
    expect_error_naming([&] { inspect_quantized_param(l.grouped, "p.fc1.weight", l.qc, 4); },
                        "holds 3 experts, expected 4");
  }
  {
    // Also read: NVFP4 data as F4 (shape in values) and MXFP8 scales as U8.
    StateDict sd = l.grouped;
    sd["p.fc1.weight"] = HostTensor(DType::kFP4E2M1, {kE, 48, 80});
    EXPECT_EQ(inspect_quantized_param(sd, "p.fc1.weight", l.qc).cols, 80);
    const QuantConfig mx = config(QuantFormat::kMXFP8, QuantBlocking::k1D);
    StateDict m;
    add_grouped(m, "w", mx, expert_matrices(2, 32, 64, 3), 2, 32, 64);
    HostTensor u8(DType::kUInt8, {2, 32, 2});
    std::memcpy(u8.mutable_data(), m.at("w_scale_inv").data(), u8.nbytes());
    m["w_scale_inv"] = u8;
    EXPECT_EQ(inspect_quantized_param(m, "w", mx).rows, 32);
  }
}

// ---------------------------------------------------------------------------------------------
// convert_state_dict

struct QuantModel {
  StateDict grouped, per_expert;
  Metadata meta;
};

// Two expert layers: layer 0 quantized (fc1 MXFP8 with swizzled scales, fc2 NVFP4, an fp32 fc2
// bias), layer 1 in fp32; and an unrelated tensor.
QuantModel quant_model() {
  QuantModel m;
  const int64_t H = 64, F = 32;
  const QuantConfig fc1 = config(QuantFormat::kMXFP8, QuantBlocking::k1D, ScaleLayout::kSwizzled128x4);
  const QuantConfig fc2 = config(QuantFormat::kNVFP4, QuantBlocking::k1D);
  const std::string q = "layers.0.mlp.experts.", u = "layers.1.mlp.experts.";
  const auto x1 = expert_matrices(kE, 2 * F, H, 21), x2 = expert_matrices(kE, H, F, 22);
  add_grouped(m.grouped, q + "fc1.weight", fc1, x1, kE, 2 * F, H);
  add_grouped(m.grouped, q + "fc2.weight", fc2, x2, kE, H, F);
  add_per_expert(m.per_expert, q + "fc1.weight", fc1, x1, kE, 2 * F, H);
  add_per_expert(m.per_expert, q + "fc2.weight", fc2, x2, kE, H, F);
  HostTensor bias(DType::kFP32, {kE, H});
  for (int64_t i = 0; i < kE * H; ++i) reinterpret_cast<float*>(bias.mutable_data())[i] = static_cast<float>(i);
  m.grouped.emplace(q + "fc2.bias", bias);
  for (int e = 0; e < kE; ++e) {
    HostTensor b(DType::kFP32, {H});
    std::memcpy(b.mutable_data(), bias.data() + e * H * 4, H * 4);
    m.per_expert.emplace(q + "fc2.bias" + std::to_string(e), b);
  }
  HostTensor w1(DType::kFP32, {kE, 2 * F, H}), w2(DType::kFP32, {kE, H, F});
  for (int64_t i = 0; i < w1.numel(); ++i) reinterpret_cast<float*>(w1.mutable_data())[i] = static_cast<float>(i % 97);
  m.grouped.emplace(u + "fc1.weight", w1);
  m.grouped.emplace(u + "fc2.weight", w2);
  for (int e = 0; e < kE; ++e) {
    HostTensor a(DType::kFP32, {2 * F, H});
    std::memcpy(a.mutable_data(), w1.data() + e * a.nbytes(), a.nbytes());
    m.per_expert.emplace(u + "fc1.weight" + std::to_string(e), a);
    m.per_expert.emplace(u + "fc2.weight" + std::to_string(e), HostTensor(DType::kFP32, {H, F}));
  }
  for (StateDict* sd : {&m.grouped, &m.per_expert}) sd->emplace("lm_head.weight", HostTensor(DType::kBF16, {8, H}));
  m.meta = {{"format", "pt"}};
  set_quant_metadata(m.meta, q + "fc1.weight", fc1);
  set_quant_metadata(m.meta, q + "fc2.weight", fc2);
  return m;
}

ConvertOptions options(const char* from, const char* to) {
  ConvertOptions o;
  o.from = CheckpointFormat::parse(from);
  o.to = CheckpointFormat::parse(to);
  return o;
}

TEST(QuantCheckpoint, ConvertMovesQuantizedLayersBitForBit) {
  QuantModel m = quant_model();  // convert_state_dict may update m.meta
  StateDict sd = m.grouped;
  const auto layers = convert_state_dict(sd, options("grouped", "per-expert"), m.meta);
  EXPECT_EQ(layers, (std::vector<std::string>{"layers.0.mlp.experts.", "layers.1.mlp.experts."}));
  expect_same(sd, m.per_expert);
  convert_state_dict(sd, options("per-expert", "grouped"), m.meta);
  expect_same(sd, m.grouped);
  // Only the quantized layer, selected by prefix.
  ConvertOptions only = options("grouped", "per-expert");
  only.prefixes = {"layers.0.mlp.experts."};
  sd = m.grouped;
  EXPECT_EQ(convert_state_dict(sd, only, m.meta), (std::vector<std::string>{"layers.0.mlp.experts."}));
  EXPECT_TRUE(sd.count("layers.0.mlp.experts.fc1.weight2_columnwise_scale_inv"));
  EXPECT_TRUE(sd.count("layers.1.mlp.experts.fc1.weight"));
  // The same E given explicitly; a wrong one is refused.
  ConvertOptions e3 = options("grouped", "per-expert");
  e3.experts = kE;
  sd = m.grouped;
  convert_state_dict(sd, e3, m.meta);
  expect_same(sd, m.per_expert);
  e3.experts = 4;
  sd = m.grouped;
  expect_error_naming([&] { convert_state_dict(sd, e3, m.meta); }, "holds 3 experts, expected 4");
}

// A quantized layer's other tensors move with it only when they make one expert MLP with its
// quantized weights: an undeclared weight is checked as an unquantized one (no companions, a float
// dtype, E experts, the MLP's shapes), the biases by their shape and dtype.
TEST(QuantCheckpoint, ConvertChecksTheRestOfAQuantizedLayer) {
  QuantModel m = quant_model();  // convert_state_dict may update m.meta
  const std::string q = "layers.0.mlp.experts.";
  Metadata fc1_only;
  for (const auto& kv : m.meta)
    if (kv.first != quant_metadata_key(q + "fc2.weight")) fc1_only.push_back(kv);
  StateDict sd = m.grouped;
  expect_error_naming([&] { convert_state_dict(sd, options("grouped", "per-expert"), fc1_only); },
                      "'" + q + "fc2.weight_scale_inv' is present, but __metadata__ has no");
  // fc2 stored unquantized: E experts of [H, F] move along; other shapes are refused.
  StateDict plain = m.grouped;
  for (auto it = plain.begin(); it != plain.end();)
    it = it->first.rfind(q + "fc2.weight", 0) == 0 ? plain.erase(it) : std::next(it);
  plain.emplace(q + "fc2.weight", HostTensor(DType::kBF16, {kE, 64, 32}));
  sd = plain;
  convert_state_dict(sd, options("grouped", "per-expert"), fc1_only);
  EXPECT_TRUE(sd.count(q + "fc2.weight2"));
  for (const std::vector<int64_t>& bad : {std::vector<int64_t>{2 * kE, 64, 32}, std::vector<int64_t>{kE, 48, 32},
                                          std::vector<int64_t>{kE, 64, 40}}) {
    sd = plain;
    sd[q + "fc2.weight"] = HostTensor(DType::kBF16, bad);
    expect_error_naming([&] { convert_state_dict(sd, options("grouped", "per-expert"), fc1_only); }, q);
  }
  sd = plain;
  sd[q + "fc2.weight"] = HostTensor(DType::kInt64, {kE, 64, 32});
  expect_error_naming([&] { convert_state_dict(sd, options("grouped", "per-expert"), fc1_only); }, "has dtype");
  // Biases: the right number of values, a float dtype.
  sd = m.grouped;
  sd[q + "fc2.bias"] = HostTensor(DType::kFP64, {kE, 64});
  expect_error_naming([&] { convert_state_dict(sd, options("grouped", "per-expert"), m.meta); }, "has dtype");
  sd = m.grouped;
  sd[q + "fc2.bias"] = HostTensor(DType::kFP32, {kE, 9});
  expect_error_naming([&] { convert_state_dict(sd, options("grouped", "per-expert"), m.meta); },
                      "holds 9 values an expert, expected 64");
  sd = m.grouped;
  sd[q + "fc1.bias"] = HostTensor(DType::kInt32, {kE, 64});
  expect_error_naming([&] { convert_state_dict(sd, options("grouped", "per-expert"), m.meta); }, "has dtype");
}

TEST(QuantCheckpoint, ConvertRefusesWhatWouldNeedRequantization) {
  QuantModel m = quant_model();  // convert_state_dict may update m.meta
  StateDict sd = m.grouped;
  expect_error_naming([&] { convert_state_dict(sd, options("grouped", "hf:mixtral"), m.meta); },
                      "the experts under 'layers.0.mlp.experts.' are quantized (fc1.weight mxfp8, fc2.weight nvfp4)");
  ConvertOptions inter = options("grouped", "per-expert");
  inter.to_glu_interleave = 16;
  expect_error_naming([&] { convert_state_dict(sd, inter, m.meta); }, "argument 'to_glu_interleave'");
  expect_error_naming([&] { convert_state_dict(sd, options("per-expert", "grouped"), m.meta); },
                      "input declared per-expert, but the experts under 'layers.");
  // Without the metadata, companion tensors are not taken for an unquantized weight.
  expect_error_naming([&] { convert_state_dict(sd, options("grouped", "per-expert")); },
                      "'layers.0.mlp.experts.fc1.weight_scale_inv' is present, but __metadata__ has no "
                      "'moe.quant.layers.0.mlp.experts.fc1.weight'");
  // So is a stray companion of any expert of an unquantized layer, not only of expert 0.
  StateDict stray = m.per_expert;
  stray.emplace("layers.1.mlp.experts.fc1.weight1_scale_inv", HostTensor(DType::kFP32, {1}));
  expect_error_naming([&] { convert_state_dict(stray, options("per-expert", "grouped"), m.meta); },
                      "'layers.1.mlp.experts.fc1.weight1_scale_inv' is present, but __metadata__ has no "
                      "'moe.quant.layers.1.mlp.experts.fc1.weight'");
  // A missing companion is named, and the dict is left as it was.
  sd.erase("layers.0.mlp.experts.fc2.weight_amax");
  const StateDict before = sd;
  expect_error_naming([&] { convert_state_dict(sd, options("grouped", "per-expert"), m.meta); },
                      "missing 'layers.0.mlp.experts.fc2.weight_amax'");
  expect_same(sd, before);
  // Metadata that declares another format than the tensors hold.
  Metadata wrong = m.meta;
  set_quant_metadata(wrong, "layers.0.mlp.experts.fc1.weight", config(QuantFormat::kFP8Block, QuantBlocking::k1D));
  sd = m.grouped;
  expect_error_naming([&] { convert_state_dict(sd, options("grouped", "per-expert"), wrong); },
                      "'layers.0.mlp.experts.fc1.weight_scale_inv' (rowwise scales) has dtype F8_E8M0, expected F32");
}

// The values a quantized parameter decodes to, [E, M, K]: per expert (each quantized on its own, as
// add_per_expert stores them) or as one batch.
std::vector<float> decoded(const QuantConfig& c, const std::vector<uint16_t>& x, int E, int64_t M, int64_t K,
                           bool per_expert) {
  if (!per_expert) return ref::dequantize(c, ref::quantize(c, x, E, M, K), false, E, M, K);
  std::vector<float> v;
  for (int e = 0; e < E; ++e) {
    const std::vector<uint16_t> one(x.begin() + e * M * K, x.begin() + (e + 1) * M * K);
    const std::vector<float> d = ref::dequantize(c, ref::quantize(c, one, 1, M, K), false, 1, M, K);
    v.insert(v.end(), d.begin(), d.end());
  }
  return v;
}

TEST(QuantCheckpoint, DequantizeWritesTheValuesTheLayersDecodeTo) {
  // quant_model's layer 0 (fc1 MXFP8 with swizzled scales, fc2 NVFP4 with its global amax, an fp32 fc2
  // bias, and here an fp32 fc1 bias) from either layout, into fp32 and bf16: the reference
  // dequantizer's values (bf16: rounded once); layer 1 (fp32) and the rest as they were, no
  // "moe.quant." entry left.
  const int64_t H = 64, F = 32;
  const std::string q = "layers.0.mlp.experts.";
  const QuantConfig fc1 = config(QuantFormat::kMXFP8, QuantBlocking::k1D, ScaleLayout::kSwizzled128x4);
  const QuantConfig fc2 = config(QuantFormat::kNVFP4, QuantBlocking::k1D);
  const auto x1 = expert_matrices(kE, 2 * F, H, 21), x2 = expert_matrices(kE, H, F, 22);
  QuantModel m = quant_model();
  {
    // An unquantized layer has both biases or neither: with fc2's alone, the missing one is named.
    StateDict sd = m.grouped;
    Metadata meta = m.meta;
    ConvertOptions o = options("grouped", "grouped");
    o.dequantize = DType::kFP32;
    expect_error_naming([&] { convert_state_dict(sd, o, meta); }, "missing '" + q + "fc1.bias'");
  }
  std::vector<float> bias1(kE * 2 * F, 0.5f);
  m.grouped.emplace(q + "fc1.bias", HostTensor(DType::kFP32, {kE, 2 * F}));
  std::memcpy(m.grouped.at(q + "fc1.bias").mutable_data(), bias1.data(), bias1.size() * 4);
  for (int e = 0; e < kE; ++e) {
    HostTensor b(DType::kFP32, {2 * F});
    std::memcpy(b.mutable_data(), bias1.data(), 2 * F * 4);
    m.per_expert.emplace(q + "fc1.bias" + std::to_string(e), b);
  }
  for (const char* from : {"grouped", "per-expert"}) {
    for (DType dt : {DType::kFP32, DType::kBF16}) {
      SCOPED_TRACE(std::string(from) + " to " + dtype_name(dt));
      const bool per_expert = std::string(from) == "per-expert";
      StateDict sd = per_expert ? m.per_expert : m.grouped;
      Metadata meta = m.meta;
      ConvertOptions o = options(from, "grouped");
      o.dequantize = dt;
      convert_state_dict(sd, o, meta);
      EXPECT_EQ(meta, (Metadata{{"format", "pt"}}));
      expect_values(sd.at(q + "fc1.weight"), dt, decoded(fc1, x1, kE, 2 * F, H, per_expert), q + "fc1.weight");
      expect_values(sd.at(q + "fc2.weight"), dt, decoded(fc2, x2, kE, H, F, per_expert), q + "fc2.weight");
      std::vector<float> bias(kE * H);
      for (size_t i = 0; i < bias.size(); ++i) bias[i] = static_cast<float>(i);
      expect_values(sd.at(q + "fc2.bias"), dt, bias, q + "fc2.bias");
      expect_values(sd.at(q + "fc1.bias"), dt, bias1, q + "fc1.bias");
      for (const auto& [k, t] : sd) EXPECT_EQ(k.find("_scale_inv"), std::string::npos) << k;
      EXPECT_TRUE(sd.at("layers.1.mlp.experts.fc1.weight").equals(m.grouped.at("layers.1.mlp.experts.fc1.weight")));
      EXPECT_TRUE(sd.at("lm_head.weight").equals(m.grouped.at("lm_head.weight")));
    }
  }
  // The rest of the layer is checked as when it moves: a bias of no expert, a bias in both layouts, and a
  // weight with companions but no declaration are refused by name.
  {
    ConvertOptions o = options("grouped", "grouped");
    o.dequantize = DType::kFP32;
    StateDict stray = m.grouped;
    stray.emplace(q + "fc2.bias7", HostTensor(DType::kFP32, {H}));
    Metadata meta = m.meta;
    expect_error_naming([&] { convert_state_dict(stray, o, meta); }, "'" + q + "fc2.bias7' names no expert");
    StateDict both = m.grouped;
    for (int e = 0; e < kE; ++e) both.emplace(q + "fc2.bias" + std::to_string(e), HostTensor(DType::kFP32, {H}));
    expect_error_naming([&] { convert_state_dict(both, o, meta); }, "'" + q + "fc2.bias0' of the experts under '" + q +
                                                                        "' is stored in both layouts");
    StateDict undeclared = m.grouped;
    Metadata fc1_only = {{"format", "pt"}};
    set_quant_metadata(fc1_only, q + "fc1.weight", fc1);
    expect_error_naming([&] { convert_state_dict(undeclared, o, fc1_only); },
                        "'" + q + "fc2.weight_scale_inv' is present, but __metadata__ has no");
  }
  // A weight stored as its columnwise copy only: decoded from it, transposed back.
  const QuantConfig col = config(QuantFormat::kNVFP4, QuantBlocking::k1D, ScaleLayout::kRowMajor, false, true);
  const int64_t M = 48, K = 80;  // fc1 [2F, H] with F = 24, H = 80
  const auto x = expert_matrices(kE, M, K, 5);
  StateDict sd;
  Metadata meta;
  add_grouped(sd, q + "fc1.weight", col, x, kE, M, K);
  set_quant_metadata(meta, q + "fc1.weight", col);
  sd.emplace(q + "fc2.weight", HostTensor(DType::kBF16, {kE, K, M / 2}));
  ConvertOptions o = options("grouped", "grouped");
  o.dequantize = DType::kFP32;
  convert_state_dict(sd, o, meta);
  const std::vector<float> cw = ref::dequantize(col, ref::quantize(col, x, kE, M, K), true, kE, M, K);
  std::vector<float> want(cw.size());
  for (int e = 0; e < kE; ++e)
    for (int64_t r = 0; r < M; ++r)
      for (int64_t c = 0; c < K; ++c) want[(e * M + r) * K + c] = cw[(e * K + c) * M + r];
  expect_values(sd.at(q + "fc1.weight"), DType::kFP32, want, q + "fc1.weight");
  EXPECT_FALSE(sd.count(q + "fc1.weight_columnwise"));
}

TEST(QuantCheckpoint, QuantizedDenseTensorsAreNotExperts) {
  // A quantized 2-D fc1/fc2 pair (an ordinary MLP) is declared in the metadata but stays as it is.
  QuantModel m = quant_model();
  const QuantConfig c = config(QuantFormat::kFP8Block, QuantBlocking::k2D);
  const auto x = expert_matrices(1, 128, 64, 3);
  StateDict dense;
  ::moe::testing::add_quantized(dense, "vision.mlp.fc1.weight", c, ref::quantize(c, x, 1, 128, 64), 1, 128, 64, false);
  ::moe::testing::add_quantized(dense, "vision.mlp.fc2.weight", c, ref::quantize(c, x, 1, 128, 64), 1, 128, 64, false);
  for (auto& kv : dense) {
    m.grouped.insert(kv);
    m.per_expert.insert(kv);
  }
  set_quant_metadata(m.meta, "vision.mlp.fc1.weight", c);
  set_quant_metadata(m.meta, "vision.mlp.fc2.weight", c);
  StateDict sd = m.grouped;
  convert_state_dict(sd, options("grouped", "per-expert"), m.meta);
  expect_same(sd, m.per_expert);
  // Nor does dequantizing touch them: they are declared in our format (their rowwise companion is named
  // like Hugging Face's FP8 scales, but their columnwise copy and declaration would be left behind).
  sd = m.grouped;
  ConvertOptions o = options("grouped", "grouped");
  o.dequantize = DType::kBF16;
  o.prefixes = {"layers.1.mlp.experts."};  // (layer 0, with fc2's bias alone, left as it is)
  convert_state_dict(sd, o, m.meta);
  for (const auto& kv : dense) EXPECT_TRUE(sd.count(kv.first) && sd.at(kv.first).equals(kv.second)) << kv.first;
}

}  // namespace
}  // namespace moe
