// Grid size of kernels that loop over their work with a grid stride (the quantization kernels, the
// router's top-k rows kernel). Two policies, chosen per kernel by measurement:
// - one wave of resident CTAs, each looping over many units (reductions, and kernels with a long
//   per-CTA setup);
// - one pass: a CTA per `per_cta` units, so that the CTAs in flight at any moment touch one compact
//   window of memory. Streams that write more than they read (dequantize writes 2-4 bytes per byte
//   read) keep more of the DRAM bandwidth this way: a one-wave grid-stride copy of that shape
//   reaches 70% of the device copy bandwidth, the same copy with one pass 89%.
#pragma once

#include <cstdint>

namespace moe {

// Grid x for `work` units per matrix, `per_cta` units per CTA per pass, over B matrices (grid y):
// ceil(work / per_cta), capped so that all B matrices together fill at most one wave of `kernel`
// (launched with `threads` threads per CTA) on the current device; at least 1.
unsigned one_wave_grid_x(const void* kernel, int threads, int64_t work, int64_t per_cta, int64_t B = 1);

// Grid x for one pass over `work` units per matrix: ceil(work / per_cta), at least 1, capped at the
// largest grid x (the kernels' grid stride covers the rest).
unsigned one_pass_grid_x(int64_t work, int64_t per_cta);

}  // namespace moe
