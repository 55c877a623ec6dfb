#include "kernels/bias_args.h"

#include <cstdint>

#include "kernels/activation_args.h"
#include "kernels/bias_grad_plan.h"
#include "moe/error.h"

namespace moe {

ExpertRows ExpertRows::single_grouped(const TensorView& t) {
  check_device(t, "rows", Device::kCUDA);
  MOE_CHECK(t.ndim == 2, "argument 'rows': expected an [E, N] tensor, got shape ", t.shape_string());
  check_contiguous(t, "rows");
  ExpertRows r;
  r.stacked = t.data;
  r.dtype = t.dtype;
  r.experts = static_cast<int>(t.shape[0]);
  r.cols = t.shape[1];
  return r;
}

ExpertRows ExpertRows::per_expert(void* const* device_table, DType dtype, int experts, int64_t cols) {
  ExpertRows r;
  r.table = device_table;
  r.dtype = dtype;
  r.experts = experts;
  r.cols = cols;
  return r;
}

namespace kernels {

BiasDims check_grouped_matrix(const TensorView& m, const char* name, const TensorView& group_offsets) {
  BiasDims d;
  check_device(m, name, Device::kCUDA);
  check_dtype(m, name, DType::kBF16);
  MOE_CHECK(m.ndim == 2, "argument '", name, "': expected a 2-D tensor [R, N], got shape ", m.shape_string());
  check_contiguous(m, name);
  d.R = m.shape[0];
  d.N = m.shape[1];
  MOE_CHECK(d.N > 0 && d.N % 8 == 0, "argument '", name, "': expected N (columns) a positive multiple of 8, got ",
            d.N);
  MOE_CHECK(d.R < kBiasGradMaxRows, "argument '", name, "': expected R < 2^33 rows, got ", d.R);
  MOE_CHECK(d.N <= INT32_MAX, "argument '", name, "': expected N < 2^31 columns, got ", d.N);
  check_pointer(m, name, 16);
  MOE_CHECK(!is_absent(group_offsets), "argument 'group_offsets': required (int32 [E + 1])");
  check_device(group_offsets, "group_offsets", Device::kCUDA);
  check_dtype(group_offsets, "group_offsets", DType::kInt32);
  MOE_CHECK(group_offsets.ndim == 1 && group_offsets.shape[0] >= 1,
            "argument 'group_offsets': expected shape [E + 1] with E >= 0, got ", group_offsets.shape_string());
  check_pointer(group_offsets, "group_offsets", 4);
  MOE_CHECK(group_offsets.shape[0] - 1 < INT32_MAX, "argument 'group_offsets': expected fewer than 2^31 - 1 ",
            "experts, got ", group_offsets.shape[0] - 1);
  d.E = static_cast<int>(group_offsets.shape[0] - 1);
  return d;
}

void check_expert_rows(const ExpertRows& rows, const char* name, const BiasDims& d,
                       std::initializer_list<DType> dtypes) {
  bool ok = false;
  for (DType t : dtypes) ok = ok || rows.dtype == t;
  MOE_CHECK(ok, "argument '", name, "': unsupported dtype ", dtype_name(rows.dtype));
  MOE_CHECK(rows.experts == d.E, "argument '", name, "': expected ", d.E, " experts (group_offsets has E + 1 = ",
            d.E + 1, " entries), got ", rows.experts);
  MOE_CHECK(rows.cols == d.N, "argument '", name, "': expected ", d.N, " columns, got ", rows.cols);
  if (d.E == 0) return;
  MOE_CHECK((rows.stacked == nullptr) != (rows.table == nullptr), "argument '", name,
            "': expected exactly one of a stacked [E, N] block or a device pointer table");
  if (rows.stacked != nullptr)
    MOE_CHECK(reinterpret_cast<uintptr_t>(rows.stacked) % 16 == 0, "argument '", name,
              "': expected a 16-byte aligned pointer");
}

}  // namespace kernels
}  // namespace moe
