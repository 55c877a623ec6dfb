// Configuration of the token dispatcher (moe::Dispatcher, include/moe/dispatch.h): the static
// bounds every plan is sized from. Plain data, no CUDA types.
#pragma once

#include <cstdint>

#include "moe/dtype.h"
#include "moe/routing.h"

namespace moe {

struct DispatcherConfig {
  int64_t max_tokens = 0;  // T_max: every plan has T <= T_max
  int num_experts = 0;     // E, 1..1024
  int topk = 0;            // k >= 1 for the top-k form; unused by the map form
  int64_t hidden = 0;      // H, row width in elements; H * dtype bytes must be a multiple of 16
  RoutingForm form = RoutingForm::kTopK;
  DispatchOptions options;  // A, pre-padded input, R (R is required for the map form)
  // bf16, fp16 or fp32 for every op; 1-byte FP8 rows (e4m3/e5m2) move through permute only.
  DType row_dtype = DType::kBF16;
  // > 0: permute carries a per-row block of this many bytes (e.g. FP8 block scales) alongside each
  // row, from x_scale [T, *] to x_perm_scale [R, *]; pad rows get a zero block.
  int64_t scale_bytes_per_row = 0;
};

}  // namespace moe
