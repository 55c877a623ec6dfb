// Checkpoints made by the real Hugging Face transformers (scripts/make_hf_fixtures.py, committed in
// tests/fixtures/hf/) load through our mapping, and the CPU reference of the expert layer
// reproduces the experts' output that transformers computed for the saved tokens and routing --
// DeepSeek-V3's FP8 form too, as our FP8 layer.
//
// Each fixture: model.safetensors as the family's save_pretrained wrote it (one MoE layer), and
// io.safetensors with x [T, H], the top-k indices [T, k], the probs [T, k] exactly as the HF block
// weighted each expert's output (after its own softmax / renormalisation / scaling), and the
// experts' output y [T, H] (fp32 model, fp32 arithmetic; the bf16 fixture ran in fp32 on its
// bf16-rounded weights).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "checkpoint/reference_weights.h"
#include "moe/checkpoint_convert.h"
#include "moe/checkpoint_hf.h"
#include "moe/checkpoint_hf_fp8.h"
#include "moe/error.h"
#include "moe/float_convert.h"
#include "reference/grouped_mlp_ref.h"
#include "reference/quantize_ref.h"
#include "support/expect_error.h"
#include "support/quant_weights.h"

namespace moe {
namespace {

std::string fixtures() {
  // The tests/ folder of the source tree (tests/CMakeLists.txt): __FILE__ may be relative to the
  // build folder (ccache base_dir), and the tests run elsewhere.
  return std::string(MOE_TESTS_DIR) + "/fixtures/hf/";
}

std::string meta(const Metadata& m, const char* key) {
  const std::string* v = safetensors::find_metadata(m, key);
  return v ? *v : std::string();
}

std::vector<double> as_doubles(const HostTensor& t) {
  EXPECT_EQ(t.dtype(), DType::kFP32);
  std::vector<double> out(t.numel());
  for (int64_t i = 0; i < t.numel(); ++i) {
    float f;
    std::memcpy(&f, t.data() + 4 * i, 4);
    out[i] = f;
  }
  return out;
}

struct Io {
  int64_t T = 0, H = 0, F = 0;
  int E = 0, k = 0;
  std::string family, activation, weights_dtype;
  std::vector<double> x, y;
  ref::Routing routing;
};

Io load_io(const std::string& dir) {
  Metadata m;
  const StateDict io = load_safetensors(dir + "/io.safetensors", &m);
  Io r;
  r.family = meta(m, "family");
  r.activation = meta(m, "activation");
  r.weights_dtype = meta(m, "weights_dtype");
  r.T = std::stoll(meta(m, "tokens"));
  r.H = std::stoll(meta(m, "hidden"));
  r.F = std::stoll(meta(m, "ffn"));
  r.E = std::stoi(meta(m, "experts"));
  r.k = std::stoi(meta(m, "topk"));
  r.x = as_doubles(io.at("x"));
  r.y = as_doubles(io.at("y"));
  const HostTensor& idx = io.at("indices");
  EXPECT_EQ(idx.dtype(), DType::kInt32);
  EXPECT_EQ(idx.shape(), (std::vector<int64_t>{r.T, r.k}));
  r.routing.form = RoutingForm::kTopK;
  r.routing.T = r.T;
  r.routing.E = r.E;
  r.routing.k = r.k;
  r.routing.indices.resize(r.T * r.k);
  std::memcpy(r.routing.indices.data(), idx.data(), idx.nbytes());
  r.routing.probs = as_doubles(io.at("probs"));
  return r;
}

// y of the reference for the experts `w`.
std::vector<double> reference_output_of(const Io& io, const ExpertWeights& w) {
  const WeightLayout layout = w.spec().layout;
  const ReferenceWeights rw = to_reference_weights(w);

  GroupedMlpConfig c;
  c.hidden = io.H;
  c.ffn = io.F;
  c.experts = io.E;
  c.topk = io.k;
  c.max_tokens = io.T;
  c.routing_form = RoutingForm::kTopK;
  c.activation = w.spec().activation;
  c.bias = w.spec().bias;
  c.probs = ProbsPlacement::kInActivation;  // HF: p * (W2 act + b2), the fc2 bias scaled by p
  c.layout = layout;
  ref::GroupedMlpRef mlp(c);  // pure fp64
  mlp.set_weights(rw.params);
  std::vector<double> y(io.T * io.H);
  mlp.forward(io.routing, io.x.data(), y.data());
  return y;
}

// y of the reference for weights in `layout` with GLU interleave s.
std::vector<double> reference_output(const Io& io, const StateDict& model, HfFamily family, WeightLayout layout,
                                     int s) {
  const auto layers = find_hf_expert_layers(model, family);
  EXPECT_EQ(layers.size(), 1u);
  const HfExpertLayer& l = layers.at(0);
  EXPECT_EQ(l.experts, io.E);
  EXPECT_EQ(l.hidden, io.H);
  EXPECT_EQ(l.ffn, io.F);
  return reference_output_of(io, load_hf_experts(model, family, l, layout, s));
}

// The largest |a - b| after checking every element within `tol`.
double expect_close(const std::vector<double>& a, const std::vector<double>& b, double tol, int64_t row) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i], b[i], tol) << "element " << i << " (token " << i / row << ")";
    worst = std::max(worst, std::fabs(a[i] - b[i]));
  }
  return worst;
}

