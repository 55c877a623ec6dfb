// Quantization formats (host-only description): the format enum, the options of a quantization,
// and the shapes of its scale tensors. The kernels are declared in moe/quantize.h; the rules
// (scale formulas, rounding, edge values, layouts) are in docs/quantization.md.
#pragma once

#include <cstdint>
#include <optional>

#include "moe/dtype.h"

namespace moe {

enum class QuantFormat : uint8_t {
  kFP8Block,  // E4M3 data, fp32 scale_inv per block of 128 (1x128 / 128x1, or 128x128)
  kMXFP8,     // E4M3 data, E8M0 shared exponent per block of 32 (1x32 / 32x1)
  kNVFP4,     // E2M1 data packed two per byte (low nibble first), E4M3 scale per block of 16
              // (1x16 / 16x1, or 16x16), fp32 global amax per matrix
};

enum class QuantBlocking : uint8_t {
  k1D,  // activations and gradients: 1 x b rowwise, b x 1 columnwise
  k2D,  // weights: b x b tiles shared by both copies (FP8 block 128x128, NVFP4 16x16; not MXFP8)
};

enum class ScaleLayout : uint8_t {
  kRowMajor,        // [rows of blocks, blocks per row], row-major: scale of block (r, j) at r * cols + j
  kMNMajor,         // FP8 block 1-D only: [blocks per row, R4] with R4 = rows rounded up to 4, the
                    // scale of (r, j) at j * R4 + r (the transposed, TMA-aligned layout that
                    // DeepGEMM and CUTLASS's sm90 blockwise-scaled GEMM read); pad entries are 0
  kSwizzled128x4,   // MXFP8 / NVFP4 1-D only: the 128x4-tile layout of Blackwell block-scaled
                    // GEMMs (cuBLAS, TransformerEngine), see docs/quantization.md; pad bytes are 0
};

struct QuantConfig {
  QuantFormat format = QuantFormat::kFP8Block;
  QuantBlocking blocking = QuantBlocking::k1D;
  bool rowwise = true;      // produce the rowwise copy
  bool columnwise = false;  // produce the columnwise copy
  ScaleLayout scale_layout = ScaleLayout::kRowMajor;
  // The columnwise copy's layout where it differs from scale_layout. FP8 training writes both copies
  // in one pass with the layouts its GEMMs read: row-major scales for the rowwise copy (fprop,
  // dgrad), mn_major for the columnwise copy (the weight gradient).
  std::optional<ScaleLayout> columnwise_scale_layout;
  bool pow2_scale = false;  // FP8 block: round each scale down to a power of two
  // NVFP4 only: stochastic rounding of the data (gradients). The random bits of an element are a
  // pure function of (seed, offset, copy, position): Philox4x32-10, see docs/quantization.md.
  bool stochastic_rounding = false;
  uint64_t seed = 0;
  uint64_t offset = 0;
};

// The scale layout of the rowwise (columnwise = false) or the columnwise copy.
inline ScaleLayout copy_scale_layout(const QuantConfig& config, bool columnwise) {
  return columnwise && config.columnwise_scale_layout ? *config.columnwise_scale_layout : config.scale_layout;
}

// Block length along the blocked dimension: 128, 32 or 16.
int quant_block_size(QuantFormat format);
// Short name: "fp8_block", "mxfp8", "nvfp4".
const char* quant_format_name(QuantFormat format);

// Throws moe::Error naming the option (`what`) when the combination is unsupported.
void validate_quant_config(const QuantConfig& config, const char* what = "config");

// Shape of the scale tensor of ONE matrix copy stored as [rows, cols] (the rowwise copy of x
// [M, K] is (M, K), the columnwise copy (K, M)), in that copy's layout (copy_scale_layout). 1-D
// blocks run along cols. Batched tensors prepend B.
struct ScaleShape {
  int64_t rows = 0, cols = 0;
  DType dtype = DType::kFP32;  // fp32 (FP8 block), e8m0 (MXFP8), fp8_e4m3 (NVFP4)
};
ScaleShape scale_shape(const QuantConfig& config, int64_t rows, int64_t cols, bool columnwise = false);

}  // namespace moe
