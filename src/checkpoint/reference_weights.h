// fp64 copies of ExpertWeights and the ref::ExpertParams pointer tables into them, for the CPU
// reference (src/reference/grouped_mlp_ref.h). Single-grouped weights become one block per
// parameter with the experts' pointers inside it, per-expert weights one block per expert -- the
// same layouts the GPU layer binds, so layout parity can be tested through the reference too.
#pragma once

#include <vector>

#include "moe/checkpoint.h"
#include "reference/grouped_mlp_ref.h"

namespace moe {

struct ReferenceWeights {
  std::vector<std::vector<double>> blocks;  // owns the values the pointers below point into
  ref::ExpertParams params;

  ReferenceWeights() = default;
  ReferenceWeights(const ReferenceWeights&) = delete;  // params point into blocks
  ReferenceWeights& operator=(const ReferenceWeights&) = delete;
  ReferenceWeights(ReferenceWeights&&) = default;  // moving a vector keeps its heap buffers
  ReferenceWeights& operator=(ReferenceWeights&&) = default;
};

// Values converted exactly (bf16, fp16 and fp32 are all representable in fp64).
ReferenceWeights to_reference_weights(const ExpertWeights& w);

}  // namespace moe