double max_abs(const std::vector<double>& v) {
  double m = 0;
  for (double x : v) m = std::max(m, std::fabs(x));
  return m;
}

struct Fixture {
  const char* dir;
  HfFamily family;
  const char* activation;
};
constexpr Fixture kFixtures[] = {
    {"mixtral", HfFamily::kMixtral, "swiglu"},          {"qwen2_moe", HfFamily::kQwen2Moe, "swiglu"},
    {"qwen3_moe", HfFamily::kQwen3Moe, "swiglu"},       {"olmoe", HfFamily::kOlmoe, "swiglu"},
    {"deepseek_v3", HfFamily::kDeepseek, "swiglu"},     {"gpt_oss", HfFamily::kGptOss, "clamped_swiglu"},
    // Model types read in a family's naming.
    {"glm4_moe", HfFamily::kQwen2Moe, "swiglu"},        {"jamba", HfFamily::kQwen2Moe, "swiglu"},
    {"nemotron_h", HfFamily::kNemotronH, "squared_relu"},
    // Stored fused.
    {"mistral4", HfFamily::kMistral4, "swiglu"},        {"gemma4", HfFamily::kGemma4, "geglu"},
    {"granitemoe", HfFamily::kGraniteMoe, "swiglu"},      {"qwen3_vl_moe", HfFamily::kQwen3VlMoe, "swiglu"},
    // SiLU-gated, clamped at swiglu_limit (10; 10-20% of the fixtures' gate and up values are beyond it).
    {"deepseek_v4", HfFamily::kDeepseekV4, "clamped_silu"}, {"hy_v4", HfFamily::kHyV4, "clamped_silu"},
    {"glm5_next", HfFamily::kGlm5Next, "clamped_silu"},     {"minimax_m3_vl", HfFamily::kMinimaxM3, "clamped_swiglu"},
    // MiniMax-M3's language model stored fused; Inkling's fused gate / up rows alternating; the privacy
    // filter in GPT-OSS's layout with [gate | up] halves.
    {"minimax_m3_vl_text", HfFamily::kMinimaxM3Text, "clamped_swiglu"},
    {"inkling_mm_model", HfFamily::kInkling, "swiglu"},
    {"openai_privacy_filter", HfFamily::kOpenaiPrivacyFilter, "clamped_swiglu"},
};

