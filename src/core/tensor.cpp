#include "moe/tensor.h"

#include <cstdint>
#include <string>

#include "moe/error.h"

namespace moe {

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> shape_, Device device_)
    : data(data_), dtype(dtype_), device(device_), ndim(static_cast<int>(shape_.size())) {
  MOE_CHECK(ndim <= kMaxDims, "TensorView: at most ", kMaxDims, " dimensions, got ", ndim);
  int i = 0;
  for (int64_t s : shape_) {
    MOE_CHECK(s >= 0, "TensorView: negative size ", s, " in dimension ", i);
    shape[i++] = s;
  }
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= shape[d];
  }
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

int64_t TensorView::size(int dim) const {
  int d = dim < 0 ? dim + ndim : dim;
  MOE_CHECK(d >= 0 && d < ndim, "TensorView::size: dimension ", dim, " out of range for ", ndim, " dims");
  return shape[d];
}

bool TensorView::is_contiguous() const {
  if (numel() == 0) return true;  // no element to place: any strides describe the same (empty) layout
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::shape_string() const {
  // The fields are public: a view set up by hand may carry any ndim; messages must not read past shape.
  if (ndim < 0 || ndim > kMaxDims) return "[invalid ndim " + std::to_string(ndim) + "]";
  std::string s = "[";
  for (int d = 0; d < ndim; ++d) s += (d ? ", " : "") + std::to_string(shape[d]);
  return s + "]";
}

void check_dtype(const TensorView& t, const char* name, DType expected) {
  MOE_CHECK(t.dtype == expected, "argument '", name, "': expected dtype ", dtype_name(expected), ", got ",
            dtype_name(t.dtype));
}

void check_device(const TensorView& t, const char* name, Device expected) {
  MOE_CHECK(t.device == expected, "argument '", name, "': expected a ",
            expected == Device::kCUDA ? "CUDA" : "CPU", " tensor");
}

void check_contiguous(const TensorView& t, const char* name) {
  MOE_CHECK(t.is_contiguous(), "argument '", name, "': expected a contiguous tensor, got shape ",
            t.shape_string(), " with non-row-major strides");
}

namespace {
void check_shape_of(const TensorView& t, const char* name, const int64_t* expected, size_t n) {
  bool ok = t.ndim == static_cast<int>(n);
  // A negative extent is never a valid shape (a negative expected extent means "any").
  for (size_t d = 0; ok && d < n; ++d) ok = t.shape[d] >= 0;
  std::string want = "[";
  for (size_t d = 0; d < n; ++d) {
    const int64_t e = expected[d];
    want += (d ? ", " : "") + (e < 0 ? std::string("*") : std::to_string(e));
    if (ok && e >= 0 && t.shape[d] != e) ok = false;
  }
  want += "]";
  MOE_CHECK(ok, "argument '", name, "': expected shape ", want, ", got ", t.shape_string());
}
}  // namespace

void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected) {
  check_shape_of(t, name, expected.begin(), expected.size());
}
void check_shape(const TensorView& t, const char* name, const std::vector<int64_t>& expected) {
  check_shape_of(t, name, expected.data(), expected.size());
}

void check_pointer(const TensorView& t, const char* name, int alignment) {
  if (t.empty()) return;
  MOE_CHECK(t.data != nullptr, "argument '", name, "': null data pointer for a non-empty tensor");
  MOE_CHECK(reinterpret_cast<uintptr_t>(t.data) % alignment == 0, "argument '", name, "': expected a ",
            alignment, "-byte aligned pointer");
}

void check_device_tensor(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                         int alignment) {
  check_device_tensor(t, name, dtype, std::vector<int64_t>(shape), alignment);
}
void check_device_tensor(const TensorView& t, const char* name, DType dtype, const std::vector<int64_t>& shape,
                         int alignment) {
  check_device(t, name, Device::kCUDA);
  check_dtype(t, name, dtype);
  check_shape(t, name, shape);
  check_contiguous(t, name);
  check_pointer(t, name, alignment);
}

bool bytes_overlap(const TensorView& a, const TensorView& b) {
  if (a.data == nullptr || b.data == nullptr) return false;
  const char *pa = static_cast<const char*>(a.data), *pb = static_cast<const char*>(b.data);
  return pa < pb + b.nbytes() && pb < pa + a.nbytes();
}

}  // namespace moe
