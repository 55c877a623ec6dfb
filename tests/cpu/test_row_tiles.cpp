// The row-tile numbering of the fused fc1 and fc2 dgrad kernels (src/fused/row_tile_numbering.h):
// within an expert, every (row block, feature block) is computed exactly once, by tiles whose rows
// lie in the expert's group, both CTAs of a cluster agree on how a tile loads its weights (solo or
// multicast), and splitting an odd last row block leaves a CTA without rows at most once per
// expert (only when the feature blocks are odd in number) instead of once per feature block.
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <utility>

#include "fused/row_tile_numbering.h"

namespace moe::fused {
namespace {

struct Walk {
  int tiles = 0;
  int idle = 0;  // CTA tiles without rows
};

// Walks every tile of an expert with rows [begin, end) for every CTA of the cluster, checks each,
// and counts the (row block, feature block) pairs covered.
template <int kBM, int kCluster, bool kSplitOdd>
Walk walk_expert(int64_t begin, int64_t end, int feature_tiles, const std::string& what) {
  const int blocks = static_cast<int>((end - begin + kBM - 1) / kBM);
  Walk w;
  w.tiles = row_tiles_of<kCluster, kSplitOdd>(blocks, feature_tiles);
  std::map<std::pair<int64_t, int>, int> covered;
  for (int local = 0; local < w.tiles; ++local) {
    const RowTile first = local_row_tile<kBM, kCluster, kSplitOdd>(3, begin, end, local, feature_tiles, 0);
    for (int rank = 0; rank < kCluster; ++rank) {
      const RowTile t = local_row_tile<kBM, kCluster, kSplitOdd>(3, begin, end, local, feature_tiles, rank);
      const std::string at = what + " local " + std::to_string(local) + " rank " + std::to_string(rank);
      EXPECT_EQ(t.e, 3) << at;
      EXPECT_EQ(t.solo, first.solo) << at << ": the cluster's CTAs disagree on the weight load";
      if (!kSplitOdd) EXPECT_FALSE(t.solo) << at;
      EXPECT_GE(t.rows, 0) << at;
      EXPECT_LE(t.rows, kBM) << at;
      if (t.rows == 0) {
        ++w.idle;
        continue;
      }
      EXPECT_GE(t.nt, 0) << at;
      EXPECT_LT(t.nt, feature_tiles) << at;
      EXPECT_GE(t.m0, begin) << at;
      EXPECT_EQ((t.m0 - begin) % kBM, 0) << at;
      EXPECT_EQ(t.rows, std::min<int64_t>(kBM, end - t.m0)) << at << ": every row of the block";
      ++covered[{t.m0, t.nt}];
    }
  }
  for (int b = 0; b < blocks; ++b)
    for (int f = 0; f < feature_tiles; ++f) {
      const auto it = covered.find({begin + int64_t(b) * kBM, f});
      EXPECT_TRUE(it != covered.end() && it->second == 1)
          << what << ": row block " << b << ", feature block " << f << " computed "
          << (it == covered.end() ? 0 : it->second) << " times";
    }
  EXPECT_EQ(covered.size(), size_t(blocks) * feature_tiles) << what;
  return w;
}

template <int kBM, int kCluster, bool kSplitOdd>
void check_random_experts(uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> rows_d(0, 9 * kBM + 7), ft_d(1, 7);
  for (int i = 0; i < 3000; ++i) {
    const int64_t begin = rng() % 1000, rows = rows_d(rng);
    const int ft = ft_d(rng);
    const std::string what = "kBM " + std::to_string(kBM) + " cluster " + std::to_string(kCluster) + " split " +
                             std::to_string(kSplitOdd) + " rows " + std::to_string(rows) + " NT " + std::to_string(ft);
    const Walk w = walk_expert<kBM, kCluster, kSplitOdd>(begin, begin + rows, ft, what);
    const int blocks = static_cast<int>((rows + kBM - 1) / kBM);
    if (rows == 0) EXPECT_EQ(w.tiles, 0) << what << ": an empty expert takes no tile";
    if (kSplitOdd) {
      EXPECT_EQ(w.idle, (blocks & 1) * (ft & 1)) << what;
      EXPECT_EQ(w.tiles, blocks / 2 * ft + (blocks & 1) * ((ft + 1) / 2)) << what;
    } else if (kCluster == 2) {
      EXPECT_EQ(w.idle, (blocks & 1) * ft) << what;
    } else {
      EXPECT_EQ(w.idle, 0) << what;
    }
  }
}

TEST(RowTiles, EveryBlockAndFeatureOnceWithoutSplit) {
  check_random_experts<128, 1, false>(1);
  check_random_experts<128, 2, false>(2);
  check_random_experts<64, 2, false>(3);
}

TEST(RowTiles, OddLastBlockSplitByFeatureBlock) {
  check_random_experts<128, 2, true>(4);
  check_random_experts<64, 2, true>(5);
}

TEST(RowTiles, SplitNeverTakesMoreTiles) {
  for (int blocks = 0; blocks <= 40; ++blocks)
    for (int ft = 1; ft <= 16; ++ft)
      EXPECT_LE((row_tiles_of<2, true>(blocks, ft)), (row_tiles_of<2, false>(blocks, ft)))
          << blocks << " blocks, NT " << ft;
}

}  // namespace
}  // namespace moe::fused