TEST(HfFixtures, ReferenceReproducesTransformersExpertOutputs) {
  for (const Fixture& fx : kFixtures) {
    const std::string dir = fixtures() + fx.dir;
    SCOPED_TRACE(dir);
    const Io io = load_io(dir);
    ASSERT_EQ(hf_family_from_name(io.family), fx.family);
    ASSERT_EQ(io.activation, fx.activation);
    ASSERT_EQ(io.x.size(), static_cast<size_t>(io.T * io.H));
    const StateDict model = load_safetensors(dir + "/model.safetensors");
    const auto layers = find_hf_expert_layers(model, fx.family);
    ASSERT_EQ(layers.size(), 1u);
    EXPECT_EQ(dtype_name(layers[0].dtype), std::string(io.weights_dtype == "bfloat16" ? "bf16" : "fp32"));

    const std::vector<double> y = reference_output(io, model, fx.family, WeightLayout::kSingleGrouped, 0);
    const double ymax = max_abs(io.y);
    ASSERT_GT(ymax, 0.1);  // the fixture exercises the experts (not all zeros)
    // Tolerance: transformers computed in fp32 (products over H = 64, then F = 32 terms, then k
    // slots); fp32 rounding gives a few 1e-7 of the output's scale, seen up to 4.2e-7 here. 1e-5
    // of the largest output leaves margin while any misplaced row, transposition, missing bias or
    // wrong activation constant is off by orders of magnitude more.
    const double worst = expect_close(y, io.y, 1e-5 * ymax, io.H);
    std::printf("  %-12s E=%d k=%d: max |ref - transformers| = %.2e (max |y| = %.3g)\n", fx.dir, io.E, io.k, worst,
                ymax);

    // Every layout and GLU interleave gives bitwise the same result: they move storage only.
    const bool gated = is_gated(hf_activation(fx.family).kind);
    for (WeightLayout layout : {WeightLayout::kSingleGrouped, WeightLayout::kPerExpert})
      for (int s : gated ? std::vector<int>{0, 8, 16} : std::vector<int>{0})
        if (io.F % std::max(s, 1) == 0)  // an interleave divides F (F = 24 for the families added later)
          EXPECT_TRUE(reference_output(io, model, fx.family, layout, s) == y)
              << (layout == WeightLayout::kPerExpert ? "per-expert" : "grouped") << ", interleave " << s;
  }
}

// Our FP8 layer (fc1 / fc2 in hf_fp8_format, either layout) decoded by the reference dequantizer into
// fp32 experts (grouped, GLU interleave s). The columnwise copy decodes to the transpose, bitwise.
ExpertWeights decoded_fp8(const StateDict& ours, const Metadata& metadata, const std::string& prefix, const Io& io,
                          int s) {
  ExpertWeightsSpec spec;
  spec.hidden = io.H;
  spec.ffn = io.F;
  spec.experts = io.E;
  spec.activation.kind = Activation::kSwiGLU;
  spec.activation.glu_interleave = s;
  ExpertWeights w(spec, DType::kFP32);
  StateDict g;
  for (const auto& [k, t] : ours)
    if (k.compare(0, prefix.size(), prefix) == 0) g.emplace(k, t);
  normalize_expert_keys(g, prefix, io.E, WeightLayout::kSingleGrouped);
  for (Param p : {Param::kFc1Weight, Param::kFc2Weight}) {
    const std::string key = expert_param_key(prefix, p);
    const std::string* declared = safetensors::find_metadata(metadata, quant_metadata_key(key));
    EXPECT_NE(declared, nullptr) << key;
    if (!declared) return w;
    const QuantConfig c = parse_quant_metadata(*declared, key);
    EXPECT_EQ(format_quant_metadata(c), format_quant_metadata(hf_fp8_format()));
    const int64_t rows = p == Param::kFc1Weight ? 2 * io.F : io.H, cols = p == Param::kFc1Weight ? io.H : io.F;
    auto bytes = [&](QuantPart part) {
      const HostTensor& t = g.at(quant_part_key(key, part));
      return std::vector<uint8_t>(t.data(), t.data() + t.nbytes());
    };
    ref::Quantized q;
    q.rowwise_data = bytes(QuantPart::kData);
    q.rowwise_scale = bytes(QuantPart::kScale);
    q.columnwise_data = bytes(QuantPart::kColumnwiseData);
    q.columnwise_scale = bytes(QuantPart::kColumnwiseScale);
    const std::vector<float> row = ref::dequantize(c, q, false, io.E, rows, cols);
    const std::vector<float> col = ref::dequantize(c, q, true, io.E, rows, cols);
    for (int e = 0; e < io.E; ++e) {
      const float* r = row.data() + e * rows * cols;
      bool transposed = true;
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) transposed = transposed && r[i * cols + j] == col[(e * cols + j) * rows + i];
      EXPECT_TRUE(transposed) << key << " expert " << e;
      std::memcpy(w.mutable_expert_data(p, e), r, rows * cols * sizeof(float));
    }
  }
  return w;
}

