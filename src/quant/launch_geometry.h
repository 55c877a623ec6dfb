// Grid size of the quantization kernels, which loop over their work with a grid stride: as many
// CTAs as the work needs, at most one wave of resident CTAs.
#pragma once

#include <cstdint>

namespace moe::quant {

// Grid x for `work` units per matrix, `per_cta` units per CTA per pass, over B matrices (grid y):
// ceil(work / per_cta), capped so that all B matrices together fill at most one wave of `kernel`
// (launched with `threads` threads per CTA) on the current device; at least 1.
unsigned one_wave_grid_x(const void* kernel, int threads, int64_t work, int64_t per_cta, int64_t B = 1);

}  // namespace moe::quant
