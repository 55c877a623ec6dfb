// Host-side argument checks and launch geometry of the quantize / dequantize kernels (a moe::Error
// naming the argument before anything is launched).
#pragma once

#include <cstdint>

#include "moe/quantize.h"

namespace moe::quant {

// One copy (rowwise or columnwise) of every matrix: storage [rows, cols] per matrix.
struct CopyArgs {
  bool enabled = false;
  void* data = nullptr;
  void* scale = nullptr;
  int64_t rows = 0, cols = 0;
  int64_t block_rows = 0, block_cols = 0;  // blocks of one matrix (2-D: row blocks)
  int64_t scale_entries = 0;               // per matrix, layout padding included
  bool scale_padded = false;               // the layout has pad entries (zeroed before the kernel)
  ScaleLayout layout = ScaleLayout::kRowMajor;
};

struct QuantArgs {
  int64_t B = 1, M = 0, K = 0;
  const void* x = nullptr;
  bool x_fp32 = false;  // fp32 x: FP8 block 128x128 only
  float* global_amax = nullptr;  // NVFP4
  CopyArgs row, col;
};

// Checks x and the views of `out` that the config asks for (see moe/quantize.h for the rules).
QuantArgs check_quantize_args(const QuantConfig& config, const TensorView& x, const QuantizedTensor& out);

struct DequantArgs {
  int64_t B = 1;
  CopyArgs copy;
  const float* global_amax = nullptr;
  void* out = nullptr;
  bool out_fp32 = false;
};

DequantArgs check_dequantize_args(const QuantConfig& config, const QuantizedTensor& q, bool columnwise,
                                  const TensorView& out);

}  // namespace moe::quant
