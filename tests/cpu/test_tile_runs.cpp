// The tile-run schedule of the grouped GEMMs (src/gemm/tile_runs.h): the arithmetic the GPU
// scheduler (run_group_scheduler.cuh) uses to hand clusters their tiles, checked exhaustively on
// small sizes and at the H100's 66 clusters of two.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "gemm/tile_runs.h"

namespace moe::gemm {
namespace {

// Every cluster's units, in step order.
std::vector<std::vector<uint32_t>> walk(uint32_t units, uint32_t clusters, uint32_t run) {
  const TileRuns t = TileRuns::make(units, clusters, run);
  std::vector<std::vector<uint32_t>> taken(clusters);
  for (uint32_t c = 0; c < clusters; ++c) {
    uint32_t u = 0;
    for (uint32_t step = 0; t.unit(c, step, &u); ++step) {
      taken[c].push_back(u);
      if (taken[c].size() > units) break;  // a runaway walk fails below instead of looping
    }
  }
  return taken;
}

TEST(TileRuns, EveryUnitOnceInIncreasingOrderAndBalanced) {
  for (uint32_t clusters : {1u, 2u, 3u, 5u, 66u})
    for (uint32_t run : {1u, 2u, 3u, 4u, 7u, 1024u})
      for (uint32_t units : {0u, 1u, 2u, 3u, 4u, 5u, 7u, 64u, 65u, 66u, 67u, 263u, 264u, 265u, 1000u, 9588u}) {
        SCOPED_TRACE("units " + std::to_string(units) + " clusters " + std::to_string(clusters) + " run " +
                     std::to_string(run));
        const auto taken = walk(units, clusters, run);
        std::vector<int> seen(units, 0);
        size_t least = SIZE_MAX, most = 0;
        for (const auto& mine : taken) {
          least = std::min(least, mine.size());
          most = std::max(most, mine.size());
          // The group walk of the GPU scheduler only moves forward.
          EXPECT_TRUE(std::is_sorted(mine.begin(), mine.end()));
          for (uint32_t u : mine) {
            ASSERT_LT(u, units);
            ++seen[u];
          }
        }
        for (uint32_t u = 0; u < units; ++u) ASSERT_EQ(seen[u], 1) << "unit " << u;
        EXPECT_LE(most - least, 1u) << "shares differ by more than one unit";
      }
}

TEST(TileRuns, RunOneIsRoundRobinAndRunsAreConsecutive) {
  const uint32_t clusters = 66, units = 9588;  // sonic-7b-fine fc2: 19176 tiles in clusters of two
  const auto rr = walk(units, clusters, 1);
  for (uint32_t c = 0; c < clusters; ++c)
    for (size_t s = 0; s < rr[c].size(); ++s) ASSERT_EQ(rr[c][s], s * clusters + c);
  // Run 4: 36 full rounds (36 x 66 x 4 = 9504 units), then 84 units: 18 clusters take two, 48 one.
  const TileRuns t = TileRuns::make(units, clusters, 4);
  EXPECT_EQ(t.rounds, 36u);
  EXPECT_EQ(t.tail, 84u);
  const auto runs = walk(units, clusters, 4);
  for (uint32_t c = 0; c < clusters; ++c) {
    for (size_t s = 0; s < 144; ++s)
      ASSERT_EQ(runs[c][s], (s / 4 * clusters + c) * 4 + s % 4) << "cluster " << c << " step " << s;
    EXPECT_EQ(runs[c].size(), 144u + (c < 18 ? 2u : 1u));
  }
}

}  // namespace
}  // namespace moe::gemm
