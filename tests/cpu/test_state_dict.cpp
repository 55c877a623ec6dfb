// State dicts: the layout normalisation of docs/semantics.md case by case, and ExpertWeights
// (load/save in both layouts, GLU interleave, casts, views, reference pointer tables).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/reference_weights.h"
#include "moe/checkpoint.h"
#include "moe/error.h"
#include "moe/state_dict.h"
#include "support/expect_error.h"

namespace moe {
namespace {

using ::moe::testing::expect_error_naming;

// An fp32 tensor whose element i is base + i.
HostTensor iota(std::vector<int64_t> shape, float base) {
  HostTensor t(DType::kFP32, std::move(shape));
  float* p = reinterpret_cast<float*>(t.mutable_data());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = base + static_cast<float>(i);
  return t;
}

float at(const HostTensor& t, int64_t i) { return reinterpret_cast<const float*>(t.data())[i]; }

std::vector<std::string> keys(const StateDict& sd) {
  std::vector<std::string> k;
  for (const auto& kv : sd) k.push_back(kv.first);
  return k;
}

// ---------------------------------------------------------------------------------------------
// normalize_expert_keys

TEST(NormalizeExpertKeys, FoldsPerExpertIntoGrouped) {
  StateDict sd;
  for (int e = 0; e < 3; ++e) sd.emplace("l.fc1.weight" + std::to_string(e), iota({4, 2}, 100.0f * e));
  sd.emplace("other", iota({1}, 0));
  normalize_expert_keys(sd, "l.", 3, WeightLayout::kSingleGrouped);
  EXPECT_EQ(keys(sd), (std::vector<std::string>{"l.fc1.weight", "other"}));
  const HostTensor& g = sd.at("l.fc1.weight");
  EXPECT_EQ(g.shape(), (std::vector<int64_t>{3, 4, 2}));
  for (int e = 0; e < 3; ++e)
    for (int i = 0; i < 8; ++i) EXPECT_EQ(at(g, e * 8 + i), 100.0f * e + i);
}

TEST(NormalizeExpertKeys, SplitsGroupedIntoPerExpert) {
  StateDict sd;
  sd.emplace("fc2.weight", iota({2, 3, 4}, 0));
  normalize_expert_keys(sd, "", 2, WeightLayout::kPerExpert);
  EXPECT_EQ(keys(sd), (std::vector<std::string>{"fc2.weight0", "fc2.weight1"}));
  EXPECT_EQ(sd.at("fc2.weight1").shape(), (std::vector<int64_t>{3, 4}));
  EXPECT_EQ(at(sd.at("fc2.weight1"), 0), 12.0f);
}

TEST(NormalizeExpertKeys, SplitsAMultipleOfEEvenly) {
  // Megatron-style stacked rows: [E * rows, cols] -> E chunks [rows, cols].
  StateDict sd;
  sd.emplace("fc1.weight", iota({6, 2}, 0));
  normalize_expert_keys(sd, "", 3, WeightLayout::kPerExpert);
  ASSERT_EQ(sd.size(), 3u);
  EXPECT_EQ(sd.at("fc1.weight2").shape(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(at(sd.at("fc1.weight2"), 0), 8.0f);
  StateDict bad;
  bad.emplace("fc1.weight", iota({5, 2}, 0));
  expect_error_naming([&] { normalize_expert_keys(bad, "", 3, WeightLayout::kPerExpert); }, "'fc1.weight'");
  StateDict scalar;
  scalar.emplace("fc1.weight", iota({}, 0));
  expect_error_naming([&] { normalize_expert_keys(scalar, "", 1, WeightLayout::kPerExpert); }, "cannot split");
}

TEST(NormalizeExpertKeys, BothDirectionsRoundTrip) {
  StateDict sd;
  sd.emplace("x.fc1.weight", iota({4, 6, 3}, 0));
  sd.emplace("x.fc2.weight", iota({4, 3, 3}, 1000));
  sd.emplace("x.fc1.bias", iota({4, 6}, 2000));
  sd.emplace("x.fc2.bias", iota({4, 3}, 3000));
  const StateDict original = sd;
  normalize_expert_keys(sd, "x.", 4, WeightLayout::kPerExpert);
  EXPECT_EQ(sd.size(), 16u);
  EXPECT_EQ(sd.at("x.fc1.bias3").shape(), (std::vector<int64_t>{6}));
  EXPECT_EQ(at(sd.at("x.fc2.bias1"), 0), 3003.0f);
  normalize_expert_keys(sd, "x.", 4, WeightLayout::kSingleGrouped);
  ASSERT_EQ(keys(sd), keys(original));
  for (const auto& [k, t] : original) EXPECT_TRUE(sd.at(k).equals(t)) << k;
}

TEST(NormalizeExpertKeys, BiasFoldsLikeWeights) {
  StateDict sd;
  sd.emplace("fc1.bias0", iota({4}, 0));
  sd.emplace("fc1.bias1", iota({4}, 10));
  normalize_expert_keys(sd, "", 2, WeightLayout::kSingleGrouped);
  EXPECT_EQ(sd.at("fc1.bias").shape(), (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(at(sd.at("fc1.bias"), 5), 11.0f);
}

TEST(NormalizeExpertKeys, IncompleteSetIsAnErrorNamingTheMissingKeys) {
  StateDict sd;
  sd.emplace("m.fc1.weight0", iota({2, 2}, 0));
  sd.emplace("m.fc1.weight2", iota({2, 2}, 0));
  try {
    normalize_expert_keys(sd, "m.", 4, WeightLayout::kSingleGrouped);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("'m.fc1.weight1'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'m.fc1.weight3'"), std::string::npos) << msg;
    EXPECT_EQ(msg.find("'m.fc1.weight0'"), std::string::npos) << msg;
  }
  EXPECT_EQ(sd.size(), 2u);  // nothing half-done
  // An expert count in the billions (from a command line or a file) is checked by walking the keys
  // present, not by trying every index: the first 16 missing named, the rest counted.
  expect_error_naming([&] { normalize_expert_keys(sd, "m.", 1 << 30, WeightLayout::kSingleGrouped); },
                      "'m.fc1.weight1', 'm.fc1.weight3', 'm.fc1.weight4'");
  expect_error_naming([&] { normalize_expert_keys(sd, "m.", 1 << 30, WeightLayout::kSingleGrouped); },
                      "and " + std::to_string((1 << 30) - 2 - 16) + " more");
  // Keys that only look like an expert's (a leading zero, an index past E) are not taken for one.
  StateDict odd;
  odd.emplace("m.fc1.weight00", iota({2, 2}, 0));
  odd.emplace("m.fc1.weight7", iota({2, 2}, 0));
  normalize_expert_keys(odd, "m.", 4, WeightLayout::kSingleGrouped);
  EXPECT_EQ(odd.size(), 2u);
  // Per-expert tensors must agree to be stacked.
  StateDict mixed;
  mixed.emplace("fc1.weight0", iota({2, 2}, 0));
  mixed.emplace("fc1.weight1", iota({2, 3}, 0));
  expect_error_naming([&] { normalize_expert_keys(mixed, "", 2, WeightLayout::kSingleGrouped); }, "'fc1.weight1'");
}

TEST(NormalizeExpertKeys, PresentTargetIsNeverOverwritten) {
  // Grouped target: P.weight present, per-expert keys too -> both left as they are.
  StateDict sd;
  sd.emplace("fc1.weight", iota({2, 2, 2}, 0));
  sd.emplace("fc1.weight0", iota({2, 2}, 50));
  sd.emplace("fc1.weight1", iota({2, 2}, 60));
  const StateDict before = sd;
  normalize_expert_keys(sd, "", 2, WeightLayout::kSingleGrouped);
  ASSERT_EQ(keys(sd), keys(before));
  for (const auto& [k, t] : before) EXPECT_TRUE(sd.at(k).equals(t)) << k;
  // Per-expert target: a P.weight{i} present -> P.weight is not split (even if some are missing).
  StateDict pe;
  pe.emplace("fc1.weight", iota({2, 2, 2}, 0));
  pe.emplace("fc1.weight1", iota({2, 2}, 60));
  normalize_expert_keys(pe, "", 2, WeightLayout::kPerExpert);
  EXPECT_EQ(keys(pe), (std::vector<std::string>{"fc1.weight", "fc1.weight1"}));
  EXPECT_EQ(at(pe.at("fc1.weight1"), 0), 60.0f);
}

TEST(NormalizeExpertKeys, NoDoubleConversion) {
  // Normalising an already-normalised dict changes nothing, in both layouts; absent keys stay absent.
  for (WeightLayout layout : {WeightLayout::kSingleGrouped, WeightLayout::kPerExpert}) {
    StateDict sd;
    sd.emplace("fc1.weight", iota({2, 4, 3}, 0));
    sd.emplace("fc2.weight0", iota({3, 2}, 0));
    sd.emplace("fc2.weight1", iota({3, 2}, 6));
    normalize_expert_keys(sd, "", 2, layout);
    const StateDict once = sd;
    normalize_expert_keys(sd, "", 2, layout);
    ASSERT_EQ(keys(sd), keys(once));
    for (const auto& [k, t] : once) EXPECT_TRUE(sd.at(k).equals(t)) << k;
    EXPECT_FALSE(sd.count("fc1.bias") || sd.count("fc1.bias0"));
  }
  // A grouped [E, ...] tensor is split once into [...] slices, never again into rows.
  StateDict sd;
  sd.emplace("fc1.weight", iota({2, 4, 3}, 0));
  normalize_expert_keys(sd, "", 2, WeightLayout::kPerExpert);
  normalize_expert_keys(sd, "", 2, WeightLayout::kPerExpert);
  EXPECT_EQ(sd.at("fc1.weight0").shape(), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(sd.size(), 2u);
}

TEST(NormalizeExpertKeys, LeavesOtherPrefixesAlone) {
  StateDict sd;
  sd.emplace("a.fc1.weight0", iota({2}, 0));
  sd.emplace("b.fc1.weight0", iota({2}, 0));
  normalize_expert_keys(sd, "a.", 1, WeightLayout::kSingleGrouped);
  EXPECT_EQ(keys(sd), (std::vector<std::string>{"a.fc1.weight", "b.fc1.weight0"}));
  expect_error_naming([&] { normalize_expert_keys(sd, "", 0, WeightLayout::kPerExpert); }, "num_experts");
}

TEST(NormalizeExpertKeys, SplittingABorrowedTensorCopies) {
  std::vector<float> backing = {1, 2, 3, 4};
  HostTensor t = HostTensor::borrow(DType::kFP32, {2, 2}, reinterpret_cast<const uint8_t*>(backing.data()), nullptr);
  StateDict sd;
  sd.emplace("fc1.weight", t);
  normalize_expert_keys(sd, "", 2, WeightLayout::kPerExpert);
  EXPECT_FALSE(sd.at("fc1.weight1").is_borrowed());
  EXPECT_EQ(at(sd.at("fc1.weight1"), 1), 4.0f);
}

// ---------------------------------------------------------------------------------------------
// ExpertWeights

ExpertWeightsSpec small_spec(WeightLayout layout, bool bias, int glu = 0) {
  ExpertWeightsSpec s;
  s.hidden = 8;
  s.ffn = 16;
  s.experts = 3;
  s.activation.kind = Activation::kSwiGLU;
  s.activation.glu_interleave = glu;
  s.bias = bias;
  s.layout = layout;
  return s;
}

// Distinct values everywhere (exact in bf16 too: small integers).
ExpertWeights filled(const ExpertWeightsSpec& s, DType dtype = DType::kFP32) {
  ExpertWeights w(s, DType::kFP32);
  int v = 0;
  for (Param p : {Param::kFc1Weight, Param::kFc1Bias, Param::kFc2Weight, Param::kFc2Bias}) {
    if (!s.has(p)) continue;
    int64_t n = 1;
    for (int64_t d : s.expert_shape(p)) n *= d;
    for (int e = 0; e < s.experts; ++e) {
      float* f = reinterpret_cast<float*>(w.mutable_expert_data(p, e));
      for (int64_t i = 0; i < n; ++i) f[i] = static_cast<float>((v++ % 500) - 250);
    }
  }
  return dtype == DType::kFP32 ? w : w.cast(dtype);
}

TEST(ExpertWeights, SavesAndLoadsInBothLayouts) {
  for (bool bias : {false, true}) {
    for (WeightLayout layout : {WeightLayout::kSingleGrouped, WeightLayout::kPerExpert}) {
      const ExpertWeights w = filled(small_spec(layout, bias));
      const StateDict sd = w.to_state_dict("decoder.layers.3.mlp.experts.");
      EXPECT_EQ(sd.size(), (bias ? 4u : 2u) * (layout == WeightLayout::kPerExpert ? 3u : 1u));
      if (layout == WeightLayout::kSingleGrouped) {
        EXPECT_EQ(sd.at("decoder.layers.3.mlp.experts.fc1.weight").shape(), (std::vector<int64_t>{3, 32, 8}));
        EXPECT_EQ(sd.at("decoder.layers.3.mlp.experts.fc2.weight").shape(), (std::vector<int64_t>{3, 8, 16}));
      } else {
        EXPECT_EQ(sd.at("decoder.layers.3.mlp.experts.fc1.weight2").shape(), (std::vector<int64_t>{32, 8}));
      }
      // Load into either layout: the same values per expert.
      for (WeightLayout target : {WeightLayout::kSingleGrouped, WeightLayout::kPerExpert}) {
        ExpertWeightsSpec s = w.spec();
        s.layout = target;
        const ExpertWeights back = ExpertWeights::from_state_dict(sd, s, "decoder.layers.3.mlp.experts.");
        EXPECT_TRUE(back.equals(w.with_layout(target)));
        for (int e = 0; e < 3; ++e)
          EXPECT_EQ(std::memcmp(back.expert_data(Param::kFc2Weight, e), w.expert_data(Param::kFc2Weight, e), 8 * 16 * 4),
                    0);
      }
    }
  }
}

TEST(ExpertWeights, LoadingBorrowsWithoutCopying) {
  const ExpertWeights w = filled(small_spec(WeightLayout::kSingleGrouped, false));
  const StateDict sd = w.to_state_dict();
  const ExpertWeights back = ExpertWeights::from_state_dict(sd, w.spec());
  EXPECT_EQ(back.tensors(Param::kFc1Weight)[0].data(), sd.at("fc1.weight").data());
}

TEST(ExpertWeights, AcceptsFlattenedGroupedTensors) {
  const ExpertWeights w = filled(small_spec(WeightLayout::kSingleGrouped, true));
  StateDict sd = w.to_state_dict();
  sd["fc1.weight"] = sd.at("fc1.weight").reshaped({3 * 32, 8});
  sd["fc2.bias"] = sd.at("fc2.bias").reshaped({3 * 8});
  EXPECT_TRUE(ExpertWeights::from_state_dict(sd, w.spec()).equals(w));
}

TEST(ExpertWeights, RejectsWhatDoesNotFit) {
  const ExpertWeightsSpec s = small_spec(WeightLayout::kSingleGrouped, true);
  const StateDict good = filled(s).to_state_dict("p.");
  {
    StateDict sd = good;
    sd.erase("p.fc2.bias");
    expect_error_naming([&] { ExpertWeights::from_state_dict(sd, s, "p."); }, "missing 'p.fc2.bias'");
  }
  {
    StateDict sd = good;
    sd["p.fc2.weight"] = iota({3, 8, 15}, 0);
    expect_error_naming([&] { ExpertWeights::from_state_dict(sd, s, "p."); }, "'p.fc2.weight' has shape [3, 8, 15]");
  }
  {
    StateDict sd = good;
    sd["p.fc1.bias"] = HostTensor(DType::kBF16, {3, 32});
    expect_error_naming([&] { ExpertWeights::from_state_dict(sd, s, "p."); }, "'p.fc1.bias' has dtype bf16");
  }
  {
    StateDict sd = good;
    sd["p.fc1.bias"] = HostTensor(DType::kInt32, {3, 32});
    expect_error_naming([&] { ExpertWeights::from_state_dict(sd, s, "p."); }, "expected bf16, fp16, fp32 or fp64");
  }
  {
    ExpertWeightsSpec nb = s;
    nb.bias = false;
    expect_error_naming([&] { ExpertWeights::from_state_dict(good, nb, "p."); }, "'p.fc1.bias' is present");
  }
  {
    StateDict sd = filled(small_spec(WeightLayout::kPerExpert, false)).to_state_dict();
    sd["fc1.weight3"] = sd.at("fc1.weight0");
    ExpertWeightsSpec pe = small_spec(WeightLayout::kPerExpert, false);
    expect_error_naming([&] { ExpertWeights::from_state_dict(sd, pe); }, "'fc1.weight3' names no expert");
    sd.erase("fc1.weight3");
    sd.erase("fc1.weight1");
    expect_error_naming([&] { ExpertWeights::from_state_dict(sd, pe); }, "missing 'fc1.weight1'");
  }
  ExpertWeightsSpec bad = s;
  bad.activation.glu_interleave = 12;  // does not divide F = 16
  expect_error_naming([&] { ExpertWeights(bad, DType::kFP32); }, "interleave");
  expect_error_naming([&] { ExpertWeights(s, DType::kInt32); }, "'dtype'");
}

TEST(ExpertWeights, GluInterleaveMovesRowsOnly) {
  const ExpertWeights plain = filled(small_spec(WeightLayout::kPerExpert, true, 0));
  const ExpertWeights inter = plain.with_glu_interleave(8);
  EXPECT_EQ(inter.spec().activation.glu_interleave, 8);
  const int64_t F = 16, H = 8;
  for (int e = 0; e < 3; ++e) {
    const float* a = reinterpret_cast<const float*>(plain.expert_data(Param::kFc1Weight, e));
    const float* b = reinterpret_cast<const float*>(inter.expert_data(Param::kFc1Weight, e));
    const float* ab = reinterpret_cast<const float*>(plain.expert_data(Param::kFc1Bias, e));
    const float* bb = reinterpret_cast<const float*>(inter.expert_data(Param::kFc1Bias, e));
    for (int64_t j = 0; j < F; ++j) {
      // Interleave 8: rows [g0..7 | l0..7 | g8..15 | l8..15].
      const int64_t g = (j / 8) * 16 + j % 8, l = g + 8;
      for (int64_t h = 0; h < H; ++h) {
        EXPECT_EQ(b[g * H + h], a[j * H + h]);
        EXPECT_EQ(b[l * H + h], a[(F + j) * H + h]);
      }
      EXPECT_EQ(bb[g], ab[j]);
      EXPECT_EQ(bb[l], ab[F + j]);
    }
    EXPECT_EQ(std::memcmp(plain.expert_data(Param::kFc2Weight, e), inter.expert_data(Param::kFc2Weight, e), H * F * 4), 0);
  }
  EXPECT_TRUE(inter.with_glu_interleave(0).equals(plain));
  EXPECT_TRUE(inter.with_glu_interleave(16).with_glu_interleave(0).equals(plain));
}

TEST(ExpertWeights, CastRoundsToNearestEven) {
  ExpertWeightsSpec s = small_spec(WeightLayout::kSingleGrouped, false);
  ExpertWeights w(s, DType::kFP32);
  float* f = reinterpret_cast<float*>(w.mutable_expert_data(Param::kFc1Weight, 0));
  f[0] = 1.0f + 1.0f / 256;  // half-way between two bf16 values: ties to even (1.0)
  f[1] = 1.0f + 3.0f / 256;  // ties to even (up)
  const ExpertWeights b = w.cast(DType::kBF16);
  EXPECT_EQ(b.dtype(), DType::kBF16);
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(b.expert_data(Param::kFc1Weight, 0));
  EXPECT_EQ(bits[0], 0x3F80);
  EXPECT_EQ(bits[1], 0x3F82);
  const ExpertWeights exact = filled(s);  // small integers: exact in every dtype
  EXPECT_TRUE(exact.cast(DType::kBF16).cast(DType::kFP64).cast(DType::kFP32).equals(exact));
}

TEST(ExpertWeights, ViewsFollowTheLayout) {
  const ExpertWeights g = filled(small_spec(WeightLayout::kSingleGrouped, true));
  auto v = g.views(Param::kFc1Weight);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].shape_string(), "[3, 32, 8]");
  EXPECT_EQ(v[0].device, Device::kCPU);
  const ExpertWeights p = g.with_layout(WeightLayout::kPerExpert);
  auto pv = p.views(Param::kFc2Bias);
  ASSERT_EQ(pv.size(), 3u);
  EXPECT_EQ(pv[2].shape_string(), "[8]");
  EXPECT_EQ(std::memcmp(pv[2].data, g.expert_data(Param::kFc2Bias, 2), 8 * 4), 0);
  expect_error_naming([&] { g.expert_data(Param::kFc1Weight, 3); }, "'expert'");
}

TEST(ReferenceWeights, PointerTablesInBothLayouts) {
  for (WeightLayout layout : {WeightLayout::kSingleGrouped, WeightLayout::kPerExpert}) {
    const ExpertWeights w = filled(small_spec(layout, true), DType::kBF16);
    ReferenceWeights r = to_reference_weights(w);
    ASSERT_EQ(r.params.fc1_weight.size(), 3u);
    ASSERT_EQ(r.params.fc2_bias.size(), 3u);
    // Grouped: one block per parameter, the experts' pointers inside it; per expert: a block each.
    EXPECT_EQ(r.blocks.size(), layout == WeightLayout::kSingleGrouped ? 4u : 12u);
    if (layout == WeightLayout::kSingleGrouped) {
      EXPECT_EQ(r.params.fc1_weight[1] - r.params.fc1_weight[0], 32 * 8);
    }
    const ExpertWeights f = w.cast(DType::kFP32);
    for (int e = 0; e < 3; ++e) {
      const float* src = reinterpret_cast<const float*>(f.expert_data(Param::kFc2Weight, e));
      for (int i = 0; i < 8 * 16; ++i) ASSERT_EQ(r.params.fc2_weight[e][i], static_cast<double>(src[i]));
    }
    ReferenceWeights moved = std::move(r);  // pointers stay valid
    EXPECT_EQ(moved.params.fc1_bias[2][0], static_cast<double>(
                                               reinterpret_cast<const float*>(f.expert_data(Param::kFc1Bias, 2))[0]));
  }
}

// A grouped layer of more experts than an int holds (zero-size tensors cost no bytes) is refused,
// not truncated to a smaller expert count.
TEST(FindExpertLayers, RefusesMoreExpertsThanALayerHolds) {
  StateDict sd;
  const int64_t E = (int64_t{1} << 32) + 2;
  sd.emplace("l.fc1.weight", HostTensor(DType::kBF16, {E, 0, 8}));
  sd.emplace("l.fc2.weight", HostTensor(DType::kBF16, {E, 8, 0}));
  expect_error_naming([&] { find_expert_layers(sd, 0); }, "more experts than a layer can");
}

TEST(FindExpertLayers, FindsBothLayoutsAndSkipsOrdinaryMlps) {
  StateDict sd = filled(small_spec(WeightLayout::kSingleGrouped, true)).to_state_dict("a.experts.");
  for (auto& kv : filled(small_spec(WeightLayout::kPerExpert, false)).to_state_dict("b.experts.")) sd.insert(kv);
  sd.emplace("vision.mlp.fc1.weight", iota({16, 8}, 0));  // an ordinary MLP: not an expert layer
  sd.emplace("vision.mlp.fc2.weight", iota({8, 16}, 0));
  const auto layers = find_expert_layers(sd);
  ASSERT_EQ(layers.size(), 2u);
  EXPECT_EQ(layers[0].prefix, "a.experts.");
  EXPECT_EQ(layers[0].layout, WeightLayout::kSingleGrouped);
  EXPECT_TRUE(layers[0].bias);
  EXPECT_EQ(layers[0].experts, 3);
  EXPECT_EQ(layers[0].fc1_out, 32);
  EXPECT_EQ(layers[0].ffn, 16);
  EXPECT_EQ(layers[1].prefix, "b.experts.");
  EXPECT_EQ(layers[1].layout, WeightLayout::kPerExpert);
  EXPECT_FALSE(layers[1].bias);
  EXPECT_EQ(layers[1].experts, 3);
  // A given E must match the grouped tensors.
  expect_error_naming([&] { find_expert_layers(sd, 2); }, "'a.experts.fc1.weight' [3, 32, 8] holds 3 experts");
  // With E given, 2-D stacked tensors [E * rows, cols] count as a grouped layer.
  StateDict flat;
  flat.emplace("mlp.fc1.weight", iota({16, 8}, 0));
  flat.emplace("mlp.fc2.weight", iota({16, 4}, 0));
  EXPECT_TRUE(find_expert_layers(flat).empty());
  const auto stacked = find_expert_layers(flat, 2);
  ASSERT_EQ(stacked.size(), 1u);
  EXPECT_EQ(stacked[0].fc1_out, 8);
  EXPECT_EQ(stacked[0].hidden, 8);
  EXPECT_EQ(stacked[0].ffn, 4);
}

}  // namespace
}  // namespace moe