// DeepSeek-V3's FP8 form (experts F8_E4M3 with 128x128 weight_scale_inv, quantized by transformers'
// own FP8 quantizer) becomes our FP8 layer by moving bytes: decoded, it reproduces the experts' output
// transformers computed from the weights its dequantizer gives back, in both layouts and with fc1's
// blocks interleaved; written back, it is the file's tensors and metadata again.
TEST(HfFixtures, Fp8CheckpointBecomesOurFp8LayerExactly) {
  const std::string dir = fixtures() + "deepseek_v3_fp8";
  const Io io = load_io(dir);
  Metadata meta_in;
  const StateDict model = load_safetensors(dir + "/model.safetensors", &meta_in);
  const auto layers = find_hf_expert_layers(model, HfFamily::kDeepseek);
  ASSERT_EQ(layers.size(), 1u);
  ASSERT_TRUE(layers[0].fp8);
  EXPECT_EQ(layers[0].dtype, DType::kFP8E4M3);
  const std::string prefix = layers[0].prefix;
  const double ymax = max_abs(io.y);
  ASSERT_GT(ymax, 0.1);
  std::vector<double> first;
  for (const char* ours : {"grouped", "per-expert"}) {
    for (int s : {0, 128}) {
      SCOPED_TRACE(std::string(ours) + " interleave " + std::to_string(s));
      StateDict sd = model;
      Metadata meta = meta_in;
      ConvertOptions o;
      o.from = CheckpointFormat::parse("hf:deepseek");
      o.to = CheckpointFormat::parse(ours);
      o.to_glu_interleave = s;
      ASSERT_EQ(convert_state_dict(sd, o, meta), std::vector<std::string>{prefix});
      for (const auto& [k, t] : model) {
        if (k.compare(0, prefix.size(), prefix) == 0) EXPECT_FALSE(sd.count(k)) << k;
        else EXPECT_TRUE(sd.at(k).equals(t)) << k;  // the shared experts' FP8 weights and scales too
      }
      const std::vector<double> y = reference_output_of(io, decoded_fp8(sd, meta, prefix, io, s));
      if (first.empty()) {
        // Both sides decode the same fp32 weights (code x scale_inv, one fp32 multiply); the rest is the
        // fp32 arithmetic of the unquantized fixtures (H = 128, F = 256 terms): 1e-5 of max |y|.
        const double worst = expect_close(y, io.y, 1e-5 * ymax, io.H);
        std::printf("  deepseek_v3_fp8 E=%d k=%d: max |ref - transformers| = %.2e (max |y| = %.3g)\n", io.E, io.k,
                    worst, ymax);
        first = y;
      } else {
        EXPECT_TRUE(y == first);
      }
      ConvertOptions back;
      back.from = o.to;
      back.to = o.from;
      back.from_glu_interleave = s;
      convert_state_dict(sd, back, meta);
      EXPECT_EQ(meta, meta_in);
      ASSERT_EQ(sd.size(), model.size());
      for (const auto& [k, t] : model) EXPECT_TRUE(sd.count(k) && sd.at(k).equals(t)) << k;
    }
  }
  // The check can fail: one block's scale read wrong moves the output far outside the tolerance.
  StateDict wrong = model;
  HostTensor sc(DType::kFP32, {2, 1});
  std::memcpy(sc.mutable_data(), wrong.at(prefix + "0.gate_proj.weight_scale_inv").data(), 8);
  reinterpret_cast<float*>(sc.mutable_data())[1] *= 2.0f;
  wrong.at(prefix + "0.gate_proj.weight_scale_inv") = sc;
  Metadata meta;
  ConvertOptions o;
  o.from = CheckpointFormat::parse("hf:deepseek");
  o.to = CheckpointFormat::parse("grouped");
  convert_state_dict(wrong, o, meta);
  const std::vector<double> y = reference_output_of(io, decoded_fp8(wrong, meta, prefix, io, 0));
  double diff = 0;
  for (size_t i = 0; i < y.size(); ++i) diff = std::max(diff, std::fabs(y[i] - io.y[i]));
  EXPECT_GT(diff, 1e-3 * ymax);
}

