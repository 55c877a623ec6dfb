// GPU router (moe::Router) against the CPU reference (fp64):
//   - selection (selected, indices / map), counts, seq counts, error bits: exact. Without a bias,
//     groups or a capacity / rounding pass the device orders by the logits themselves (exact).
//     Otherwise it compares fp32 scores (sigmoid / softmax ~3 ulp, + bias 0.5 ulp: two values
//     differ from fp64 by < 4e-7 relative); the reference reports its smallest relative decision gap
//     and such a case asserts it is above 8e-7, so the device must take the same decisions -- a near
//     tie would make the case invalid, not the kernel wrong;
//   - probs: |got - ref| <= 64 u |ref| (u = 2^-24): expf / division ~2 ulp each, sums of at most
//     16 + 5 (row) and 16 (chosen) fp32 terms;
//   - losses: 1e-5 relative (sums of positive terms, fp32 within a block, fp64 across blocks);
//   - d logits: 512 u * (magnitude of the terms combined per row) + 256 u |ref|, + a bf16 rounding
//     for bf16 logits;
//   - determinism, graph capture + replay with new logits == eager, bad input, T < T_max, T = 0.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "moe/device_errors.h"
#include "moe/error_word.h"
#include "moe/float_convert.h"
#include "moe/router.h"
#include "reference/router_ref.h"
#include "support/expect_error.h"
#include "support/gpu.h"

namespace moe {
namespace {

using testing::DeviceBuffer;
using testing::expect_error_naming;
constexpr double kU = 1.0 / (1 << 24);

struct Case {
  std::string name;
  int E = 64, k = 8;
  int64_t T = 1000;
  bool bf16 = false;
  uint64_t seed = 1;
  double scale = 1.5;  // logits ~ N(0, scale)
  int64_t offset = 0;  // logits and d logits start this many elements into their buffers (alignment)
  bool no_d_probs = false;  // backward without incoming d probs (an empty view: zero)
  std::function<void(RouterConfig&)> edit;
  std::function<void(std::vector<double>&)> edit_logits;
};

RouterConfig config_of(const Case& c) {
  RouterConfig cfg;
  cfg.num_experts = c.E;
  cfg.topk = c.k;
  cfg.max_tokens = std::max<int64_t>(c.T, 1);
  if (c.edit) c.edit(cfg);
  return cfg;
}

std::vector<double> make_logits(const Case& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0.0f, static_cast<float>(c.scale));
  std::vector<double> z(c.T * c.E);
  for (auto& v : z) {
    const float f = n(rng);
    v = c.bf16 ? round_to_bf16(f) : f;
  }
  if (c.edit_logits) c.edit_logits(z);
  return z;
}

std::vector<double> make_bias(int E, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-0.01f, 0.01f);
  std::vector<double> b(E);
  for (auto& v : b) v = u(rng);
  return b;
}

// Device buffers of one router call.
struct RouterRun {
  RouterConfig cfg;
  int64_t T;
  int W;
  DeviceBuffer<uint8_t> logits, dlogits;
  DeviceBuffer<float> bias, probs, dprobs, losses, dlosses;
  DeviceBuffer<int32_t> indices, selected, selcounts, counts, seqcounts;
  DeviceBuffer<uint8_t> map;
  DeviceBuffer<int64_t> counts64;
  bool bf16;
  int64_t offset;  // elements before the logits (and d logits) in their buffers
  bool with_d_probs = true;  // false: backward without incoming d probs (an empty view)

  RouterRun(const RouterConfig& c, int64_t T_, int W_, bool bf16_, int64_t offset_ = 0)
      : cfg(c), T(T_), W(W_), bf16(bf16_), offset(offset_) {
    const int E = c.num_experts, k = c.topk;
    const bool map_form = c.output_form == RoutingForm::kMap;
    logits = DeviceBuffer<uint8_t>((T * E + offset) * (bf16 ? 2 : 4));
    dlogits = DeviceBuffer<uint8_t>((T * E + offset) * (bf16 ? 2 : 4));
    bias = DeviceBuffer<float>(E);
    probs = DeviceBuffer<float>(T * (map_form ? E : k));
    dprobs = DeviceBuffer<float>(T * (map_form ? E : k));
    losses = DeviceBuffer<float>(3);
    dlosses = DeviceBuffer<float>(3);
    indices = DeviceBuffer<int32_t>(map_form ? 0 : T * k);
    map = DeviceBuffer<uint8_t>(map_form ? T * E : 0);
    selected = DeviceBuffer<int32_t>(T * W);
    selcounts = DeviceBuffer<int32_t>(E);
    counts = DeviceBuffer<int32_t>(E);
    counts64 = DeviceBuffer<int64_t>(E);
    const int64_t B = c.seq_aux_loss_coeff != 0.0f ? T / c.seq_length : 0;
    seqcounts = DeviceBuffer<int32_t>(B * E);
  }

  size_t esize() const { return bf16 ? 2 : 4; }
  TensorView logits_view() const {
    return TensorView(logits.get() + offset * esize(), bf16 ? DType::kBF16 : DType::kFP32, {T, cfg.num_experts});
  }
  RouterOutputs outputs() const {
    const int E = cfg.num_experts, k = cfg.topk;
    const bool map_form = cfg.output_form == RoutingForm::kMap;
    RouterOutputs o;
    if (map_form) {
      o.map = TensorView(map.get(), DType::kBool, {T, E});
      o.probs = TensorView(probs.get(), DType::kFP32, {T, E});
    } else {
      o.indices = TensorView(indices.get(), DType::kInt32, {T, k});
      o.probs = TensorView(probs.get(), DType::kFP32, {T, k});
    }
    o.selected = TensorView(selected.get(), DType::kInt32, {T, W});
    o.selection_counts = TensorView(selcounts.get(), DType::kInt32, {E});
    o.counts = TensorView(counts.get(), DType::kInt32, {E});
    o.counts_int64 = TensorView(counts64.get(), DType::kInt64, {E});
    if (cfg.seq_aux_loss_coeff != 0.0f)
      o.seq_counts = TensorView(seqcounts.get(), DType::kInt32, {T / cfg.seq_length, E});
    if (cfg.aux_loss_coeff != 0.0f) o.aux_loss = TensorView(losses.get(), DType::kFP32, {1});
    if (cfg.seq_aux_loss_coeff != 0.0f) o.seq_aux_loss = TensorView(losses.get() + 1, DType::kFP32, {1});
    if (cfg.z_loss_coeff != 0.0f) o.z_loss = TensorView(losses.get() + 2, DType::kFP32, {1});
    return o;
  }
  RouterGrads grads() const {
    RouterGrads g;
    const bool map_form = cfg.output_form == RoutingForm::kMap;
    if (with_d_probs) g.d_probs = TensorView(dprobs.get(), DType::kFP32, {T, map_form ? cfg.num_experts : cfg.topk});
    g.d_aux_loss = TensorView(dlosses.get(), DType::kFP32, {1});
    g.d_seq_aux_loss = TensorView(dlosses.get() + 1, DType::kFP32, {1});
    g.d_z_loss = TensorView(dlosses.get() + 2, DType::kFP32, {1});
    return g;
  }
  TensorView bias_view() const {
    return cfg.expert_bias ? TensorView(bias.get(), DType::kFP32, {cfg.num_experts}) : TensorView();
  }
  TensorView dlogits_view() const {
    return TensorView(dlogits.get() + offset * esize(), bf16 ? DType::kBF16 : DType::kFP32, {T, cfg.num_experts});
  }

