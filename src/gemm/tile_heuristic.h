// The tile configuration of a grouped product, chosen from static quantities only (the op and the
// shape N, K -- never device data), so eager and captured runs always pick the same kernel.
#pragma once

#include <cstdint>

#include "gemm/grouped_kernel.h"

namespace moe::gemm {

// A kernel configuration name (see kernel_registry.cpp), the persistent scheduler's tile order
// inside each group, and how many consecutive tiles a CTA takes per visit (run_group_scheduler.cuh).
struct TileChoice {
  const char* name;
  bool raster_along_n;
  int tile_run = 1;
};

// accumulate: a weight gradient added into an fp32 main_grad (beta = 1). rows_ok: the call can run
// the rows GEMM (KernelEntry::contiguous_rows: one contiguous weight tensor, rows to compute); when
// false the choice is a CUTLASS configuration.
TileChoice choose_tiles(Op op, int64_t N, int64_t K, bool accumulate = false, bool rows_ok = true);
// The same for FP8 block-scaled operands (op kFprop serves fprop and dgrad, see grouped_kernel.h).
// restated_scales: the engine can restate the weight scales per 64 rows for this product
// (GroupedGemm's max_weight_dim covers N and K), which the 192-wide fprop-form tile needs.
TileChoice choose_fp8_tiles(Op op, int64_t N, int64_t K, bool restated_scales, bool accumulate = false);

}  // namespace moe::gemm
