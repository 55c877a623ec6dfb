#include "kernels/activation_args.h"

#include "moe/error.h"

namespace moe::kernels {

void check_row_vector(const TensorView& t, const char* name, int64_t R) {
  if (is_absent(t)) return;
  check_device(t, name, Device::kCUDA);
  check_dtype(t, name, DType::kFP32);
  check_shape(t, name, {R});
  check_pointer(t, name, 4);
}

ActivationDims check_activation_args(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                                     const TensorView& group_offsets, const TensorView& cols,
                                     const char* cols_name) {
  ActivationDims d;
  check_device(cols, cols_name, Device::kCUDA);
  check_dtype(cols, cols_name, DType::kBF16);
  MOE_CHECK(cols.ndim == 2, "argument '", cols_name, "': expected a 2-D tensor [R, F], got shape ",
            cols.shape_string());
  check_contiguous(cols, cols_name);
  d.R = cols.shape[0];
  d.F = cols.shape[1];
  // 16-byte vectors of 8 bf16 never straddle a row (nor, with s % 8 == 0, an interleave block; with
  // s = 1 a vector pair holds 8 gate and 8 linear columns).
  MOE_CHECK(d.F > 0 && d.F % 8 == 0, "argument '", cols_name, "': expected F (columns) a positive multiple of 8, got ",
            d.F);
  // Column math on the device is 32-bit (fast); rows are one warp each (grid.x < 2^31 blocks).
  MOE_CHECK(d.F <= (int64_t(1) << 29), "argument '", cols_name, "': expected F <= 2^29, got ", d.F);
  MOE_CHECK(d.R < (int64_t(1) << 33), "argument '", cols_name, "': expected R < 2^33 rows, got ", d.R);
  validate_activation(params, d.F);  // also the clamped-swiglu parameters
  check_pointer(cols, cols_name, 16);
  d.in_cols = fc1_out_features(params.kind, d.F);
  check_device_tensor(h, "h", DType::kBF16, {d.R, d.in_cols});
  check_row_vector(probs, "probs", d.R);
  if (!is_absent(group_offsets)) {
    check_device(group_offsets, "group_offsets", Device::kCUDA);
    check_dtype(group_offsets, "group_offsets", DType::kInt32);
    MOE_CHECK(group_offsets.ndim == 1 && group_offsets.shape[0] >= 1,
              "argument 'group_offsets': expected shape [E + 1] with E >= 0, got ", group_offsets.shape_string());
    check_pointer(group_offsets, "group_offsets", 4);
    d.groups = static_cast<int>(group_offsets.shape[0] - 1);
  }
  return d;
}

}  // namespace moe::kernels