  void upload(const std::vector<double>& z, const std::vector<double>& b, const std::vector<double>& dp,
              const double (&dl)[3]) {
    std::vector<uint8_t> bytes(logits.size());
    for (size_t i = 0; i < z.size(); ++i) {
      const size_t at = (offset + i) * esize();
      if (bf16) {
        const uint16_t h = float_to_bf16_bits(static_cast<float>(z[i]));
        std::memcpy(&bytes[at], &h, 2);
      } else {
        const float f = static_cast<float>(z[i]);
        std::memcpy(&bytes[at], &f, 4);
      }
    }
    logits.upload(bytes);
    bias.upload(std::vector<float>(b.begin(), b.end()));
    if (!dp.empty()) dprobs.upload(std::vector<float>(dp.begin(), dp.end()));
    dlosses.upload({static_cast<float>(dl[0]), static_cast<float>(dl[1]), static_cast<float>(dl[2])});
  }
  void poison() {
    for (auto* b : {&dlogits, &map}) b->fill_bytes(0xAB);
    for (auto* b : {&indices, &selected, &selcounts, &counts, &seqcounts}) b->fill_bytes(0xAB);
    probs.fill_bytes(0xAB);
    losses.fill_bytes(0xAB);
    counts64.fill_bytes(0xAB);
  }
  // sync_between: wait for the forward before enqueueing the backward, so that a device fault is
  // reported by the call that caused it (faults are sticky and surface at the next API call).
  void enqueue(const Router& r, uint32_t* err, cudaStream_t s, bool sync_between = false) const {
    r.forward(logits_view(), bias_view(), outputs(), err, s);
    if (sync_between) MOE_CUDA_CHECK(cudaStreamSynchronize(s));
    r.backward(logits_view(), outputs(), grads(), dlogits_view(), s);
  }

  struct Host {
    std::vector<int32_t> indices, selected, selcounts, counts, seqcounts;
    std::vector<uint8_t> map, dlogits;
    std::vector<float> probs, losses;
    std::vector<int64_t> counts64;
    uint32_t bits;
    bool operator==(const Host& o) const {
      return indices == o.indices && selected == o.selected && selcounts == o.selcounts && counts == o.counts &&
             seqcounts == o.seqcounts && map == o.map && dlogits == o.dlogits && counts64 == o.counts64 &&
             bits == o.bits && std::memcmp(probs.data(), o.probs.data(), 4 * probs.size()) == 0 &&
             std::memcmp(losses.data(), o.losses.data(), 4 * losses.size()) == 0;
    }
  };
  Host download(ErrorWord& ew) const {
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
    return Host{indices.download(), selected.download(), selcounts.download(), counts.download(),
                seqcounts.download(), map.download(), dlogits.download(), probs.download(), losses.download(),
                counts64.download(), ew.fetch_and_clear(nullptr)};
  }
  double dlogit(const Host& h, size_t i) const {
    const size_t at = (offset + i) * esize();
    if (bf16) {
      uint16_t v;
      std::memcpy(&v, &h.dlogits[at], 2);
      return bf16_bits_to_float(v);
    }
    float f;
    std::memcpy(&f, &h.dlogits[at], 4);
    return f;
  }
};

struct Inputs {
  std::vector<double> z, b, dp;
  double dl[3] = {0.7, -1.1, 0.4};
};

Inputs make_inputs(const Case& c, const RouterConfig& cfg, uint64_t seed) {
  Inputs in;
  in.z = make_logits(c, seed);
  in.b = make_bias(cfg.num_experts, seed + 7);
  std::mt19937_64 rng(seed + 9);
  std::normal_distribution<float> n;
  if (!c.no_d_probs) in.dp.resize(c.T * (cfg.output_form == RoutingForm::kMap ? cfg.num_experts : cfg.topk));
  for (auto& v : in.dp) v = n(rng);
  return in;
}

void check(const Case& c, const RouterConfig& cfg, const RouterRun& run, const Inputs& in, const RouterRun::Host& h) {
  SCOPED_TRACE(c.name);
  const int E = cfg.num_experts, k = cfg.topk;
  const int64_t T = c.T;
  const auto r = ref::router_forward(cfg, in.z, T, cfg.expert_bias ? &in.b : nullptr);
  const bool computed_order = cfg.expert_bias || cfg.num_groups > 1 || cfg.rounding != TokenRounding::kNone ||
                              (cfg.capacity_factor != 0.0 && cfg.drop_policy == CapacityDropPolicy::kProb);
  if (computed_order) ASSERT_GT(r.decision_margin, 8e-7) << "the test data has a near tie: pick another seed";
  EXPECT_EQ(h.bits, r.error_bits) << describe_error_bits(h.bits);
  EXPECT_TRUE(h.selected == r.selected) << "selected differs";
  if (cfg.output_form == RoutingForm::kTopK)
    EXPECT_TRUE(h.indices == r.indices) << "indices differ";
  else
    EXPECT_TRUE(h.map == r.map) << "map differs";
  for (int e = 0; e < E; ++e) {
    EXPECT_EQ(h.selcounts[e], r.selection_counts[e]) << "selection_counts e=" << e;
    EXPECT_EQ(h.counts[e], r.counts[e]) << "counts e=" << e;
    EXPECT_EQ(h.counts64[e], r.counts[e]) << "counts64 e=" << e;
  }
  for (size_t i = 0; i < r.seq_counts.size(); ++i) EXPECT_EQ(h.seqcounts[i], r.seq_counts[i]) << "seq_counts " << i;
  int bad = 0;
  for (size_t i = 0; i < r.probs.size() && bad < 5; ++i)
    if (!(std::fabs(h.probs[i] - r.probs[i]) <= 64 * kU * std::fabs(r.probs[i]))) {
      ADD_FAILURE() << "prob " << i << ": got " << h.probs[i] << ", want " << r.probs[i];
      ++bad;
    }
  const double want[3] = {r.aux_loss, r.seq_aux_loss, r.z_loss};
  const float coeffs[3] = {cfg.aux_loss_coeff, cfg.seq_aux_loss_coeff, cfg.z_loss_coeff};
  for (int l = 0; l < 3; ++l)
    if (coeffs[l] != 0.0f) EXPECT_NEAR(h.losses[l], want[l], 1e-5 * std::fabs(want[l]) + 1e-30) << "loss " << l;

  const auto dz = ref::router_backward(cfg, in.z, T, r, in.dp, in.dl[0], in.dl[1], in.dl[2]);
  // Per row: the magnitudes the device combines (incoming gradients through the normalisation,
  // the loss scales, the z-loss term) bound its fp32 error.
  bad = 0;
  for (int64_t t = 0; t < T && bad < 5; ++t) {
    // |d/ds| of the probs: alpha * sum|g|, times 1/S <= E/k with renormalisation (S, the sum of
    // the k largest of E scores, is at least k/E for softmax; sigmoid scores here are far larger).
    double mag = 0;
    const int slots = cfg.output_form == RoutingForm::kMap ? E : k;
    for (int s = 0; s < slots && !in.dp.empty(); ++s) mag += std::fabs(in.dp[t * slots + s]);
    mag *= cfg.scaling_factor * (cfg.normalize_topk || cfg.softmax_after_topk ? double(E) / k : 1.0);
    // |d/da| of the balancing losses, and the z-loss factor 2 lse / T (|lse| < 30 here).
    if (T > 0) {
      int64_t cmax = 0, smax = 0;
      for (auto v : r.selection_counts) cmax = std::max(cmax, v);
      for (auto v : r.seq_counts) smax = std::max(smax, v);
      mag += 2 * std::fabs(in.dl[0]) * cfg.aux_loss_coeff * E * cmax / (double(T) * k * T);
      if (cfg.seq_aux_loss_coeff != 0.0f) {
        const double L = cfg.seq_length, B = double(T) / L;
        mag += 2 * std::fabs(in.dl[1]) * cfg.seq_aux_loss_coeff / B * (E / (k * L)) * smax / L;
      }
      mag += std::fabs(in.dl[2]) * cfg.z_loss_coeff * 60.0 / T;
    }
    for (int e = 0; e < E; ++e) {
      const size_t i = t * E + e;
      const double got = run.dlogit(h, i);
      double tol = 512 * kU * mag + 256 * kU * std::fabs(dz[i]);
      if (c.bf16) tol += std::ldexp(1.0, -8) * std::fabs(dz[i]);
      if (!(std::fabs(got - dz[i]) <= tol)) {
        ADD_FAILURE() << "d logits t=" << t << " e=" << e << ": got " << got << ", want " << dz[i] << " (tol " << tol
                      << ")";
        ++bad;
      }
    }
  }
}

