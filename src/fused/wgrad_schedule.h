// The gathered weight gradient's choice of schedule (wgrad_gathered.cu), one definition for the
// kernel's prologue and the CPU tests (tests/cpu/test_wgrad_schedule.cpp).
//
// C persistent clusters walk E * per_expert output tiles; tile t belongs to expert t / per_expert
// and costs that expert's k blocks (its reduction over the rows) plus kTileOverheadBlocks (its
// epilogue). The fixed stride gives cluster c the tiles c, c + C, ...; the queue hands the next
// tile, the experts with the most k blocks first, to whichever cluster is free. The model: the
// stride takes as long as its busiest cluster's work; the queue as the mean work plus half the
// cheapest tile (the clusters finish within about one short tile of each other), and never less
// than the dearest tile or ceil(tiles / C) cheapest ones. On an H100 with both schedules forced
// (bench_fused) the model's stride / queue ratio matched the measured one to within about one
// percent on the named shapes, balanced and skewed; where it is 1 the queue's hand-offs cost 0-3%,
// hence the margin.
#pragma once

#include <cstdint>

#include "fused/host_device.h"

namespace moe::fused {

constexpr int kTileOverheadBlocks = 2;
// The queue where the stride is expected to take more than this percentage of its time.
constexpr int kQueueAbovePercent = 102;

// Cluster c's work under the stride, in k blocks. Expert e's tiles are the per_expert indices from
// e * per_expert on: c holds per_expert / C of them, plus one where c is among the first
// per_expert % C residues from (e * per_expert) mod C on. O(E), no division in the loop.
MOE_FUSED_HD uint64_t stride_work(const int* k_blocks, int experts, int per_expert, int clusters, int c) {
  const int q = per_expert / clusters, m = per_expert % clusters;
  uint64_t work = 0;
  int first = 0;  // (e * per_expert) mod clusters
  for (int e = 0; e < experts; ++e) {
    const int d = c >= first ? c - first : c - first + clusters;
    work += static_cast<uint64_t>(q + (d < m)) * static_cast<uint64_t>(k_blocks[e] + kTileOverheadBlocks);
    first += m;
    if (first >= clusters) first -= clusters;
  }
  return work;
}

// Whether the queue is expected to beat the stride by the margin, given the stride's busiest
// cluster's work (the largest stride_work).
MOE_FUSED_HD bool queue_pays(uint64_t stride_makespan, const int* k_blocks, int experts, int per_expert,
                             int clusters) {
  if (experts < 1) return false;
  double total = 0;
  int cheapest = k_blocks[0], dearest = k_blocks[0];
  for (int e = 0; e < experts; ++e) {
    total += double(per_expert) * (k_blocks[e] + kTileOverheadBlocks);
    cheapest = k_blocks[e] < cheapest ? k_blocks[e] : cheapest;
    dearest = k_blocks[e] > dearest ? k_blocks[e] : dearest;
  }
  // Bounds no schedule beats: the dearest tile; and some cluster's ceil(tiles / C) tiles, each at
  // least the cheapest (with few tiles a cluster, the mean work is not reachable).
  const int64_t tiles = int64_t(experts) * per_expert;
  const double rounds = double((tiles + clusters - 1) / clusters);
  double queue = total / clusters + 0.5 * (cheapest + kTileOverheadBlocks);
  queue = queue > dearest + kTileOverheadBlocks ? queue : dearest + kTileOverheadBlocks;
  queue = queue > rounds * (cheapest + kTileOverheadBlocks) ? queue : rounds * (cheapest + kTileOverheadBlocks);
  return 100.0 * double(stride_makespan) > kQueueAbovePercent * queue;
}

}  // namespace moe::fused
