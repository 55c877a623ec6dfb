#include "reference/routing_gen.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <utility>

#include "moe/error.h"

namespace moe::ref {

Routing make_topk_routing(int64_t T, int E, int k, uint64_t seed, double skew) {
  MOE_CHECK(E > 0 && k > 0 && k <= E, "make_topk_routing: expected 1 <= k <= E, got k=", k, ", E=", E);
  Routing r;
  r.form = RoutingForm::kTopK;
  r.T = T;
  r.E = E;
  r.k = k;
  r.indices.resize(static_cast<size_t>(T) * k);
  r.probs.resize(static_cast<size_t>(T) * k);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<double> logits(E), score(E);
  std::vector<int> order(E);
  for (int64_t t = 0; t < T; ++t) {
    double mx = -1e300;
    for (int e = 0; e < E; ++e) {
      logits[e] = normal(rng) - skew * std::log(1.0 + e);
      mx = std::max(mx, logits[e]);
    }
    double sum = 0;
    for (int e = 0; e < E; ++e) sum += (score[e] = std::exp(logits[e] - mx));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + k, order.end(),
                      [&](int a, int b) { return score[a] > score[b] || (score[a] == score[b] && a < b); });
    for (int s = 0; s < k; ++s) {
      r.indices[t * k + s] = order[s];
      r.probs[t * k + s] = static_cast<float>(score[order[s]] / sum);
    }
  }
  return r;
}

Routing make_map_routing(int64_t T, int E, int max_per_token, uint64_t seed) {
  MOE_CHECK(E > 0 && max_per_token >= 0 && max_per_token <= E,
            "make_map_routing: expected 0 <= max_per_token <= E, got ", max_per_token);
  Routing r;
  r.form = RoutingForm::kMap;
  r.T = T;
  r.E = E;
  r.k = max_per_token;
  r.map.assign(static_cast<size_t>(T) * E, 0);
  r.probs.assign(static_cast<size_t>(T) * E, 0.0f);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> uni(0.05f, 1.0f);
  std::vector<int> experts(E);
  std::iota(experts.begin(), experts.end(), 0);
  for (int64_t t = 0; t < T; ++t) {
    int n = static_cast<int>(rng() % static_cast<uint64_t>(max_per_token + 1));
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int i = 0; i < n; ++i) {
      r.map[t * E + experts[i]] = 1;
      r.probs[t * E + experts[i]] = uni(rng);
    }
  }
  return r;
}

Routing topk_to_map(const Routing& topk) {
  MOE_CHECK(topk.form == RoutingForm::kTopK, "topk_to_map: expected top-k routing");
  Routing r;
  r.form = RoutingForm::kMap;
  r.T = topk.T;
  r.E = topk.E;
  r.k = topk.k;
  r.map.assign(static_cast<size_t>(r.T) * r.E, 0);
  r.probs.assign(static_cast<size_t>(r.T) * r.E, 0.0f);
  for (int64_t t = 0; t < r.T; ++t)
    for (int s = 0; s < topk.k; ++s) {
      int e = topk.indices[t * topk.k + s];
      if (e < 0 || e >= r.E) continue;
      r.map[t * r.E + e] = 1;
      r.probs[t * r.E + e] = topk.probs[t * topk.k + s];
    }
  return r;
}

Routing topk_routing(int64_t T, int E, int k, std::vector<int32_t> indices, std::vector<double> probs) {
  Routing r;
  r.form = RoutingForm::kTopK;
  r.T = T;
  r.E = E;
  r.k = k;
  r.indices = std::move(indices);
  if (probs.empty())
    for (size_t i = 0; i < r.indices.size(); ++i) probs.push_back(0.125 * static_cast<double>(i + 1));
  r.probs = std::move(probs);
  return r;
}

}  // namespace moe::ref