void run_case(const Case& c) {
  const RouterConfig cfg = config_of(c);
  Router router(cfg);
  RouterRun run(cfg, c.T, router.selection_width(), c.bf16, c.offset);
  run.with_d_probs = !c.no_d_probs;
  const Inputs in = make_inputs(c, cfg, c.seed);
  run.upload(in.z, in.b, in.dp, in.dl);
  ErrorWord ew;
  run.poison();
  run.enqueue(router, ew.device_ptr(), nullptr, true);
  const auto first = run.download(ew);
  check(c, cfg, run, in, first);
  run.poison();
  run.enqueue(router, ew.device_ptr(), nullptr);
  EXPECT_TRUE(run.download(ew) == first) << c.name << ": a second run gave different bits";
}

Case make(const char* name, int E, int k, int64_t T, std::function<void(RouterConfig&)> edit = nullptr,
          bool bf16 = false) {
  Case c;
  c.name = name;
  c.E = E;
  c.k = k;
  c.T = T;
  c.edit = std::move(edit);
  c.bf16 = bf16;
  return c;
}

// Group-limited routing (`groups` expert groups, the best `topk_groups` kept) on logits ~ N(0, 1):
// sigmoid scores far from saturation, where near ties would be common.
Case make_grouped(const char* name, int E, int k, int64_t T, int groups, int topk_groups,
                  std::function<void(RouterConfig&)> edit, bool bf16 = false) {
  Case c = make(name, E, k, T, [=](RouterConfig& cfg) {
    cfg.num_groups = groups;
    cfg.topk_groups = topk_groups;
    if (edit) edit(cfg);
  }, bf16);
  c.scale = 1.0;
  return c;
}

// Sigmoid scores with an expert bias, renormalised (DeepSeek-V3's routing, unscaled).
void sigmoid_bias_norm(RouterConfig& c) {
  c.score = ScoreFunction::kSigmoid;
  c.normalize_topk = true;
  c.expert_bias = true;
}

TEST(Router, SoftmaxVariants) {
  MOE_REQUIRE_GPU();
  run_case(make("mixtral E8 k2 norm", 8, 2, 3000, [](RouterConfig& c) { c.normalize_topk = true; }));
  run_case(make("qwen3 E128 k8 norm bf16", 128, 8, 2000, [](RouterConfig& c) { c.normalize_topk = true; }, true));
  run_case(make("olmoe E64 k8 plain", 64, 8, 2000));
  run_case(make("gpt-oss E32 k4 after", 32, 4, 2000, [](RouterConfig& c) { c.softmax_after_topk = true; }));
  run_case(make("E7 k1", 7, 1, 999));
  run_case(make("E13 k13 (k = E) map", 13, 13, 500, [](RouterConfig& c) { c.output_form = RoutingForm::kMap; }));
  run_case(make("E512 k16 norm scaled", 512, 16, 700, [](RouterConfig& c) {
    c.normalize_topk = true;
    c.scaling_factor = 2.5f;
  }));
  run_case(make("E200 k6 map bf16", 200, 6, 800, [](RouterConfig& c) { c.output_form = RoutingForm::kMap; }, true));
  run_case(make("E1 k1", 1, 1, 100));
}

TEST(Router, SigmoidBiasGroups) {
  MOE_REQUIRE_GPU();
  auto dsv3 = [](RouterConfig& c) {
    sigmoid_bias_norm(c);
    c.scaling_factor = 2.5f;
  };
  run_case(make_grouped("deepseek-v3 E256 k8 G8/4", 256, 8, 1000, 8, 4, dsv3));
  run_case(make_grouped("deepseek-v3 bf16", 256, 8, 1000, 8, 4, dsv3, true));
  run_case(make("sigmoid E64 k6 no norm, bias", 64, 6, 1000, [](RouterConfig& c) {
    c.score = ScoreFunction::kSigmoid;
    c.expert_bias = true;
  }));
  run_case(make("sigmoid groups no bias E96 G32/8", 96, 4, 1000, [](RouterConfig& c) {
    c.score = ScoreFunction::kSigmoid;
    c.normalize_topk = true;
    c.num_groups = 32;
    c.topk_groups = 8;
  }));
  run_case(make("softmax with bias", 64, 4, 1000, [](RouterConfig& c) { c.expert_bias = true; }));
}

TEST(Router, Losses) {
  MOE_REQUIRE_GPU();
  run_case(make("aux + z softmax E64 k4", 64, 4, 4096, [](RouterConfig& c) {
    c.aux_loss_coeff = 0.01f;
    c.z_loss_coeff = 0.001f;
  }));
  run_case(make("all losses sigmoid E256 k8 L512", 256, 8, 2048, [](RouterConfig& c) {
    c.score = ScoreFunction::kSigmoid;
    c.normalize_topk = true;
    c.aux_loss_coeff = 0.01f;
    c.seq_aux_loss_coeff = 0.001f;
    c.seq_length = 512;
    c.z_loss_coeff = 0.001f;
  }));
  run_case(make("seq loss softmax after E32 k2 L7", 32, 2, 7 * 300, [](RouterConfig& c) {
    c.softmax_after_topk = true;
    c.seq_aux_loss_coeff = 0.1f;
    c.seq_length = 7;
  }, true));
  run_case(make("large T, many blocks", 128, 8, 20000, [](RouterConfig& c) {
    c.aux_loss_coeff = 0.01f;
    c.z_loss_coeff = 0.001f;
  }));
}

TEST(Router, CapacityAndRounding) {
  MOE_REQUIRE_GPU();
  run_case(make("capacity 1.0 by prob", 16, 2, 3000, [](RouterConfig& c) {
    c.capacity_factor = 1.0;
    c.normalize_topk = true;
  }));
  run_case(make("capacity 0.5 by position map", 64, 4, 3000, [](RouterConfig& c) {
    c.capacity_factor = 0.5;
    c.drop_policy = CapacityDropPolicy::kPosition;
    c.output_form = RoutingForm::kMap;
  }));
  run_case(make("rounding down tile 128", 32, 4, 5000, [](RouterConfig& c) {
    c.rounding = TokenRounding::kDown;
    c.normalize_topk = true;
  }));
  run_case(make("rounding up tile 64", 64, 4, 5000, [](RouterConfig& c) {
    c.rounding = TokenRounding::kUp;
    c.rounding_tile = 64;
    c.output_form = RoutingForm::kMap;
  }));
  run_case(make("rounding nearest sigmoid bias tile 16", 128, 8, 3000, [](RouterConfig& c) {
    c.score = ScoreFunction::kSigmoid;
    c.normalize_topk = true;
    c.expert_bias = true;
    c.rounding = TokenRounding::kNearest;
    c.rounding_tile = 16;
    c.output_form = RoutingForm::kMap;
    c.aux_loss_coeff = 0.01f;
  }));
  // Top-k form without losses at E >= 64: the backward of the chosen logits alone, where a dropped
  // slot gets no gradient but its score stays in the renormalising sum.
  run_case(make("capacity 0.8 by position, top-k form, bf16 (backward of the chosen logits)", 128, 4, 3001,
                [](RouterConfig& c) {
                  c.capacity_factor = 0.8;
                  c.drop_policy = CapacityDropPolicy::kPosition;
                  c.normalize_topk = true;
                },
                true));
  run_case(make("capacity 1.0 by position, softmax after, top-k form", 256, 8, 1999, [](RouterConfig& c) {
    c.capacity_factor = 1.0;
    c.drop_policy = CapacityDropPolicy::kPosition;
    c.softmax_after_topk = true;
  }));
  run_case(make("capacity 0.7 by position, sigmoid norm scaled, top-k form", 64, 6, 2500, [](RouterConfig& c) {
    c.score = ScoreFunction::kSigmoid;
    c.normalize_topk = true;
    c.scaling_factor = 2.5f;
    c.capacity_factor = 0.7;
    c.drop_policy = CapacityDropPolicy::kPosition;
  }));
  // One slot lane per row (k = 1), and no incoming d probs (a zero gradient, every row written).
  run_case(make("E256 k1 bf16 sigmoid, top-k form (one slot lane per row)", 256, 1, 1001,
                [](RouterConfig& c) { c.score = ScoreFunction::kSigmoid; }, true));
  Case none = make("E64 k3 sigmoid norm without d probs", 64, 3, 777, [](RouterConfig& c) {
    c.score = ScoreFunction::kSigmoid;
    c.normalize_topk = true;
  });
  none.no_d_probs = true;
  run_case(none);
}

