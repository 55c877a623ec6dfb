// Routing generators shared by tests, benchmarks and the CLI: softmax over standard-normal logits
// then top-k (docs/shapes.md, Routing), optionally skewed towards popular experts (Zipf-like),
// fixed seed.
#pragma once

#include <cstdint>
#include <vector>

#include "reference/routing_ref.h"

namespace moe::ref {

// Top-k routing [T, k]; skew = 0 balanced on average, skew > 0 adds log-popularity -skew*log(1+e)
// to expert e's logit (Zipf-like). Probs are the top-k softmax values (not renormalised).
Routing make_topk_routing(int64_t T, int E, int k, uint64_t seed, double skew = 0.0);

// Map-form routing [T, E]: each token goes to a random number of experts in [0, max_per_token].
Routing make_map_routing(int64_t T, int E, int max_per_token, uint64_t seed);

// A top-k routing with the given expert ids [T * k] (-1 = empty slot) and probs; without probs,
// slot i gets 0.125 * (i + 1) (distinct, exactly representable: hand-computed test cases).
Routing topk_routing(int64_t T, int E, int k, std::vector<int32_t> indices, std::vector<double> probs = {});

// Map form of a top-k routing (same experts and probs, placed in [T, E]).
Routing topk_to_map(const Routing& topk);

}  // namespace moe::ref