// The value a Hugging Face FP8 weight decodes to: its code times its 128x128 block's scale_inv (fp32 or
// bf16), in fp32; element (m, r, c) of a tensor [..., rows, cols], m counting the leading dimensions.
float fp8_block_value(const StateDict& sd, const std::string& key, int64_t m, int64_t r, int64_t c) {
  const HostTensor& t = sd.at(key);
  const HostTensor& s = sd.at(key + "_scale_inv");
  const int64_t rows = t.shape()[t.ndim() - 2], cols = t.shape().back();
  const int64_t row_blocks = s.shape()[s.ndim() - 2], col_blocks = s.shape().back();
  const int64_t j = (m * row_blocks + r / 128) * col_blocks + c / 128;
  const float scale = s.dtype() == DType::kBF16 ? bf16_bits_to_float(reinterpret_cast<const uint16_t*>(s.data())[j])
                                                 : reinterpret_cast<const float*>(s.data())[j];
  return static_cast<float>(ref::e4m3_to_double(t.data()[(m * rows + r) * cols + c])) * scale;
}

// An FP8 tensor of `shape` with every code (NaN ones included) and its scales (of scale_dtype, a
// different value per block) under `key`.
void add_fp8_block_tensor(StateDict& sd, const std::string& key, const std::vector<int64_t>& shape, DType scale_dtype) {
  HostTensor t(DType::kFP8E4M3, shape);
  for (int64_t i = 0; i < t.numel(); ++i) t.mutable_data()[i] = static_cast<uint8_t>(i * 37 + i / 7);
  std::vector<int64_t> blocks = shape;
  blocks[blocks.size() - 2] = (blocks[blocks.size() - 2] + 127) / 128;
  blocks.back() = (blocks.back() + 127) / 128;
  HostTensor s(scale_dtype, blocks);
  for (int64_t i = 0; i < s.numel(); ++i) {
    const float v = std::ldexp(1.0f + 0.125f * static_cast<float>(i % 8), static_cast<int>(i % 5) - 3);
    if (scale_dtype == DType::kBF16) reinterpret_cast<uint16_t*>(s.mutable_data())[i] = float_to_bf16_bits(v);
    else reinterpret_cast<float*>(s.mutable_data())[i] = v;
  }
  sd.emplace(key, t);
  sd.emplace(key + "_scale_inv", s);
}

// Every element of `out` (fp32 or bf16) against the decoded values of `key` in `in`.
void expect_decoded(const HostTensor& out, const StateDict& in, const std::string& key) {
  const HostTensor& t = in.at(key);
  const int64_t rows = t.shape()[t.ndim() - 2], cols = t.shape().back(), matrices = t.numel() / (rows * cols);
  ASSERT_EQ(out.shape(), t.shape()) << key;
  std::vector<float> want;
  for (int64_t m = 0; m < matrices; ++m)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) want.push_back(fp8_block_value(in, key, m, r, c));
  testing::expect_values(out, out.dtype(), want, key);
}