TEST(Router, TiesAndNonFiniteLogits) {
  MOE_REQUIRE_GPU();
  // Logits on a coarse grid: many exact ties, broken toward the lower expert id.
  Case ties = make("ties", 40, 5, 2000, [](RouterConfig& c) { c.normalize_topk = true; });
  ties.edit_logits = [](std::vector<double>& z) {
    for (auto& v : z) v = std::round(v * 2.0) / 2.0;
  };
  run_case(ties);
  Case nan = make("nan / inf rows", 64, 4, 1000, [](RouterConfig& c) {
    c.aux_loss_coeff = 0.01f;
    c.z_loss_coeff = 0.01f;
  });
  nan.edit_logits = [](std::vector<double>& z) {
    z[5 * 64 + 3] = std::numeric_limits<double>::quiet_NaN();
    z[17 * 64 + 63] = std::numeric_limits<double>::infinity();
    z[999 * 64 + 0] = -std::numeric_limits<double>::infinity();
  };
  run_case(nan);
}

// Paths of the row kernels the cases above do not reach: the top-2 selection without a sort
// (selection width W <= 2) with a partial lane (E % 8 != 0), rows past T in the warp's last tile,
// and a rounding candidate as the second slot; rows of signed zeros, where -0 ties +0 (broken toward
// the lower id) with 32-bit and 64-bit keys; non-finite rows beside live rows of the same warp and
// tile, with the group limit, so that their stores are switched off while their warp's collectives
// still run.
TEST(Router, TopTwoSignedZerosAndPredicatedRows) {
  MOE_REQUIRE_GPU();
  auto signed_zero_rows = [](int E) {
    return [E](std::vector<double>& z) {
      const size_t T = z.size() / E;
      for (size_t t = 0; t < T; t += 7)
        for (int e = 0; e < E; ++e) z[t * E + e] = (e * 5 + t) % 3 == 0 ? -0.0 : 0.0;
    };
  };
  auto norm = [](RouterConfig& c) { c.normalize_topk = true; };
  Case z16 = make("E9 k2 bf16 (top-2, partial lane, tail rows, signed zeros)", 9, 2, 1001, norm, true);
  z16.edit_logits = signed_zero_rows(9);
  run_case(z16);
  Case z32 = make("E9 k2 fp32 (64-bit keys)", 9, 2, 1001, norm);
  z32.edit_logits = signed_zero_rows(9);
  run_case(z32);
  Case z40 = make("E40 k5 bf16 map, signed zeros (sorted path)", 40, 5, 333, [](RouterConfig& c) {
    c.output_form = RoutingForm::kMap;
  }, true);
  z40.edit_logits = signed_zero_rows(40);
  run_case(z40);
  run_case(make("E512 k1 rounding up (W = 2: a candidate)", 512, 1, 777, [](RouterConfig& c) {
    c.rounding = TokenRounding::kUp;
    c.rounding_tile = 16;
    c.output_form = RoutingForm::kMap;
  }));
  run_case(make("E256 k2 bf16 T 4097 aux + z (top-2, one row per warp)", 256, 2, 4097, [](RouterConfig& c) {
    c.normalize_topk = true;
    c.aux_loss_coeff = 0.01f;
    c.z_loss_coeff = 0.001f;
  }, true));
  // E = 64: 8 lanes per row, 4 rows per warp; T = 1001 leaves one live row in the last tile.
  Case bad = make_grouped("E64 G8/4 sigmoid bias, non-finite rows in partial tiles", 64, 6, 1001, 8, 4,
                          [](RouterConfig& c) {
                            sigmoid_bias_norm(c);
                            c.aux_loss_coeff = 0.01f;
                          });
  bad.edit_logits = [](std::vector<double>& z) {
    z[998 * 64 + 17] = std::numeric_limits<double>::quiet_NaN();  // tile of rows 996..999
    z[1000 * 64 + 63] = -std::numeric_limits<double>::infinity();  // the last tile's only row
    z[1 * 64 + 0] = std::numeric_limits<double>::infinity();
  };
  run_case(bad);
}

// The kernels' layouts: a token row in a group of G lanes (1..32), NJ experts per lane (8, or 16
// past 256 experts) read with 16-byte vectors when E is a multiple of NJ and the logits are aligned,
// element by element otherwise; several rows per warp with T not a multiple of them; many blocks
// with several rows per warp (the prefetch); the group-limit fast path (a group spans a power-of-two
// number of lanes) and its general path; 32-bit keys (bf16, no bias) and 64-bit keys.
TEST(Router, LaneGroupLayouts) {
  MOE_REQUIRE_GPU();
  auto norm = [](RouterConfig& c) { c.normalize_topk = true; };
  // Element loads: E not a multiple of 8 (bf16 and fp32), and aligned E with misaligned logits.
  run_case(make("E36 k3 bf16 (element loads, partial lane)", 36, 3, 1003, norm, true));
  run_case(make("E60 k5 fp32 map (element loads and stores)", 60, 5, 777, [](RouterConfig& c) {
    c.output_form = RoutingForm::kMap;
    c.aux_loss_coeff = 0.01f;
  }));
  Case mis = make("E64 k8 bf16 misaligned logits", 64, 8, 999, norm, true);
  mis.offset = 3;
  run_case(mis);
  Case mis32 = make("E128 k4 fp32 misaligned logits, z-loss", 128, 4, 555, [](RouterConfig& c) {
    c.z_loss_coeff = 0.001f;
  });
  mis32.offset = 1;
  run_case(mis32);
  // k = 1 and k = E, one and two lanes per row (32 and 16 rows per warp).
  run_case(make("E8 k1 bf16 (one lane per row)", 8, 1, 1001, nullptr, true));
  run_case(make("E8 k8 = E fp32 map", 8, 8, 333, [](RouterConfig& c) { c.output_form = RoutingForm::kMap; }));
  run_case(make("E16 k16 = E bf16 norm", 16, 16, 517, norm, true));
  run_case(make("E256 k1 bf16", 256, 1, 700, nullptr, true));
  // E > 256: 16 experts per lane.
  run_case(make("E384 k8 bf16 norm map", 384, 8, 300, [](RouterConfig& c) {
    c.normalize_topk = true;
    c.output_form = RoutingForm::kMap;
  }, true));
  run_case(make("E320 k6 fp32 aux + z", 320, 6, 400, [](RouterConfig& c) {
    c.aux_loss_coeff = 0.01f;
    c.z_loss_coeff = 0.001f;
  }));
  // Many blocks, several tiles per warp (the next row prefetched), losses summed across blocks.
  run_case(make("E64 k8 bf16 T 70000 aux + z", 64, 8, 70000, [](RouterConfig& c) {
    c.normalize_topk = true;
    c.aux_loss_coeff = 0.01f;
    c.z_loss_coeff = 0.001f;
  }, true));
  run_case(make("E256 k8 fp32 T 9001 softmax after, z-loss (general kernel)", 256, 8, 9001, [](RouterConfig& c) {
    c.softmax_after_topk = true;
    c.z_loss_coeff = 0.001f;
  }));
}

// Score forms of the plain top-k kernel's cases.
void norm(RouterConfig& c) { c.normalize_topk = true; }
void after(RouterConfig& c) { c.softmax_after_topk = true; }
void sigmoid(RouterConfig& c) { c.score = ScoreFunction::kSigmoid; }
void sigmoid_norm_scaled(RouterConfig& c) {
  c.score = ScoreFunction::kSigmoid;
  c.normalize_topk = true;
  c.scaling_factor = 2.5f;
}

// Logits of E experts on a 1/2 grid (many exact ties, broken toward the lower id), every 7th row
// signed zeros, and non-finite rows: NaN, +inf, -inf, and a negative NaN in the last row
// (T = 2001).
std::function<void(std::vector<double>&)> ties_signed_zeros_non_finite(size_t E) {
  return [E](std::vector<double>& z) {
    const size_t T = z.size() / E;
    for (auto& v : z) v = std::round(v * 2.0) / 2.0;
    for (size_t t = 0; t < T; t += 7)
      for (size_t e = 0; e < E; ++e) z[t * E + e] = (e * 5 + t) % 3 == 0 ? -0.0 : 0.0;
    z[5 * E + 3] = std::numeric_limits<double>::quiet_NaN();
    z[17 * E + E - 1] = std::numeric_limits<double>::infinity();
    z[18 * E + 0] = -std::numeric_limits<double>::infinity();
    z[(T - 1) * E + 100] = -std::numeric_limits<double>::quiet_NaN();  // the last tile's only row
  };
}

