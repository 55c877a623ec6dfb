// The arithmetic of the tile-run schedule (run_group_scheduler.cuh), one definition for the
// scheduler and the CPU tests (tests/cpu/test_tile_runs.cpp).
//
// `units` cluster tiles are shared by `clusters` clusters in runs of `run`: round r gives cluster c
// the units [(r * clusters + c) * run, + run); the units left after the last full round go in
// contiguous shares, the first `tail % clusters` clusters one more than the others. So every unit
// is taken once, a cluster's units increase with its steps, the clusters' counts differ by at most
// one, and run = 1 is the round-robin order (unit s * clusters + c at step s).
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_GEMM_HD __host__ __device__ __forceinline__
#else
#define MOE_GEMM_HD inline
#endif

namespace moe::gemm {

struct TileRuns {
  uint32_t run = 1;
  uint32_t clusters = 1;
  uint32_t rounds = 0;  // full rounds of clusters * run units
  uint32_t tail = 0;    // units after them

  // run >= 1, clusters >= 1; clusters * run and units below 2^32.
  MOE_GEMM_HD static TileRuns make(uint32_t units, uint32_t clusters, uint32_t run) {
    TileRuns t;
    t.run = run;
    t.clusters = clusters;
    t.rounds = units / (clusters * run);
    t.tail = units - t.rounds * clusters * run;
    return t;
  }

  // The unit cluster c (< clusters) takes at its step-th visit, or false once its share is done.
  MOE_GEMM_HD bool unit(uint32_t c, uint32_t step, uint32_t* u) const {
    const uint32_t full_steps = rounds * run;
    if (step < full_steps) {
      const uint32_t round = step / run;
      *u = (round * clusters + c) * run + (step - round * run);
      return true;
    }
    const uint32_t k = step - full_steps, share = tail / clusters, extra = tail % clusters;
    if (k >= share + (c < extra ? 1u : 0u)) return false;
    *u = rounds * clusters * run + c * share + (c < extra ? c : extra) + k;
    return true;
  }
};

}  // namespace moe::gemm
