// Row tiles of the fused grouped GEMMs over ragged expert groups: a tile is (expert, cluster of
// 128-row blocks, feature block), numbered expert by expert (the arithmetic inside an expert, with
// kSplitOdd's split of an odd last row block: row_tile_numbering.h); empty experts take no tile. The
// per-expert prefix of tile counts is computed on the device from the group offsets at kernel start
// (graph-safe: no host read of group sizes).
#pragma once

#include <algorithm>
#include <cstdint>

#include "device/device_groups.cuh"
#include "fused/row_tile_numbering.h"

namespace moe::fused {

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
  return local_row_tile<kBM, kCluster, kSplitOdd>(lo, begin, end, t - start[lo], feature_tiles, rank);
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