// Logits of E experts on a 1/16 grid (ties at the filter's threshold, a lane's candidates inserted
// in any order), and every 37th row constant (every logit a candidate: those warps take the sorted
// path, the others the filter, in one launch).
std::function<void(std::vector<double>&)> threshold_ties_constant_rows(size_t E) {
  return [E](std::vector<double>& z) {
    const size_t T = z.size() / E;
    for (auto& v : z) v = std::round(v * 16.0) / 16.0;
    for (size_t t = 0; t < T; t += 37)
      for (size_t e = 0; e < E; ++e) z[t * E + e] = 0.25;
  };
}

// E = 512 (16 lanes a row, vectors i 16 + g of lane g): every 5th row holds 48 equal maxima, the
// first expert of each lane's first three vectors, so the row has 48 candidates although no lane has
// more than three -- past the 32 slots of the bf16 row sort, whose warps take the sorted path.
void many_candidates_few_per_lane_512(std::vector<double>& z) {
  const size_t E = 512, T = z.size() / E;
  for (size_t t = 0; t < T; t += 5)
    for (size_t i = 0; i < 3; ++i)
      for (size_t g = 0; g < 16; ++g) z[t * E + (i * 16 + g) * 8] = 6.0;
}

// The plain top-k kernel (bf16 logits in 16-byte rows, E <= 512, k <= 8, no bias, group limit,
// loss, capacity or rounding): every layout -- one lane per row with 1, 2 or 4 vectors of 8
// experts, 2 to 16 lanes per row with 4 vectors (some past E), kept lists of 2, 4 and 8 keys --
// every score form (softmax renormalised, plain (its full-row sum across the lanes), over the chosen
// logits; sigmoid, renormalised or not; scaled), k = 1 and k = E, T not a multiple of a warp's rows,
// several row tiles per warp; a lane's slots written as 16- or 8-byte vectors (k = L) or one by one;
// counts of a warp's 16 or 32 rows merged per expert (E <= 64); ties on a coarse grid, signed
// zeros, and non-finite rows beside live rows of the same warp; the candidate filter (k <= G: a
// threshold from the lanes' largest logits and, for k > 2, their second values) beside warps that
// sort every vector (too many candidates in a lane, or, with 16 lanes a row, in a row); a row's
// candidates sorted across its 16 lanes (E = 512, lists of 8).
TEST(Router, PlainTopKKernelLayouts) {
  MOE_REQUIRE_GPU();
  run_case(make("E8 k1 plain (G1 V1 L2)", 8, 1, 1001, nullptr, true));
  run_case(make("E8 k8 = E norm (G1 V1 L8)", 8, 8, 333, norm, true));
  run_case(make("E16 k3 norm (G1 V2 L4)", 16, 3, 517, norm, true));
  run_case(make("E24 k2 sigmoid (G1 V4 L2, 3 of 4 vectors; slots as one 8-byte store)", 24, 2, 1201, sigmoid, true));
  run_case(make("E32 k4 after (G1 V4 L4)", 32, 4, 1003, after, true));
  run_case(make("E64 k8 plain (G2 L8, full-row sum over 2 lanes)", 64, 8, 2000, nullptr, true));
  run_case(make("E64 k4 norm (G2 L4, two slots per lane)", 64, 4, 1999, norm, true));
  run_case(make("E72 k6 sigmoid (G4, 9 of 16 vectors)", 72, 6, 999, sigmoid, true));
  run_case(make("E128 k2 sigmoid norm scaled (G4 L2)", 128, 2, 1500, sigmoid_norm_scaled, true));
  run_case(make("E128 k8 norm (G4 L8, two slots per lane)", 128, 8, 1777, norm, true));
  run_case(make("E200 k5 plain (G8 L8, 25 of 32 vectors, full-row sum over 8 lanes)", 200, 5, 777, nullptr, true));
  run_case(make("E256 k8 norm T 4099 (G8)", 256, 8, 4099, norm, true));
  run_case(make("E512 k7 after T 40003 (G16, several tiles per warp)", 512, 7, 40003, after, true));
  run_case(make("E512 k5 sigmoid norm scaled T 5003 (G16 L8: the row's candidates sorted across its lanes)",
                512, 5, 5003, sigmoid_norm_scaled, true));
  run_case(make("E512 k3 norm T 3001 (G16 L4)", 512, 3, 3001, norm, true));
  // The counts' two paths: two experts a 64-bit arrival atomic (a grid of fewer than 1024 blocks;
  // 528 at E = 128 on a 132-SM H100, more arrivals than 9 bits hold) and one (1024 blocks).
  run_case(make("E128 k2 norm T 65536 (a one-wave grid: counts two experts an atomic)", 128, 2, 65536, norm, true));
  run_case(make("E8 k2 plain T 300000 (1024 blocks: counts one expert an atomic)", 8, 2, 300000, nullptr, true));
  Case ties = make("E256 k8 norm: ties, signed zeros, non-finite rows", 256, 8, 2001, norm, true);
  ties.edit_logits = ties_signed_zeros_non_finite(256);
  run_case(ties);
  Case ties512 = make("E512 k8 norm: ties, signed zeros, non-finite rows (G16, sorted across lanes)", 512, 8,
                      2001, norm, true);
  ties512.edit_logits = ties_signed_zeros_non_finite(512);
  run_case(ties512);
  Case crowded = make("E512 k6 norm: 48 candidates, 3 a lane (past the row sort's 32 slots)", 512, 6, 1003, norm,
                      true);
  crowded.edit_logits = many_candidates_few_per_lane_512;
  run_case(crowded);
  Case grid = make("E256 k4 sigmoid: ties at the filter's threshold, constant rows", 256, 4, 3001, sigmoid, true);
  grid.edit_logits = threshold_ties_constant_rows(256);
  run_case(grid);
  Case ties8 = make("E8 k2 norm: ties and non-finite rows, one lane per row", 8, 2, 999, norm, true);
  ties8.edit_logits = [](std::vector<double>& z) {
    for (auto& v : z) v = std::round(v);
    z[3 * 8 + 7] = std::numeric_limits<double>::infinity();
    z[998 * 8 + 0] = std::numeric_limits<double>::quiet_NaN();
  };
  run_case(ties8);
}

