// Stand-in experts for the expert-parallel tests: a row-local function of each x_perm row, its
// expert and its prob (and one for the backward), so that any split of the rows into chunks gives
// the same value for every row. A row delivered to the wrong expert, with the wrong prob, or not
// at all changes the result. Rows past group_offsets[E] are neither read nor written, as with
// moe::GroupedExperts.
#pragma once

#include <cuda_runtime_api.h>

#include "moe/expert_parallel.h"

namespace moe::testing {

// chunk.in = x_perm [R_c, H] -> chunk.out = Y: Y[r] = x[r] * (1 + e / 4) + p[r] / 2 (e the local
// expert of row r, p its prob), computed in fp32 and rounded to the row dtype (bf16, fp16, fp32).
void fake_experts_forward(const EpChunk& chunk, cudaStream_t stream);

// chunk.in = dY -> chunk.out = d_x_perm: dx[r] = dY[r] * (2 - e / 8) - p[r]; chunk.d_probs_perm
// (when not empty)[r] = dY[r][0] * 3 / 4 + e.
void fake_experts_backward(const EpChunk& chunk, cudaStream_t stream);

}  // namespace moe::testing
