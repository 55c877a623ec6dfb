// ExpertMatrices: the two weight layouts (docs/semantics.md, Weight layouts) as one device pointer
// description.
#include <vector>

#include "device/pointer_table.h"
#include "moe/error.h"
#include "moe/grouped_gemm.h"

namespace moe {
namespace {

void check_view(const TensorView& t, const std::string& name, int alignment) {
  check_device(t, name.c_str(), Device::kCUDA);
  check_contiguous(t, name.c_str());
  check_pointer(t, name.c_str(), alignment);
}

void check_alignment(int alignment, const char* name) {
  MOE_CHECK(alignment == 4 || alignment == 16, "argument '", name, "': expected an alignment of 16 (GEMM operands) or 4 "
            "(FP8 scales), got ", alignment);
}

}  // namespace

ExpertMatrices ExpertMatrices::grouped(const TensorView& t, const char* name, int alignment) {
  check_alignment(alignment, name);
  MOE_CHECK(t.ndim == 3, "argument '", name, "': expected a [E, rows, cols] tensor, got shape ", t.shape_string());
  check_view(t, name, alignment);
  MOE_CHECK(t.shape[0] >= 1, "argument '", name, "': expected at least one expert, got shape ", t.shape_string());
  ExpertMatrices m;
  m.experts_ = static_cast<int>(t.shape[0]);
  m.rows_ = t.shape[1];
  m.cols_ = t.shape[2];
  m.dtype_ = t.dtype;
  m.base_ = t.data;
  m.stride_bytes_ = dtype_bytes(t.dtype, t.shape[1] * t.shape[2]);
  // Every matrix, not only the first, must be aligned.
  MOE_CHECK(m.stride_bytes_ % alignment == 0, "argument '", name, "': expected ", alignment,
            "-byte aligned matrices, but one matrix is ", m.stride_bytes_, " bytes");
  m.alignment_ = alignment;
  return m;
}

ExpertMatrices ExpertMatrices::per_expert(const std::vector<TensorView>& ts, const char* name, int alignment) {
  check_alignment(alignment, name);
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
    check_view(ts[e], n, alignment);
    check_dtype(ts[e], n.c_str(), m.dtype_);
    check_shape(ts[e], n.c_str(), {m.rows_, m.cols_});
    MOE_CHECK(ts[e].data != nullptr, "argument '", n, "': expected a non-null pointer");
    ptrs[e] = ts[e].data;
  }
  m.table_owner_ = upload_pointer_table(ptrs);
  m.table_ = static_cast<const void* const*>(m.table_owner_.get());
  m.alignment_ = alignment;
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