// The plain top-k kernel on fp32 logits (64-bit keys, 16-byte vectors of 4 experts, 32 experts per
// lane): one lane per row with 2, 4 or 8 vectors (some past E), 2 lanes per row (every vector
// sorted), 4 to 16 lanes per row with the candidate filter (k <= G) and without it (k > G), kept
// lists of 2, 4 and 8 keys, every score form, k = 1 and k = E, several row tiles per warp; ties on a
// coarse grid, signed zeros, non-finite rows beside live rows; ties at the filter's threshold beside
// constant rows (those warps sort every vector); misaligned logits (the general kernel).
TEST(Router, PlainTopKKernelLayoutsFp32) {
  MOE_REQUIRE_GPU();
  run_case(make("fp32 E8 k1 plain (G1 V2 L2)", 8, 1, 1001, nullptr));
  run_case(make("fp32 E8 k8 = E norm (G1 V2 L8)", 8, 8, 333, norm));
  run_case(make("fp32 E16 k3 norm (G1 V4 L4)", 16, 3, 517, norm));
  run_case(make("fp32 E24 k2 sigmoid (G1 V8 L2, 6 of 8 vectors)", 24, 2, 1201, sigmoid));
  run_case(make("fp32 E32 k4 after (G1 V8 L4)", 32, 4, 1003, after));
  run_case(make("fp32 E64 k8 plain (G2 L8, full-row sum over 2 lanes)", 64, 8, 2000, nullptr));
  run_case(make("fp32 E72 k4 sigmoid (G4 filter, 18 of 32 vectors)", 72, 4, 999, sigmoid));
  run_case(make("fp32 E128 k2 sigmoid norm scaled (G4 filter L2)", 128, 2, 1500, sigmoid_norm_scaled));
  run_case(make("fp32 E128 k8 norm (G4 sorted L8, two slots per lane)", 128, 8, 1777, norm));
  run_case(make("fp32 E200 k5 plain (G8 filter L8, 50 of 64 vectors, full-row sum)", 200, 5, 777, nullptr));
  run_case(make("fp32 E256 k8 norm T 4099 (G8 filter)", 256, 8, 4099, norm));
  run_case(make("fp32 E256 k2 plain T 65537 (G8 filter L2, several tiles per warp)", 256, 2, 65537, nullptr));
  run_case(make("fp32 E512 k7 after T 40003 (G16 filter)", 512, 7, 40003, after));
  Case ties = make("fp32 E256 k8 norm: ties, signed zeros, non-finite rows", 256, 8, 2001, norm);
  ties.edit_logits = ties_signed_zeros_non_finite(256);
  run_case(ties);
  Case ties64 = make("fp32 E64 k4 sigmoid: ties and non-finite rows (G2, sorted)", 64, 4, 1001, sigmoid);
  ties64.edit_logits = [](std::vector<double>& z) {
    for (auto& v : z) v = std::round(v);
    z[3 * 64 + 63] = std::numeric_limits<double>::infinity();
    z[4 * 64 + 0] = -std::numeric_limits<double>::infinity();
    z[1000 * 64 + 7] = std::numeric_limits<double>::quiet_NaN();
  };
  run_case(ties64);
  Case grid = make("fp32 E256 k4 sigmoid: ties at the filter's threshold, constant rows", 256, 4, 3001, sigmoid);
  grid.edit_logits = threshold_ties_constant_rows(256);
  run_case(grid);
  run_case(make("fp32 E256 k1 plain (G8 filter, the threshold is the row's max; slots one by one)", 256, 1, 1001,
                nullptr));
  run_case(make("fp32 E320 k2 sigmoid (G16 filter L2, 80 of 128 vectors)", 320, 2, 3001, sigmoid));
  run_case(make("fp32 E400 k4 norm (G16 filter L4, 100 of 128 vectors)", 400, 4, 2001, norm));
  Case ties8 = make("fp32 E8 k2 norm: ties and non-finite rows, one lane per row", 8, 2, 999, norm);
  ties8.edit_logits = [](std::vector<double>& z) {
    for (auto& v : z) v = std::round(v);
    z[3 * 8 + 7] = std::numeric_limits<double>::infinity();
    z[998 * 8 + 0] = std::numeric_limits<double>::quiet_NaN();
  };
  run_case(ties8);
  // Real logits equal to the filler of vectors past E (the lowest finite float) and to the largest:
  // whole rows of -FLT_MAX (every logit a candidate), and single ones beside ordinary logits.
  Case extremes = make("fp32 E200 k4 sigmoid: -FLT_MAX rows and +-FLT_MAX logits", 200, 4, 1501, sigmoid);
  extremes.edit_logits = [](std::vector<double>& z) {
    const size_t E = 200, T = z.size() / E;
    const double lowest = std::numeric_limits<float>::lowest(), largest = std::numeric_limits<float>::max();
    for (size_t t = 0; t < T; t += 11)
      for (size_t e = 0; e < E; ++e) z[t * E + e] = lowest;
    for (size_t t = 5; t < T; t += 13) {
      z[t * E + (t % E)] = largest;
      z[t * E + ((t * 7) % E)] = lowest;
    }
  };
  run_case(extremes);
  Case mis = make("fp32 E256 k8 misaligned logits (general kernel)", 256, 8, 555, norm);
  mis.offset = 1;
  run_case(mis);
}

// The biased / group-limited kernel's configurations: sigmoid scores, a bias and / or a group limit.
std::function<void(RouterConfig&)> grouped_bias(int groups, int topk_groups, bool bias = true, bool normalize = true,
                                float scale = 1.0f) {
  return [=](RouterConfig& c) {
    c.score = ScoreFunction::kSigmoid;
    c.expert_bias = bias;
    c.normalize_topk = normalize;
    c.scaling_factor = scale;
    c.num_groups = groups;
    c.topk_groups = topk_groups;
  };
}

// The same inputs through the biased kernel (16-byte aligned logits) and the general kernel (the
// logits one element off that alignment): selection, counts, probs and error bits equal bit for bit
// -- ties included, which the fp64 reference cannot judge.
void run_against_general(const Case& c, const std::function<void(std::vector<double>&)>& edit_bias = nullptr) {
  SCOPED_TRACE(c.name);
  const RouterConfig cfg = config_of(c);
  Router router(cfg);
  Inputs in = make_inputs(c, cfg, c.seed);
  if (edit_bias) edit_bias(in.b);
  RouterRun::Host got[2];
  for (int64_t offset : {0, 1}) {
    RouterRun run(cfg, c.T, router.selection_width(), c.bf16, offset);
    run.upload(in.z, in.b, in.dp, in.dl);
    ErrorWord ew;
    run.poison();
    run.enqueue(router, ew.device_ptr(), nullptr, true);
    got[offset] = run.download(ew);
  }
  EXPECT_EQ(got[0].bits, got[1].bits) << describe_error_bits(got[0].bits) << " vs " << describe_error_bits(got[1].bits);
  EXPECT_TRUE(got[0].selected == got[1].selected) << "selected differs";
  EXPECT_TRUE(got[0].indices == got[1].indices) << "indices differ";
  EXPECT_TRUE(got[0].selcounts == got[1].selcounts) << "selection_counts differ";
  EXPECT_TRUE(got[0].counts == got[1].counts && got[0].counts64 == got[1].counts64) << "counts differ";
  int bad = 0;
  for (size_t i = 0; i < got[0].probs.size() && bad < 5; ++i)
    if (std::memcmp(&got[0].probs[i], &got[1].probs[i], 4) != 0) {
      ADD_FAILURE() << "prob " << i << ": " << got[0].probs[i] << " vs the general kernel's " << got[1].probs[i];
      ++bad;
    }
}

// The biased / group-limited kernel against the reference: two lanes a row (every vector sorted),
// four (the filter with lists of 2 and 4, sorted lists of 8), eight and sixteen (the filter, ranked);
// groups of vectors on one lane index (nv >= G, with nv > G a lane's vectors of one group merged) or
// on consecutive lanes (nv < G); vectors past E; the logits ordering the experts (no bias); k = 1;
// probs not renormalised, scaled; non-finite rows.
TEST(Router, BiasedTopKKernelLayouts) {
  MOE_REQUIRE_GPU();
  run_case(make("E64 k2 bias bf16 (G2 L2 sorted)", 64, 2, 900, grouped_bias(1, 1), true));
  run_case(make("E64 k8 G8/4 bias fp32 (G2 L8, nv 2 = G)", 64, 8, 700, grouped_bias(8, 4)));
  run_case(make("E128 k2 G8/4 bias fp32 (G4 filter L2, nv 4 = G)", 128, 2, 800, grouped_bias(8, 4)));
  run_case(make("E128 k4 G4/2 bias bf16 (G4 ranked L4, nv 8 > G)", 128, 4, 800, grouped_bias(4, 2), true));
  run_case(make("E128 k8 bias fp32 not renormalised, scaled (G4 sorted L8)", 128, 8, 600,
                grouped_bias(1, 1, true, false, 2.5f)));
  run_case(make("E256 k1 G16/4 bias fp32 (G8 filter L2, nv 4 < G)", 256, 1, 700, grouped_bias(16, 4)));
  run_case(make("E256 k4 G8/4 no bias bf16 (the logits order, G8 ranked L4)", 256, 4, 700,
                grouped_bias(8, 4, false), true));
  run_case(make("E256 k8 G2/1 bias bf16 (nv 32: four vectors of a lane a group)", 256, 8, 600, grouped_bias(2, 1),
                true));
  run_case(make("E512 k8 G8/4 bias fp32 (G16 ranked L8, nv 16 = G)", 512, 8, 500, grouped_bias(8, 4)));
  run_case(make("E512 k3 G32/8 bias bf16 (G16, nv 4 < G)", 512, 3, 500, grouped_bias(32, 8), true));
  run_case(make("E200 k6 G25/5 bias fp32 (G8, 50 of 64 vectors, nv 2)", 200, 6, 700, grouped_bias(25, 5)));
  run_case(make("E320 k2 bias bf16 (G16, 80 of 128 vectors)", 320, 2, 700, grouped_bias(1, 1), true));
  Case nf = make("E256 k8 G8/4 bias bf16: non-finite rows", 256, 8, 800, grouped_bias(8, 4, true, true, 2.5f), true);
  nf.edit_logits = [](std::vector<double>& z) {
    z[3 * 256 + 17] = std::numeric_limits<double>::quiet_NaN();
    z[40 * 256 + 255] = std::numeric_limits<double>::infinity();
    z[799 * 256 + 0] = -std::numeric_limits<double>::infinity();  // the last tile's last row
  };
  run_case(nf);
}

