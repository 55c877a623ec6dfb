// The arithmetic of the fused kernels' row tiles (row_tiles.cuh), one definition for the kernels and
// the CPU tests (tests/cpu/test_row_tiles.cpp): how many tiles an expert's rows make, and which rows
// and feature block tile `local` of an expert is for CTA `rank` of its cluster.
//
// A tile is (cluster of kBM-row blocks, feature block), numbered block-cluster-major: a cluster of
// kCluster CTAs takes kCluster consecutive row blocks and shares the weight tile between them.
// kSplitOdd (clusters of 2 only): an expert with an odd number of row blocks would leave one CTA
// of its last cluster without rows for every feature block. Instead both CTAs take that last row
// block, each with its own feature block (CTA r: 2 j + r), and load their weight tiles alone (no
// multicast): ceil(NT / 2) tiles instead of NT for that block.
#pragma once

#include <cstdint>

#include "fused/host_device.h"

namespace moe::fused {

struct RowTile {
  int e;
  int64_t m0;  // first row
  int rows;    // valid rows, 0..kBM (0: the cluster's last block lies past the expert's rows, or a
               // kSplitOdd feature block lies past the last one)
  int nt;      // feature block
  bool solo;   // kSplitOdd's last row block: the cluster's CTAs have different feature blocks
};

// Tiles of an expert with `blocks` row blocks.
template <int kCluster, bool kSplitOdd>
MOE_FUSED_HD int row_tiles_of(int blocks, int feature_tiles) {
  static_assert(!kSplitOdd || kCluster == 2, "the odd row block is split between the 2 CTAs of a cluster");
  if constexpr (kSplitOdd) return blocks / 2 * feature_tiles + (blocks & 1) * ((feature_tiles + 1) / 2);
  return (blocks + kCluster - 1) / kCluster * feature_tiles;
}

// Tile `local` (0 <= local < row_tiles_of(blocks of [begin, end))) of expert e, whose rows are
// [begin, end), as CTA `rank` of its cluster sees it.
template <int kBM, int kCluster, bool kSplitOdd>
MOE_FUSED_HD RowTile local_row_tile(int e, int64_t begin, int64_t end, int local, int feature_tiles, int rank) {
  RowTile tile;
  tile.e = e;
  tile.solo = false;
  if constexpr (kSplitOdd) {
    const int blocks = static_cast<int>((end - begin + kBM - 1) / kBM);
    const int paired = blocks / 2 * feature_tiles;
    if (local >= paired) {  // the last (odd) row block; with an odd NT, CTA 1's last tile has no rows
      tile.solo = true;
      tile.nt = 2 * (local - paired) + rank;
      tile.m0 = begin + static_cast<int64_t>(blocks - 1) * kBM;
      const int64_t left = end - tile.m0;
      tile.rows = tile.nt >= feature_tiles ? 0 : (left < kBM ? static_cast<int>(left) : kBM);
      return tile;
    }
  }
  tile.nt = local % feature_tiles;
  tile.m0 = begin + (static_cast<int64_t>(local / feature_tiles) * kCluster + rank) * kBM;
  const int64_t left = end - tile.m0;
  tile.rows = left <= 0 ? 0 : (left < kBM ? static_cast<int>(left) : kBM);
  return tile;
}

}  // namespace moe::fused
