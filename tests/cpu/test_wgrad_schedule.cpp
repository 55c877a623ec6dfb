// The gathered weight gradient's choice between the fixed stride and the tile queue
// (src/fused/wgrad_schedule.h): each cluster's stride work is the sum over its tiles, and the
// estimate takes the queue where a simulation of the queue (the free cluster takes the next tile,
// the dearest experts first) finishes clearly sooner, and keeps the stride where it would not.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <queue>
#include <random>
#include <vector>

#include "fused/wgrad_schedule.h"

namespace moe::fused {
namespace {

uint64_t brute_stride_work(const std::vector<int>& kb, int per_expert, int clusters, int c) {
  uint64_t work = 0;
  for (int64_t t = c; t < int64_t(kb.size()) * per_expert; t += clusters) work += kb[t / per_expert] + kTileOverheadBlocks;
  return work;
}

uint64_t stride_makespan(const std::vector<int>& kb, int per_expert, int clusters) {
  uint64_t most = 0;
  for (int c = 0; c < clusters; ++c)
    most = std::max(most, stride_work(kb.data(), int(kb.size()), per_expert, clusters, c));
  return most;
}

bool pays(const std::vector<int>& kb, int per_expert, int clusters) {
  return queue_pays(stride_makespan(kb, per_expert, clusters), kb.data(), int(kb.size()), per_expert, clusters);
}

// The queue as the kernel runs it, in k blocks: tiles in the order of the experts by k blocks (most
// first), each to the cluster that is free first.
uint64_t simulated_queue(const std::vector<int>& kb, int per_expert, int clusters) {
  std::vector<int> order(kb.size());
  for (size_t e = 0; e < kb.size(); ++e) order[e] = int(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return kb[a] > kb[b]; });
  std::priority_queue<uint64_t, std::vector<uint64_t>, std::greater<uint64_t>> free_at;
  for (int c = 0; c < clusters; ++c) free_at.push(0);
  uint64_t end = 0;
  for (int e : order)
    for (int i = 0; i < per_expert; ++i) {
      const uint64_t done = free_at.top() + kb[e] + kTileOverheadBlocks;
      free_at.pop();
      free_at.push(done);
      end = std::max(end, done);
    }
  return end;
}

// Rows per expert about mean * E / (H_E (i + 1)) for skew 1 (Zipf), shuffled; skew 0: all mean.
std::vector<int> k_blocks(int E, int mean_blocks, double skew, uint64_t seed) {
  double norm = 0;
  for (int i = 1; i <= E; ++i) norm += std::pow(double(i), -skew);
  std::vector<int> kb(E);
  for (int i = 0; i < E; ++i) kb[i] = int(std::lround(mean_blocks * E * std::pow(double(i + 1), -skew) / norm));
  std::shuffle(kb.begin(), kb.end(), std::mt19937_64(seed));
  return kb;
}

TEST(WgradSchedule, StrideWorkIsTheSumOverTheClustersTiles) {
  std::mt19937_64 rng(5);
  for (int trial = 0; trial < 300; ++trial) {
    const int E = 1 + int(rng() % 40), per_expert = 1 + int(rng() % 150), clusters = 1 + int(rng() % 80);
    std::vector<int> kb(E);
    for (int& b : kb) b = int(rng() % 100);
    for (int c = 0; c < clusters; ++c)
      ASSERT_EQ(stride_work(kb.data(), E, per_expert, clusters, c), brute_stride_work(kb, per_expert, clusters, c))
          << "E " << E << " per_expert " << per_expert << " clusters " << clusters << " c " << c;
  }
}

TEST(WgradSchedule, BalancedRoutingKeepsTheStride) {
  // Equal experts: whatever the tile count, the queue cannot end sooner (11.6 tiles a cluster
  // leave 0.4 idle under either).
  for (int per_expert : {6, 12, 24, 48, 64, 448})
    for (int E : {8, 16, 32, 128}) EXPECT_FALSE(pays(std::vector<int>(E, 64), per_expert, 66)) << E << " x " << per_expert;
  EXPECT_FALSE(pays({0, 0, 0}, 4, 66)) << "every expert empty";
  EXPECT_FALSE(pays({900}, 1, 66)) << "a single tile: nothing to balance";
}

TEST(WgradSchedule, SkewedRoutingTakesTheQueue) {
  EXPECT_TRUE(pays(k_blocks(128, 8, 1.0, 1), 12, 66)) << "Zipf over 128 experts";
  EXPECT_TRUE(pays(k_blocks(32, 32, 1.0, 2), 24, 66)) << "Zipf over 32 experts";
  std::vector<int> one_busy(16, 64);
  one_busy[3] = 512;
  EXPECT_TRUE(pays(one_busy, 48, 66)) << "one expert with 8x the rows";
}

// The estimate against the simulated queue: it never takes the queue where the simulation does not
// finish sooner, and it takes it wherever the simulation gains more than 5%.
TEST(WgradSchedule, AgreesWithASimulatedQueue) {
  std::mt19937_64 rng(9);
  int taken = 0, kept = 0;
  for (int trial = 0; trial < 400; ++trial) {
    const int E = 2 + int(rng() % 200), per_expert = 1 + int(rng() % 64), clusters = 8 + int(rng() % 70);
    const double skew = double(rng() % 150) / 100.0;
    const std::vector<int> kb = k_blocks(E, 1 + int(rng() % 64), skew, rng());
    const double stride = double(stride_makespan(kb, per_expert, clusters));
    const double queue = double(simulated_queue(kb, per_expert, clusters));
    const bool chosen = pays(kb, per_expert, clusters);
    (chosen ? taken : kept) += 1;
    if (chosen) EXPECT_LT(queue, stride) << "E " << E << " per_expert " << per_expert << " clusters " << clusters << " skew " << skew;
    if (stride > 1.05 * queue)
      EXPECT_TRUE(chosen) << "E " << E << " per_expert " << per_expert << " clusters " << clusters << " skew " << skew
                          << ": stride " << stride << ", queue " << queue;
  }
  EXPECT_GT(taken, 40);  // both outcomes occur among the trials
  EXPECT_GT(kept, 40);
}

}  // namespace
}  // namespace moe::fused
