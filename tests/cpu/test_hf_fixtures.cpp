// Checkpoints made by the real Hugging Face transformers (scripts/make_hf_fixtures.py, committed in
// tests/fixtures/hf/) load through our mapping, and the CPU reference of the expert layer
// reproduces the experts' output that transformers computed for the saved tokens and routing.
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
#include "moe/checkpoint_hf.h"
#include "moe/error.h"
#include "reference/grouped_mlp_ref.h"

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

// y of the reference for weights in `layout` with GLU interleave s.
std::vector<double> reference_output(const Io& io, const StateDict& model, HfFamily family, WeightLayout layout,
                                     int s) {
  const auto layers = find_hf_expert_layers(model, family);
  EXPECT_EQ(layers.size(), 1u);
  const HfExpertLayer& l = layers.at(0);
  EXPECT_EQ(l.experts, io.E);
  EXPECT_EQ(l.hidden, io.H);
  EXPECT_EQ(l.ffn, io.F);
  const ExpertWeights w = load_hf_experts(model, family, l, layout, s);
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

struct Fixture {
  const char* dir;
  HfFamily family;
  const char* activation;
};
constexpr Fixture kFixtures[] = {
    {"mixtral", HfFamily::kMixtral, "swiglu"},          {"qwen2_moe", HfFamily::kQwen2Moe, "swiglu"},
    {"qwen3_moe", HfFamily::kQwen3Moe, "swiglu"},       {"olmoe", HfFamily::kOlmoe, "swiglu"},
    {"deepseek_v3", HfFamily::kDeepseek, "swiglu"},     {"gpt_oss", HfFamily::kGptOss, "clamped_swiglu"},
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
    double ymax = 0;
    for (double v : io.y) ymax = std::max(ymax, std::fabs(v));
    ASSERT_GT(ymax, 0.1);  // the fixture exercises the experts (not all zeros)
    // Tolerance: transformers computed in fp32 (products over H = 64, then F = 32 terms, then k
    // slots); fp32 rounding gives a few 1e-7 of the output's scale, seen up to 4.2e-7 here. 1e-5
    // of the largest output leaves margin while any misplaced row, transposition, missing bias or
    // wrong activation constant is off by orders of magnitude more.
    const double tol = 1e-5 * ymax;
    double worst = 0;
    for (size_t i = 0; i < y.size(); ++i) {
      ASSERT_NEAR(y[i], io.y[i], tol) << "element " << i << " (token " << i / io.H << ")";
      worst = std::max(worst, std::fabs(y[i] - io.y[i]));
    }
    std::printf("  %-12s E=%d k=%d: max |ref - transformers| = %.2e (max |y| = %.3g)\n", fx.dir, io.E, io.k, worst,
                ymax);

    // Every layout and GLU interleave gives bitwise the same result: they move storage only.
    for (WeightLayout layout : {WeightLayout::kSingleGrouped, WeightLayout::kPerExpert})
      for (int s : {0, 8, 16})
        EXPECT_TRUE(reference_output(io, model, fx.family, layout, s) == y)
            << (layout == WeightLayout::kPerExpert ? "per-expert" : "grouped") << ", interleave " << s;
  }
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
