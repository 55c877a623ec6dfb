// The launch plan of bias_grad (src/kernels/bias_grad.cu) and the workspace bound it needs,
// host-only so the CPU tests can walk it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe::kernels {

constexpr int kBiasGradThreads = 256;  // threads of a bias_grad block
constexpr int64_t kBiasGradMaxRows = int64_t(1) << 33;  // rows bias_grad accepts (R < 2^33)

struct BiasGradPlan {
  int vx = 1;          // threads across the columns (8 columns each); kBiasGradThreads / vx row lanes
  int64_t slices = 0;  // column slices of vx * 8 columns (grid.y)
  int chunk = 128;     // rows per chunk
  int64_t chunks = 0;  // partial-sum rows this call uses: ceil(R / chunk) + E
};

// The plan of a call with R rows, E experts and N columns: chunk size and block shape depend only
// on (R, N), so a given layer always sums in the same order.
BiasGradPlan plan_bias_grad(int64_t R, int E, int64_t N);

// Partial-sum rows enough for every call with at most R rows. The plan is not monotonic in R (fewer
// rows take shorter chunks, to keep the GPU busy, and may need more of them), so a workspace sized
// for R would not do for a smaller call without this bound.
int64_t bias_grad_chunk_bound(int64_t R, int E, int64_t N);

// Bytes of the per-expert chunk table that precedes the partial sums (16-byte aligned).
size_t bias_grad_chunk_table_bytes(int E);

}  // namespace moe::kernels
