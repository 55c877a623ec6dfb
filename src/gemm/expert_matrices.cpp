// ExpertMatrices: the two weight layouts (docs/semantics.md, Weight layouts) as one device pointer
// description.
#include <vector>

#include "device/pointer_table.h"
#include "moe/error.h"
#include "moe/grouped_gemm.h"

namespace moe {
namespace {

void check_view(const TensorView& t, const std::string& name) {
  check_device(t, name.c_str(), Device::kCUDA);
  check_contiguous(t, name.c_str());
  // 16 bytes: the TMA units of the grouped GEMM address every matrix in 16-byte steps.
  check_pointer(t, name.c_str(), 16);
}

}  // namespace

ExpertMatrices ExpertMatrices::grouped(const TensorView& t, const char* name) {
  MOE_CHECK(t.ndim == 3, "argument '", name, "': expected a [E, rows, cols] tensor, got shape ", t.shape_string());
  check_view(t, name);
  MOE_CHECK(t.shape[0] >= 1, "argument '", name, "': expected at least one expert, got shape ", t.shape_string());
  ExpertMatrices m;
  m.experts_ = static_cast<int>(t.shape[0]);
  m.rows_ = t.shape[1];
  m.cols_ = t.shape[2];
  m.dtype_ = t.dtype;
  m.base_ = t.data;
  m.stride_bytes_ = dtype_bytes(t.dtype, t.shape[1] * t.shape[2]);
  return m;
}

ExpertMatrices ExpertMatrices::per_expert(const std::vector<TensorView>& ts, const char* name) {
  MOE_CHECK(!ts.empty(), "argument '", name, "': expected at least one expert tensor, got none");
  ExpertMatrices m;
  m.experts_ = static_cast<int>(ts.size());
  m.dtype_ = ts[0].dtype;
  m.rows_ = ts[0].ndim == 2 ? ts[0].shape[0] : -1;
  m.cols_ = ts[0].ndim == 2 ? ts[0].shape[1] : -1;
  std::vector<const void*> ptrs(ts.size());
  for (size_t e = 0; e < ts.size(); ++e) {
    const std::string n = std::string(name) + std::to_string(e);
    MOE_CHECK(ts[e].ndim == 2, "argument '", n, "': expected a [rows, cols] tensor, got shape ", ts[e].shape_string());
    check_view(ts[e], n);
    check_dtype(ts[e], n.c_str(), m.dtype_);
    check_shape(ts[e], n.c_str(), {m.rows_, m.cols_});
    MOE_CHECK(ts[e].data != nullptr, "argument '", n, "': expected a non-null pointer");
    ptrs[e] = ts[e].data;
  }
  m.table_owner_ = upload_pointer_table(ptrs);
  m.table_ = static_cast<const void* const*>(m.table_owner_.get());
  return m;
}

ExpertMatrices ExpertMatrices::as_transposed() const {
  ExpertMatrices m = *this;
  m.rows_ = cols_;
  m.cols_ = rows_;
  m.transposed_ = !transposed_;
  return m;
}

}  // namespace moe
