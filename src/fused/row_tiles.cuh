// Row tiles of the fused grouped GEMMs over ragged expert groups: a tile is (expert, cluster of
// 128-row blocks, feature block), numbered expert by expert (a cluster of kCluster CTAs takes
// kCluster consecutive row blocks of one expert and shares the weight tile between them); empty
// experts take no tile. The per-expert prefix of tile counts is computed on the device from the
// group offsets at kernel start (graph-safe: no host read of group sizes).
//
// kSplitOdd (clusters of 2 only): an expert with an odd number of row blocks would leave one CTA
// of its last cluster without rows for every feature block. Instead both CTAs take that last row
// block, each with its own feature block (CTA r: 2 j + r), and load their weight tiles alone (no
// multicast): ceil(NT / 2) tiles instead of NT for that block.
#pragma once

#include <algorithm>
#include <cstdint>

#include "device/device_groups.cuh"

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
__device__ __forceinline__ int row_tiles_of(int blocks, int feature_tiles) {
  static_assert(!kSplitOdd || kCluster == 2, "the odd row block is split between the 2 CTAs of a cluster");
  if constexpr (kSplitOdd) return blocks / 2 * feature_tiles + (blocks & 1) * ((feature_tiles + 1) / 2);
  return (blocks + kCluster - 1) / kCluster * feature_tiles;
}

// start[e] = first tile of expert e, start[E] = tiles in all; one warp computes it, 32 experts at a
// time (a warp-wide inclusive scan per batch).
template <int kBM, int kCluster, bool kSplitOdd = false>
__device__ void prefix_row_tiles(int32_t* start, const int32_t* offsets, int E, int64_t R, int feature_tiles,
                                 int lane) {
  constexpr uint32_t kFull = 0xffffffffu;
  int carry = 0;
  for (int base = 0; base < E; base += 32) {
    const int e = base + lane;
    int n = 0;
    if (e < E) {
      int64_t begin, end;
      kernels::group_rows(offsets, e, R, &begin, &end);
      const int blocks = static_cast<int>((end - begin + kBM - 1) / kBM);
      n = row_tiles_of<kCluster, kSplitOdd>(blocks, feature_tiles);
    }
    int incl = n;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int up = __shfl_up_sync(kFull, incl, d);
      if (lane >= d) incl += up;
    }
    if (e < E) start[e] = carry + incl - n;
    carry += __shfl_sync(kFull, incl, 31);
  }
  if (lane == 0) start[E] = carry;
}

// Tile t as CTA `rank` of its cluster sees it: row block kCluster * (cluster block) + rank.
template <int kBM, int kCluster, bool kSplitOdd = false>
__device__ __forceinline__ RowTile decode_row_tile(int t, const int32_t* start, const int32_t* offsets, int E,
                                                   int64_t R, int feature_tiles, int rank) {
  // The last expert whose first tile is <= t (empty experts share their successor's start).
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (start[mid] <= t) lo = mid;
    else hi = mid - 1;
  }
  int64_t begin, end;
  kernels::group_rows(offsets, lo, R, &begin, &end);
  const int local = t - start[lo];
  RowTile tile;
  tile.e = lo;
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

// Grid of a persistent row-tile kernel, a whole number of clusters: at most one cluster tile per
// kCluster * kBM rows plus one partial tile per expert, per feature block, and no more clusters than
// the SMs hold (at least one).
template <int kBM>
inline int row_tile_grid(int64_t R, int experts, int feature_tiles, int cluster, int sm_count) {
  const int64_t max_tiles = ((R + cluster * kBM - 1) / (cluster * kBM) + experts) * int64_t(feature_tiles);
  const int64_t clusters = std::max<int64_t>(1, std::min<int64_t>(max_tiles, sm_count / cluster));
  return static_cast<int>(clusters * cluster);
}

}  // namespace moe::fused