// The biased / group-limited kernel bit for bit against the general kernel: several row tiles per
// warp, ties (coarse logits, a zero bias, constant rows, equal group scores), signed zeros,
// non-finite rows and a non-finite bias, every lane layout.
TEST(Router, BiasedTopKKernelMatchesGeneralKernel) {
  MOE_REQUIRE_GPU();
  auto coarse = [](double step) {
    return [step](std::vector<double>& z) {
      for (auto& v : z) v = std::round(v / step) * step;
    };
  };
  auto zero_bias = [](std::vector<double>& b) { std::fill(b.begin(), b.end(), 0.0); };
  Case big = make("dsv3 bf16 E256 k8 G8/4 T 40003", 256, 8, 40003, grouped_bias(8, 4, true, true, 2.5f), true);
  run_against_general(big);
  Case big32 = make("dsv3 fp32 E256 k8 G8/4 T 20001", 256, 8, 20001, grouped_bias(8, 4, true, true, 2.5f));
  run_against_general(big32);
  Case ties = make("E256 k8 G8/4 zero bias, logits on a 1/4 grid, constant rows and non-finite rows", 256, 8,
                   3001, grouped_bias(8, 4), true);
  ties.edit_logits = [](std::vector<double>& z) {
    const size_t E = 256, T = z.size() / E;
    for (auto& v : z) v = std::round(v * 4.0) / 4.0;
    for (size_t t = 0; t < T; t += 37)
      for (size_t e = 0; e < E; ++e) z[t * E + e] = (e * 5 + t) % 3 == 0 ? -0.0 : 0.0;
    z[5 * E + 3] = std::numeric_limits<double>::quiet_NaN();
    z[(T - 1) * E + 100] = -std::numeric_limits<double>::infinity();
  };
  run_against_general(ties, zero_bias);
  for (int E : {64, 128, 256, 512}) {
    for (int k : {1, 2, 4, 8}) {
      Case c = make("ties", E, k, 2001, grouped_bias(8, 4, k != 4, k != 2), E != 128);
      c.name = "E" + std::to_string(E) + " k" + std::to_string(k) + " G8/4 " + (k == 4 ? "no bias" : "bias") +
               (E != 128 ? " bf16" : " fp32") + ", logits on a 1/2 grid";
      c.seed = 11 + E + k;
      c.edit_logits = coarse(0.5);
      run_against_general(c, k == 8 ? std::function<void(std::vector<double>&)>(zero_bias) : nullptr);
    }
  }
  run_against_general(make("E200 k5 G25/5 bias fp32 T 9001", 200, 5, 9001, grouped_bias(25, 5)));
  run_against_general(make("E512 k6 G16/8 bias bf16 T 7001", 512, 6, 7001, grouped_bias(16, 8), true));
  run_against_general(make("E256 k3 bias only, fp32 T 5001", 256, 3, 5001, grouped_bias(1, 1)));
  // Logits far below -87 in some rows (1 + exp(-z) at or above 2^126: the division's slow path, a sigmoid
  // of 0 for z < -88.7) and far above in others (a sigmoid of 1), beside ordinary rows.
  for (bool bf16 : {false, true}) {
    Case sat = make(bf16 ? "E256 k8 G8/4 bf16: saturated sigmoids" : "E256 k8 G8/4 fp32: saturated sigmoids", 256, 8,
                    2001, grouped_bias(8, 4), bf16);
    sat.edit_logits = [](std::vector<double>& z) {
      const size_t E = 256, T = z.size() / E;
      for (size_t t = 0; t < T; t += 3)
        for (size_t e = (t * 7) % 5; e < E; e += 5) z[t * E + e] = t % 2 ? -87.0 - double(e % 9) * 1.5 : 60.0 + e % 7;
    };
    run_against_general(sat);
  }
  // Selection values a few units of the last place apart (coarse logits moved by a few 1e-6, biases
  // 1e-7 apart): group scores and candidates that only the exact fp32 scores order; E = 128 and 512
  // too (other lanes per row), with and without a group limit.
  for (int E : {128, 256, 512}) {
    for (bool bf16 : {false, true}) {
      Case near = make("near ties", E, E == 256 ? 8 : 2, 2001, grouped_bias(E == 512 ? 1 : 8, E == 512 ? 1 : 4), bf16);
      near.name = "E" + std::to_string(E) + (bf16 ? " bf16" : " fp32") + ": values a few units of the last place apart";
      near.seed = 5 + E + bf16;
      near.edit_logits = [E](std::vector<double>& z) {
        for (size_t i = 0; i < z.size(); ++i) z[i] = std::round(z[i] * 2.0) / 2.0 + 1e-6 * double(i % E % 5);
      };
      run_against_general(near, [](std::vector<double>& b) {
        for (size_t e = 0; e < b.size(); ++e) b[e] = 0.01 + 1e-7 * double(e % 11);
      });
    }
  }
  Case inf_bias = make("E256 k8 G8/4: a non-finite bias (every row unrouted)", 256, 8, 300, grouped_bias(8, 4), true);
  run_against_general(inf_bias, [](std::vector<double>& b) { b[77] = std::numeric_limits<double>::infinity(); });
}

// The group-limit layouts, one test each so that a failure names its layout.
// bf16 without a bias (32-bit keys) and group limit: fast path (16 experts per group: 2 lanes of a
// group of 8 lanes per row, four rows per warp).
TEST(Router, GroupLimitFastPathTwoLanesPerGroup) {
  MOE_REQUIRE_GPU();
  run_case(make_grouped("E64 G4/2 bf16 softmax no bias", 64, 4, 1000, 4, 2,
                        [](RouterConfig& c) { c.normalize_topk = true; }, true));
}

// General path: 48 experts per group of E = 384 (16 per lane, 3 lanes per group), with a bias.
TEST(Router, GroupLimitGeneralPathWide) {
  MOE_REQUIRE_GPU();
  run_case(make_grouped("E384 G8/3 sigmoid bias bf16", 384, 8, 500, 8, 3, sigmoid_bias_norm, true));
}

// General path: groups smaller than a lane's experts (E = 24: 4 experts per group, 8 per lane).
TEST(Router, GroupLimitGeneralPathSmallGroups) {
  MOE_REQUIRE_GPU();
  run_case(make_grouped("E24 G6/3 sigmoid fp32", 24, 4, 800, 6, 3,
                        [](RouterConfig& c) { c.score = ScoreFunction::kSigmoid; }));
}

// Fast path with one lane per group (8 experts per group), 64-bit keys (bias), seq loss.
TEST(Router, GroupLimitFastPathOneLanePerGroupSeqLoss) {
  MOE_REQUIRE_GPU();
  run_case(make_grouped("E128 G16/4 sigmoid bias seq loss", 128, 6, 1024, 16, 4, [](RouterConfig& c) {
    sigmoid_bias_norm(c);
    c.seq_aux_loss_coeff = 0.001f;
    c.seq_length = 256;
  }));
}

// Calls with fewer tokens than max_tokens, and T = 0.
TEST(Router, ShorterBatchesAndEmpty) {
  MOE_REQUIRE_GPU();
  Case c = make("T_max 4096", 64, 6, 4096, [](RouterConfig& cfg) {
    cfg.aux_loss_coeff = 0.01f;
    cfg.capacity_factor = 1.25;
  });
  RouterConfig cfg = config_of(c);
  Router router(cfg);
  for (int64_t T : {4096, 100, 0, 37}) {
    Case v = c;
    v.T = T;
    v.seed = 3 + T;
    v.name += " T=" + std::to_string(T);
    RouterRun run(cfg, T, router.selection_width(), false);
    const Inputs in = make_inputs(v, cfg, v.seed);
    run.upload(in.z, in.b, in.dp, in.dl);
    ErrorWord ew;
    run.poison();
    run.enqueue(router, ew.device_ptr(), nullptr);
    check(v, cfg, run, in, run.download(ew));
  }
}

