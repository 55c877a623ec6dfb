// Host-side rules of the quantization formats shared by the kernels and the CPU reference: block
// sizes, option validation and the shapes of the scale tensors in each layout.
#include "moe/error.h"
#include "moe/quant_format.h"

namespace moe {

namespace {
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }
}  // namespace

int quant_block_size(QuantFormat format) {
  switch (format) {
    case QuantFormat::kFP8Block: return 128;
    case QuantFormat::kMXFP8: return 32;
    case QuantFormat::kNVFP4: return 16;
  }
  detail::throw_error("quant format: unknown enum value ", static_cast<int>(format));
}

const char* quant_format_name(QuantFormat format) {
  switch (format) {
    case QuantFormat::kFP8Block: return "fp8_block";
    case QuantFormat::kMXFP8: return "mxfp8";
    case QuantFormat::kNVFP4: return "nvfp4";
  }
  detail::throw_error("quant format: unknown enum value ", static_cast<int>(format));
}

namespace {

// A scale layout exists for the format and blocking of c.
void check_layout(const QuantConfig& c, ScaleLayout layout, const char* what, const char* field) {
  const char* name = quant_format_name(c.format);
  switch (layout) {
    case ScaleLayout::kRowMajor: break;
    case ScaleLayout::kMNMajor:
      MOE_CHECK(c.format == QuantFormat::kFP8Block && c.blocking == QuantBlocking::k1D, "argument '", what,
                field, "': mn_major is for fp8_block with 1-D blocks, got ", name,
                c.blocking == QuantBlocking::k2D ? " with 2-D blocks" : "");
      break;
    case ScaleLayout::kSwizzled128x4:
      MOE_CHECK(c.format != QuantFormat::kFP8Block && c.blocking == QuantBlocking::k1D, "argument '", what,
                field, "': swizzled_128x4 is for mxfp8 and nvfp4 with 1-D blocks, got ", name,
                c.blocking == QuantBlocking::k2D ? " with 2-D blocks" : "");
      break;
    default:
      detail::throw_error("argument '", what, field, "': unknown enum value ", static_cast<int>(layout));
  }
}

}  // namespace

void validate_quant_config(const QuantConfig& c, const char* what) {
  quant_block_size(c.format);  // a valid enum
  const char* name = quant_format_name(c.format);
  MOE_CHECK(c.blocking == QuantBlocking::k1D || c.blocking == QuantBlocking::k2D, "argument '", what,
            ".blocking': unknown enum value ", static_cast<int>(c.blocking));
  MOE_CHECK(c.rowwise || c.columnwise, "argument '", what, "': expected rowwise and/or columnwise, got neither");
  MOE_CHECK(!(c.blocking == QuantBlocking::k2D && c.format == QuantFormat::kMXFP8), "argument '", what,
            ".blocking': 2-D blocks exist for fp8_block (128x128) and nvfp4 (16x16), not for mxfp8");
  check_layout(c, c.scale_layout, what, ".scale_layout");
  if (c.columnwise_scale_layout) check_layout(c, *c.columnwise_scale_layout, what, ".columnwise_scale_layout");
  MOE_CHECK(!c.pow2_scale || c.format == QuantFormat::kFP8Block, "argument '", what,
            ".pow2_scale': only for fp8_block (mxfp8 scales are powers of two already), got ", name);
  MOE_CHECK(!c.stochastic_rounding || c.format == QuantFormat::kNVFP4, "argument '", what,
            ".stochastic_rounding': only for nvfp4, got ", name);
}

ScaleShape scale_shape(const QuantConfig& c, int64_t rows, int64_t cols, bool columnwise) {
  validate_quant_config(c);
  MOE_CHECK(rows >= 0 && cols >= 0, "scale_shape: negative matrix size [", rows, ", ", cols, "]");
  const int64_t b = quant_block_size(c.format);
  ScaleShape s;
  s.dtype = c.format == QuantFormat::kFP8Block ? DType::kFP32
            : c.format == QuantFormat::kMXFP8  ? DType::kE8M0
                                               : DType::kFP8E4M3;
  const int64_t block_rows = c.blocking == QuantBlocking::k2D ? ceil_div(rows, b) : rows;
  const int64_t block_cols = ceil_div(cols, b);
  switch (copy_scale_layout(c, columnwise)) {
    case ScaleLayout::kRowMajor:
      s.rows = block_rows;
      s.cols = block_cols;
      break;
    case ScaleLayout::kMNMajor:
      s.rows = block_cols;
      s.cols = round_up(block_rows, 4);
      break;
    case ScaleLayout::kSwizzled128x4:
      s.rows = round_up(block_rows, 128);
      s.cols = round_up(block_cols, 4);
      break;
  }
  return s;
}

}  // namespace moe
