#include "quant/quant_args.h"

#include <string>

#include "moe/error.h"

namespace moe::quant {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

DType data_dtype(QuantFormat f) { return f == QuantFormat::kNVFP4 ? DType::kFP4E2M1 : DType::kFP8E4M3; }

// A [B?, rows, cols] view: 3-D when batched, 2-D otherwise.
void check_batched(const TensorView& t, const char* name, DType dtype, bool batched, int64_t B, int64_t rows,
                   int64_t cols, int alignment) {
  if (batched)
    check_device_tensor(t, name, dtype, {B, rows, cols}, alignment);
  else
    check_device_tensor(t, name, dtype, {rows, cols}, alignment);
}

CopyArgs make_copy(const QuantConfig& c, const TensorView& data, const TensorView& scale, const char* data_name,
                   const char* scale_name, bool columnwise, bool batched, int64_t B, int64_t rows, int64_t cols) {
  CopyArgs a;
  a.enabled = true;
  a.rows = rows;
  a.cols = cols;
  const int64_t b = quant_block_size(c.format);
  a.block_rows = c.blocking == QuantBlocking::k2D ? ceil_div(rows, b) : rows;
  a.block_cols = ceil_div(cols, b);
  const ScaleShape s = scale_shape(c, rows, cols, columnwise);
  a.layout = copy_scale_layout(c, columnwise);
  a.scale_entries = s.rows * s.cols;
  a.scale_padded = a.scale_entries != a.block_rows * a.block_cols;
  // 16-byte data rows are written with 8-byte (FP8) or 4-byte (FP4) vectors.
  check_batched(data, data_name, data_dtype(c.format), batched, B, rows, cols, c.format == QuantFormat::kNVFP4 ? 4 : 8);
  check_batched(scale, scale_name, s.dtype, batched, B, s.rows, s.cols, s.dtype == DType::kFP32 ? 4 : 1);
  a.data = data.data;
  a.scale = scale.data;
  return a;
}

void check_global_amax(const TensorView& t, const char* name, int64_t B) {
  check_device_tensor(t, name, DType::kFP32, {B}, 4);
}

}  // namespace

QuantArgs check_quantize_args(const QuantConfig& c, const TensorView& x, const QuantizedTensor& out) {
  validate_quant_config(c);
  check_device(x, "x", Device::kCUDA);
  MOE_CHECK(x.dtype == DType::kBF16 || x.dtype == DType::kFP32, "argument 'x': expected dtype bf16 or fp32, got ",
            dtype_name(x.dtype));
  MOE_CHECK(x.dtype == DType::kBF16 || !c.stochastic_rounding, "argument 'x': fp32 input (master weights) is ",
            "quantized with round to nearest; stochastic rounding takes bf16");
  MOE_CHECK(x.ndim == 2 || x.ndim == 3, "argument 'x': expected a matrix [M, K] or a batch [B, M, K], got shape ",
            x.shape_string());
  check_contiguous(x, "x");
  check_pointer(x, "x", 16);
  QuantArgs a;
  const bool batched = x.ndim == 3;
  a.B = batched ? x.shape[0] : 1;
  a.M = x.shape[x.ndim - 2];
  a.K = x.shape[x.ndim - 1];
  a.x = x.data;
  a.x_fp32 = x.dtype == DType::kFP32;
  // Rows are read as 16-byte vectors of 8 bf16.
  MOE_CHECK(a.K % 8 == 0, "argument 'x': expected K (last dimension) a multiple of 8, got ", a.K);
  MOE_CHECK(a.M < (int64_t(1) << 31) && a.K < (int64_t(1) << 31), "argument 'x': expected M, K < 2^31, got ",
            x.shape_string());
  MOE_CHECK(a.B <= 65535, "argument 'x': expected at most 65535 matrices in a batch, got ", a.B);
  MOE_CHECK(ceil_div(a.M, 128) <= 65535, "argument 'x': expected M <= 65535 * 128, got ", a.M);
  if (c.format == QuantFormat::kMXFP8) {
    MOE_CHECK(a.K % 32 == 0, "argument 'x': mxfp8 needs K (last dimension) a multiple of 32 (whole 1x32 blocks), got ",
              a.K);
    MOE_CHECK(!c.columnwise || a.M % 32 == 0,
              "argument 'x': mxfp8 columnwise needs M (rows) a multiple of 32 (whole 32x1 blocks), got ", a.M);
  }
  if (c.format == QuantFormat::kNVFP4) {
    MOE_CHECK(a.K % 16 == 0, "argument 'x': nvfp4 needs K (last dimension) a multiple of 16 (whole 1x16 blocks), got ",
              a.K);
    MOE_CHECK((!c.columnwise && c.blocking == QuantBlocking::k1D) || a.M % 16 == 0, "argument 'x': nvfp4 ",
              c.blocking == QuantBlocking::k2D ? "with 16x16 blocks" : "columnwise",
              " needs M (rows) a multiple of 16, got ", a.M);
  }
  if (c.rowwise)
    a.row = make_copy(c, out.rowwise_data, out.rowwise_scale, "out.rowwise_data", "out.rowwise_scale", false, batched, a.B,
                      a.M, a.K);
  if (c.columnwise)
    a.col = make_copy(c, out.columnwise_data, out.columnwise_scale, "out.columnwise_data", "out.columnwise_scale",
                      true, batched, a.B, a.K, a.M);
  if (c.format == QuantFormat::kNVFP4) {
    check_global_amax(out.global_amax, "out.global_amax", a.B);
    a.global_amax = out.global_amax.ptr<float>();
  }
  return a;
}

