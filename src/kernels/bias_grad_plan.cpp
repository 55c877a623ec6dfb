#include "kernels/bias_grad_plan.h"

#include <algorithm>

namespace moe::kernels {
namespace {

constexpr int kVec = 8;             // bf16 columns per 16-byte vector
constexpr int kBusyBlocks = 1024;   // ~8 blocks per SM of an H100
constexpr int kLongestChunk = 128;
constexpr int kShortestChunk = 16;

int next_pow2(int64_t v) {
  int p = 1;
  while (p < v) p *= 2;
  return p;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

BiasGradPlan plan_bias_grad(int64_t R, int E, int64_t N) {
  BiasGradPlan g;
  const int64_t vecs = ceil_div(N, kVec);
  if (vecs < 32) {
    g.vx = next_pow2(vecs);
  } else {  // the widest of 256..32 threads that leaves the fewest idle
    int64_t best = -1;
    for (int vx : {kBiasGradThreads, 128, 64, 32}) {
      const int64_t waste = ceil_div(vecs, vx) * vx - vecs;
      if (best < 0 || waste < best) best = waste, g.vx = vx;
    }
  }
  g.slices = ceil_div(vecs, g.vx);
  // Shorter chunks while there are too few blocks to share the rows.
  g.chunk = kLongestChunk;
  while (g.chunk > kShortestChunk && ceil_div(R, g.chunk) * g.slices < kBusyBlocks) g.chunk /= 2;
  g.chunks = ceil_div(R, g.chunk) + E;
  return g;
}

int64_t bias_grad_chunk_bound(int64_t R, int E, int64_t N) {
  // A call with r <= R rows keeps the longest chunk (<= ceil(R / 128) chunks) or halved its chunk c
  // from 2c because ceil(r / 2c) * slices < 1024, so ceil(r / c) <= 2 * ceil(r / 2c) <= 2 * m with
  // m = the most chunks below that threshold; and never more than ceil(R / 16).
  const int64_t slices = plan_bias_grad(R, E, N).slices;
  const int64_t shortest = ceil_div(R, kShortestChunk);
  const int64_t halved = slices > 0 ? std::min(shortest, 2 * ((kBusyBlocks - 1) / slices)) : shortest;
  return std::max(ceil_div(R, kLongestChunk), halved) + E;
}

size_t bias_grad_chunk_table_bytes(int E) { return ((static_cast<size_t>(E) + 1) * sizeof(int32_t) + 15) / 16 * 16; }

}  // namespace moe::kernels