// --dequantize: the FP8 checkpoint's experts become unquantized weights of exactly the values our FP8
// layer decodes to (fp32; bf16 rounds each once), from its Hugging Face form and from ours, and every
// other FP8 weight (the shared experts') is written as its values too, its scales gone.
TEST(HfFixtures, Fp8CheckpointDequantizesToTheValuesItDecodesTo) {
  const std::string dir = fixtures() + "deepseek_v3_fp8";
  const Io io = load_io(dir);
  Metadata meta_in;
  const StateDict model = load_safetensors(dir + "/model.safetensors", &meta_in);
  const std::string prefix = find_hf_expert_layers(model, HfFamily::kDeepseek).at(0).prefix;
  // Our FP8 layer made from the file, and the fp32 weights it decodes to.
  StateDict fp8 = model;
  Metadata fp8_meta = meta_in;
  ConvertOptions to_ours;
  to_ours.from = CheckpointFormat::parse("hf:deepseek");
  to_ours.to = CheckpointFormat::parse("grouped");
  convert_state_dict(fp8, to_ours, fp8_meta);
  const ExpertWeights want = decoded_fp8(fp8, fp8_meta, prefix, io, 0);
  const std::string shared = "model.layers.0.mlp.shared_experts.gate_proj.weight";
  ASSERT_EQ(model.at(shared).dtype(), DType::kFP8E4M3);
  // Besides the file's: partial blocks with bf16 scales, and a stack of matrices.
  StateDict with = model;
  add_fp8_block_tensor(with, "model.extra.weight", {200, 300}, DType::kBF16);
  add_fp8_block_tensor(with, "model.stacked.weight", {2, 130, 129}, DType::kFP32);

  for (DType dt : {DType::kFP32, DType::kBF16}) {
    for (bool from_ours : {false, true}) {
      SCOPED_TRACE(std::string(dtype_name(dt)) + (from_ours ? " from our FP8 layer" : " from the FP8 file"));
      StateDict sd = from_ours ? fp8 : with;
      if (from_ours)
        for (const char* k : {"model.extra.weight", "model.stacked.weight"})
          for (const std::string& part : {std::string(k), std::string(k) + "_scale_inv"}) sd.emplace(part, with.at(part));
      Metadata meta = from_ours ? fp8_meta : meta_in;
      ConvertOptions o;
      o.from = from_ours ? to_ours.to : to_ours.from;
      o.to = CheckpointFormat::parse("grouped");
      o.dequantize = dt;
      ASSERT_EQ(convert_state_dict(sd, o, meta), std::vector<std::string>{prefix});
      EXPECT_EQ(meta, meta_in);  // no "moe.quant." entry: nothing is quantized any more
      ExpertWeightsSpec spec = want.spec();
      const ExpertWeights got = ExpertWeights::from_state_dict(sd, spec, prefix);
      EXPECT_EQ(got.dtype(), dt);
      EXPECT_TRUE(got.equals(want.cast(dt)));
      testing::expect_no_fp8_left(sd);
      // The weights outside the expert layer: every value computed here from its code and block scale.
      for (const std::string& k : {shared, std::string("model.extra.weight"), std::string("model.stacked.weight")}) {
        ASSERT_EQ(sd.at(k).dtype(), dt) << k;
        expect_decoded(sd.at(k), with, k);
      }
      // The other tensors as they were.
      for (const auto& [k, t] : model)
        if (t.dtype() != DType::kFP8E4M3 && k.find("_scale_inv") == std::string::npos && k.rfind(prefix, 0) != 0)
          EXPECT_TRUE(sd.at(k).equals(t)) << k;
    }
  }
  // In Hugging Face naming again, bf16: each expert weight its values, rounded once.
  StateDict hf = model;
  Metadata meta = meta_in;
  ConvertOptions o;
  o.from = o.to = CheckpointFormat::parse("hf:deepseek");
  o.dequantize = DType::kBF16;
  convert_state_dict(hf, o, meta);
  const std::string gate = prefix + "3.gate_proj.weight";
  ASSERT_EQ(hf.at(gate).dtype(), DType::kBF16);
  expect_decoded(hf.at(gate), model, gate);
  // With the values any interleave of fc1's rows is a move of values (no block to cut).
  StateDict inter = model;
  o.to = CheckpointFormat::parse("per-expert");
  o.to_glu_interleave = 16;
  convert_state_dict(inter, o, meta);
  ExpertWeightsSpec spec16 = want.spec();
  spec16.layout = WeightLayout::kPerExpert;
  spec16.activation.glu_interleave = 16;
  EXPECT_TRUE(ExpertWeights::from_state_dict(inter, spec16, prefix).equals(want.cast(DType::kBF16).with_glu_interleave(16).with_layout(WeightLayout::kPerExpert)));

  // Refused by name: scales of the wrong shape beside an FP8 weight, and a dtype other than bf16 / fp32.
  // A refused conversion leaves the dict and the metadata as they were.
  StateDict bad = model;
  bad.at(shared + "_scale_inv") = HostTensor(DType::kFP32, {1, 1});
  const StateDict bad_before = bad;
  ConvertOptions d = o;
  d.to = CheckpointFormat::parse("grouped");
  d.to_glu_interleave = 0;
  meta = meta_in;
  testing::expect_error_naming([&] { convert_state_dict(bad, d, meta); }, "'" + shared + "_scale_inv' has dtype fp32 and shape [1, 1]");
  EXPECT_EQ(meta, meta_in);
  ASSERT_EQ(bad.size(), bad_before.size());
  for (const auto& [k, t] : bad_before) EXPECT_TRUE(bad.count(k) && bad.at(k).equals(t)) << k;
  d.dequantize = DType::kFP16;
  StateDict any = model;
  testing::expect_error_naming([&] { convert_state_dict(any, d, meta); }, "argument 'dequantize': expected bf16 or fp32");
}