DequantArgs check_dequantize_args(const QuantConfig& c, const QuantizedTensor& q, bool columnwise,
                                  const TensorView& out) {
  validate_quant_config(c);
  MOE_CHECK(columnwise ? c.columnwise : c.rowwise, "argument 'columnwise': the config has no ",
            columnwise ? "columnwise" : "rowwise", " copy");
  const TensorView& data = columnwise ? q.columnwise_data : q.rowwise_data;
  const char* data_name = columnwise ? "q.columnwise_data" : "q.rowwise_data";
  MOE_CHECK(data.ndim == 2 || data.ndim == 3, "argument '", data_name,
            "': expected [rows, cols] or [B, rows, cols], got shape ", data.shape_string());
  DequantArgs a;
  const bool batched = data.ndim == 3;
  a.B = batched ? data.shape[0] : 1;
  const int64_t rows = data.shape[data.ndim - 2], cols = data.shape[data.ndim - 1];
  const int64_t b = quant_block_size(c.format);
  MOE_CHECK(c.format == QuantFormat::kFP8Block || cols % b == 0, "argument '", data_name, "': ",
            quant_format_name(c.format), " needs whole blocks along the last dimension (a multiple of ", b, "), got ",
            cols);
  MOE_CHECK(rows < (int64_t(1) << 31) && cols < (int64_t(1) << 31) && a.B <= 65535, "argument '", data_name,
            "': expected rows, cols < 2^31 and B <= 65535, got ", data.shape_string());
  a.copy = make_copy(c, data, columnwise ? q.columnwise_scale : q.rowwise_scale, data_name,
                     columnwise ? "q.columnwise_scale" : "q.rowwise_scale", columnwise, batched, a.B, rows, cols);
  check_device(out, "out", Device::kCUDA);
  MOE_CHECK(out.dtype == DType::kBF16 || out.dtype == DType::kFP32, "argument 'out': expected dtype bf16 or fp32, got ",
            dtype_name(out.dtype));
  check_batched(out, "out", out.dtype, batched, a.B, rows, cols, 16);
  a.out = out.data;
  a.out_fp32 = out.dtype == DType::kFP32;
  if (c.format == QuantFormat::kNVFP4) {
    check_global_amax(q.global_amax, "q.global_amax", a.B);
    a.global_amax = q.global_amax.ptr<const float>();
  }
  return a;
}

}  // namespace moe::quant
