// TensorView: a non-owning view of device or host memory (pointer, dtype, shape, strides, device).
// All public entry points take views; ownership stays with the caller (PyTorch, a test, the layer).
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "moe/dtype.h"

namespace moe {

enum class Device : uint8_t { kCPU, kCUDA };

struct TensorView {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::kFP32;
  Device device = Device::kCUDA;
  int ndim = 0;
  int64_t shape[kMaxDims] = {0, 0, 0, 0};
  int64_t strides[kMaxDims] = {0, 0, 0, 0};  // in elements

  TensorView() = default;
  // A contiguous (row-major) view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape, Device device = Device::kCUDA);

  int64_t numel() const;
  int64_t size(int dim) const;  // negative dims count from the end
  int64_t nbytes() const { return dtype_bytes(dtype, numel()); }
  bool is_contiguous() const;
  bool empty() const { return numel() == 0; }
  std::string shape_string() const;  // "[4, 128]"

  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// Argument checks that produce messages naming the argument, e.g.
//   argument 'x': expected dtype bf16, got fp32
void check_dtype(const TensorView& t, const char* name, DType expected);
void check_device(const TensorView& t, const char* name, Device expected);
void check_contiguous(const TensorView& t, const char* name);
// Expected shape; a negative entry accepts any size in that dimension.
void check_shape(const TensorView& t, const char* name, std::initializer_list<int64_t> expected);
void check_shape(const TensorView& t, const char* name, const std::vector<int64_t>& expected);
// Non-null data unless the view is empty, and `alignment`-byte aligned.
void check_pointer(const TensorView& t, const char* name, int alignment = 16);
// The usual operand check of a kernel entry point: a CUDA tensor of this dtype and shape,
// contiguous, its pointer `alignment`-byte aligned.
void check_device_tensor(const TensorView& t, const char* name, DType dtype, std::initializer_list<int64_t> shape,
                         int alignment = 16);
void check_device_tensor(const TensorView& t, const char* name, DType dtype, const std::vector<int64_t>& shape,
                         int alignment = 16);

// Whether two tensors share a byte (a null tensor shares none).
bool bytes_overlap(const TensorView& a, const TensorView& b);

}  // namespace moe