// GPT-OSS's released MXFP4 form decodes to exactly the bf16 weights transformers' own decoder gives
// (io.safetensors holds them), and through the reference they reproduce the experts' output.
TEST(HfFixtures, Mxfp4CheckpointDecodesAsTransformersDoes) {
  const std::string dir = fixtures() + "gpt_oss_mxfp4";
  const Io io = load_io(dir);
  const StateDict model = load_safetensors(dir + "/model.safetensors");
  const StateDict ioraw = load_safetensors(dir + "/io.safetensors");
  const auto layers = find_hf_expert_layers(model, HfFamily::kGptOss);
  ASSERT_EQ(layers.size(), 1u);
  EXPECT_TRUE(layers[0].mxfp4);
  EXPECT_EQ(layers[0].dtype, DType::kBF16);
  const std::string p = layers[0].prefix;
  EXPECT_EQ(hf_expert_keys(layers[0], HfFamily::kGptOss).size(), 6u);
  // To ours and back to Hugging Face naming: the bf16 form, which is transformers' decoding bit for bit.
  StateDict sd = model;
  Metadata meta;
  ConvertOptions o;
  o.from = CheckpointFormat::parse("hf:gpt_oss");
  o.to = CheckpointFormat::parse("grouped");
  convert_state_dict(sd, o, meta);
  EXPECT_EQ(sd.at(p + "fc1.weight").dtype(), DType::kBF16);
  std::swap(o.from, o.to);
  convert_state_dict(sd, o, meta);
  EXPECT_TRUE(sd.at(p + "gate_up_proj").equals(ioraw.at("gate_up_decoded")));
  EXPECT_TRUE(sd.at(p + "down_proj").equals(ioraw.at("down_decoded")));
  EXPECT_TRUE(sd.at(p + "gate_up_proj_bias").equals(model.at(p + "gate_up_proj_bias")));
  EXPECT_FALSE(sd.count(p + "gate_up_proj_blocks"));
  const std::vector<double> y = reference_output(io, model, HfFamily::kGptOss, WeightLayout::kSingleGrouped, 0);
  const double ymax = max_abs(io.y);
  ASSERT_GT(ymax, 0.1);
  const double worst = expect_close(y, io.y, 1e-5 * ymax, io.H);
  std::printf("  gpt_oss_mxfp4 E=%d k=%d: max |ref - transformers| = %.2e (max |y| = %.3g)\n", io.E, io.k, worst, ymax);
  // --dequantize fp32: the same values (bf16 holds them exactly), in fp32.
  StateDict wide = model;
  ConvertOptions d;
  d.from = d.to = CheckpointFormat::parse("hf:gpt_oss");
  d.dequantize = DType::kFP32;
  convert_state_dict(wide, d, meta);
  const HostTensor& decoded = ioraw.at("gate_up_decoded");
  std::vector<float> want(decoded.numel());
  for (size_t i = 0; i < want.size(); ++i)
    want[i] = bf16_bits_to_float(reinterpret_cast<const uint16_t*>(decoded.data())[i]);
  ASSERT_EQ(wide.at(p + "gate_up_proj").shape(), decoded.shape());
  testing::expect_values(wide.at(p + "gate_up_proj"), DType::kFP32, want, p + "gate_up_proj");
}

// The check can fail: a checkpoint read with the wrong convention does not reproduce the outputs.
TEST(HfFixtures, WrongConventionsAreDetected) {
  const std::string dir = fixtures() + "mixtral";
  const Io io = load_io(dir);
  StateDict model = load_safetensors(dir + "/model.safetensors");
  // Swap gate and up (w1 <-> w3) of expert 0.
  const std::string p = "model.layers.0.block_sparse_moe.experts.0.";
  std::swap(model.at(p + "w1.weight"), model.at(p + "w3.weight"));
  const std::vector<double> y = reference_output(io, model, HfFamily::kMixtral, WeightLayout::kSingleGrouped, 0);
  double ymax = 0, diff = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    ymax = std::max(ymax, std::fabs(io.y[i]));
    diff = std::max(diff, std::fabs(y[i] - io.y[i]));
  }
  EXPECT_GT(diff, 1e-2 * ymax);
}

}  // namespace
}  // namespace moe