// Capture once; replays with new logits in the same buffers == eager.
TEST(Router, GraphReplayMatchesEager) {
  MOE_REQUIRE_GPU();
  // Mode 0: the plain top-k kernel (bf16, renormalised softmax); 1: the general row kernel with
  // every feature; 2: the same with token rounding (the select pass); 3: the biased / group-limited
  // kernel (mode 1 without the losses).
  for (int mode : {0, 1, 2, 3}) {
    const bool rounding = mode == 2;
    Case c = make("graph", 256, 8, 1024, [mode, rounding](RouterConfig& cfg) {
      if (mode == 0) {
        cfg.normalize_topk = true;
        return;
      }
      sigmoid_bias_norm(cfg);
      cfg.num_groups = 8;
      cfg.topk_groups = 4;
      if (mode == 3) return;
      cfg.aux_loss_coeff = 0.01f;
      cfg.seq_aux_loss_coeff = 0.001f;
      cfg.seq_length = 512;
      cfg.z_loss_coeff = 0.001f;
      if (rounding) {
        cfg.rounding = TokenRounding::kNearest;
        cfg.output_form = RoutingForm::kMap;
      }
    }, mode == 0);
    const RouterConfig cfg = config_of(c);
    Router router(cfg);
    RouterRun run(cfg, c.T, router.selection_width(), c.bf16);
    ErrorWord ew;
    cudaStream_t s;
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    Inputs in = make_inputs(c, cfg, 100);
    run.upload(in.z, in.b, in.dp, in.dl);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    run.enqueue(router, ew.device_ptr(), s);
    MOE_CUDA_CHECK(cudaStreamEndCapture(s, &graph));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    for (int step = 0; step < 3; ++step) {
      Case v = c;
      v.scale = 0.75 + 0.25 * step;
      if (step == 2) v.edit_logits = [](std::vector<double>& z) { z[77] = std::numeric_limits<double>::quiet_NaN(); };
      in = make_inputs(v, cfg, 200 + step);  // seeds whose decisions are 5x above the near-tie bound
      run.upload(in.z, in.b, in.dp, in.dl);
      run.poison();
      MOE_CUDA_CHECK(cudaGraphLaunch(exec, s));
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      const auto replayed = run.download(ew);
      check(v, cfg, run, in, replayed);
      run.poison();
      run.enqueue(router, ew.device_ptr(), s);
      MOE_CUDA_CHECK(cudaStreamSynchronize(s));
      EXPECT_TRUE(run.download(ew) == replayed) << "graph replay differs from eager, step " << step;
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(s);
  }
}

TEST(Router, BiasUpdate) {
  MOE_REQUIRE_GPU();
  const int E = 300;
  std::mt19937_64 rng(5);
  std::vector<int64_t> counts(E);
  std::vector<double> bias(E);
  for (int e = 0; e < E; ++e) {
    counts[e] = static_cast<int64_t>(rng() % 50);
    bias[e] = static_cast<float>(static_cast<double>(rng() % 1000) / 1000.0 - 0.5);
  }
  counts[3] = 0;
  for (bool wide : {false, true}) {
    DeviceBuffer<float> b(std::vector<float>(bias.begin(), bias.end()));
    DeviceBuffer<int64_t> c64(counts);
    DeviceBuffer<int32_t> c32(std::vector<int32_t>(counts.begin(), counts.end()));
    const TensorView cv = wide ? TensorView(c64.get(), DType::kInt64, {E}) : TensorView(c32.get(), DType::kInt32, {E});
    update_expert_bias(cv, TensorView(b.get(), DType::kFP32, {E}), 0.001f, nullptr);
    const auto got = b.download();
    const auto want = ref::update_expert_bias(counts, bias, 0.001f);
    for (int e = 0; e < E; ++e)  // one fp32 addition of +-rate: exact after rounding to fp32
      EXPECT_EQ(got[e], static_cast<float>(static_cast<float>(bias[e]) + (want[e] > bias[e] ? 0.001f
                                                                          : want[e] < bias[e] ? -0.001f : 0.0f)))
          << "e=" << e;
  }
}

TEST(Router, HostCheckedArguments) {
  MOE_REQUIRE_GPU();
  RouterConfig cfg;
  cfg.num_experts = 16;
  cfg.topk = 2;
  cfg.max_tokens = 64;
  expect_error_naming([&] { RouterConfig c = cfg; c.num_experts = 600; Router r(c); }, "num_experts");
  expect_error_naming([&] { RouterConfig c = cfg; c.num_groups = 3; Router r(c); }, "num_groups");
  Router router(cfg);
  RouterRun run(cfg, 64, router.selection_width(), false);
  ErrorWord ew;
  const RouterOutputs o = run.outputs();
  expect_error_naming([&] { router.forward(run.logits_view(), TensorView(), o, nullptr, nullptr); }, "error_word");
  TensorView big(run.logits.get(), DType::kFP32, {65, 16});
  expect_error_naming([&] { router.forward(big, TensorView(), o, ew.device_ptr(), nullptr); }, "logits");
  TensorView wrong(run.logits.get(), DType::kFP16, {64, 16});
  expect_error_naming([&] { router.forward(wrong, TensorView(), o, ew.device_ptr(), nullptr); }, "logits");
  expect_error_naming([&] { router.forward(run.logits_view(), TensorView(run.bias.get(), DType::kFP32, {16}), o,
                                           ew.device_ptr(), nullptr); }, "bias");
  RouterOutputs bad = o;
  bad.indices = TensorView(run.indices.get(), DType::kInt32, {64, 3});
  expect_error_naming([&] { router.forward(run.logits_view(), TensorView(), bad, ew.device_ptr(), nullptr); },
                      "indices");
  bad = o;
  bad.selected = TensorView(run.selected.get(), DType::kInt64, {64, 2});
  expect_error_naming([&] { router.forward(run.logits_view(), TensorView(), bad, ew.device_ptr(), nullptr); },
                      "selected");
  bad = o;
  bad.counts_int64 = TensorView(run.counts.get(), DType::kInt32, {16});
  expect_error_naming([&] { router.forward(run.logits_view(), TensorView(), bad, ew.device_ptr(), nullptr); },
                      "counts_int64");
  // One buffer given as two outputs.
  bad = o;
  bad.selected = o.indices;  // both int32 [64, 2] here
  expect_error_naming([&] { router.forward(run.logits_view(), TensorView(), bad, ew.device_ptr(), nullptr); },
                      "selected");
  bad = o;
  bad.counts = o.selection_counts;
  expect_error_naming([&] { router.forward(run.logits_view(), TensorView(), bad, ew.device_ptr(), nullptr); },
                      "counts");
  bad = o;
  bad.counts_int64 = TensorView(run.counts.get(), DType::kInt64, {16});  // the int32 counts and past them
  expect_error_naming([&] { router.forward(run.logits_view(), TensorView(), bad, ew.device_ptr(), nullptr); },
                      "counts_int64");
  RouterGrads g = run.grads();
  g.d_probs = TensorView(run.dprobs.get(), DType::kFP32, {64, 16});
  expect_error_naming([&] { router.backward(run.logits_view(), o, g, run.dlogits_view(), nullptr); }, "d_probs");
  expect_error_naming([&] { router.backward(run.logits_view(), o, run.grads(),
                                            TensorView(run.dlogits.get(), DType::kBF16, {64, 16}), nullptr); },
                      "d_logits");
  RouterConfig seq = cfg;
  seq.seq_aux_loss_coeff = 0.1f;
  seq.seq_length = 10;
  Router rs(seq);
  RouterRun rseq(seq, 60, rs.selection_width(), false);
  expect_error_naming([&] { rs.forward(run.logits_view(), TensorView(), rseq.outputs(), ew.device_ptr(), nullptr); },
                      "seq_length");
  expect_error_naming([&] { update_expert_bias(TensorView(run.bias.get(), DType::kFP32, {16}),
                                               TensorView(run.bias.get(), DType::kFP32, {16}), 0.1f, nullptr); },
                      "counts");
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  EXPECT_EQ(ew.fetch_and_clear(nullptr), 0u);
}

}  // namespace
}  // namespace moe
