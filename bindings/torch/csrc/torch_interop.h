// Bridges between PyTorch and the library: at::Tensor -> moe::TensorView (checked, naming the
// argument), moe::Error -> Python ValueError, current stream, caller-owned saved states held in
// tensors.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

#include "moe/error.h"
#include "moe/saved_state.h"
#include "moe/tensor.h"

namespace moe::torch_ext {

// The library dtype of `t`, or a moe::Error naming the argument.
inline DType to_moe_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kBFloat16: return DType::kBF16;
    case at::kHalf: return DType::kFP16;
    case at::kFloat: return DType::kFP32;
    case at::kDouble: return DType::kFP64;
    case at::kInt: return DType::kInt32;
    case at::kLong: return DType::kInt64;
    case at::kByte: return DType::kUInt8;
    case at::kBool: return DType::kBool;
    case at::kFloat8_e4m3fn: return DType::kFP8E4M3;
    case at::kFloat8_e5m2: return DType::kFP8E5M2;
    default: break;
  }
  const std::string type_name(c10::toString(t));
  detail::throw_error("argument '", name, "': unsupported tensor dtype ", type_name);
}

// A view of `t` (any strides; the library checks contiguity where it needs it). Throws moe::Error
// naming the argument (call inside translate_errors).
inline TensorView view(const at::Tensor& t, const char* name) {
  TensorView v;
  if (!t.defined()) return v;
  const int64_t dims = t.dim();
  MOE_CHECK(dims <= int64_t{TensorView::kMaxDims}, "argument '", name, "': expected at most ",
            int64_t{TensorView::kMaxDims}, " dimensions, got ", dims);
  v.data = t.data_ptr();
  v.dtype = to_moe_dtype(t.scalar_type(), name);
  v.device = t.is_cuda() ? Device::kCUDA : Device::kCPU;
  v.ndim = static_cast<int>(dims);
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  return v;
}

// A Python int argument as the library's int: one outside its range is refused by name, not wrapped
// (a topk of 2^32 + 2 would have become 2).
inline int to_int(int64_t v, const char* name) {
  MOE_CHECK(v >= std::numeric_limits<int>::min() && v <= std::numeric_limits<int>::max(), "argument '", name,
            "': expected a value that fits a 32-bit int, got ", v);
  return static_cast<int>(v);
}

// A Python float argument as the library's float: a finite value past float's range (its conversion
// is undefined) or a non-zero one that rounds to zero is refused by name; NaN and infinities pass on
// to the library's own checks.
inline float to_float(double v, const char* name) {
  MOE_CHECK(!std::isfinite(v) || std::fabs(v) <= static_cast<double>(std::numeric_limits<float>::max()),
            "argument '", name, "': expected a value within float's range, got ", v);
  const float f = static_cast<float>(v);
  // A non-zero value that float rounds to zero would switch off what it weighs (a loss coefficient).
  MOE_CHECK(v == 0 || f != 0, "argument '", name, "': ", v, " is non-zero but below float's smallest value");
  return f;
}

// `t` has exactly `dims` dimensions (checked before any t.size(i) is read).
inline void require_dims(const at::Tensor& t, const char* name, int64_t dims) {
  MOE_CHECK(t.defined(), "argument '", name, "': expected a tensor, got None");
  MOE_CHECK(t.dim() == dims, "argument '", name, "': expected a ", dims, "-D tensor, got ", int64_t{t.dim()},
            " dimensions");
}

inline std::vector<TensorView> views(const std::vector<at::Tensor>& ts, const char* name) {
  std::vector<TensorView> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(view(t, name));
  return out;
}

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

// Whether the current stream is being captured into a CUDA graph (synchronous work is not allowed).
inline bool capturing() {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(current_stream(), &status) == cudaSuccess && status != cudaStreamCaptureStatusNone;
}

// Runs f, turning moe::Error into a Python ValueError (bad argument / input) with its message.
template <typename F>
auto translate_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

// A saved state held in two tensors: device memory (PyTorch's caching allocator, so it lives in a
// CUDA graph's pool when made during capture) and a CPU uint8 tensor of host headers. Autograd
// keeps both in the context of the forward that filled them.
inline std::tuple<at::Tensor, at::Tensor> new_state_tensors(size_t device_bytes, int headers, const at::Tensor& like) {
  at::Tensor dev = at::empty({static_cast<int64_t>(device_bytes)}, like.options().dtype(at::kByte));
  at::Tensor host = at::zeros({int64_t(headers) * int64_t(sizeof(StateHeader))}, at::TensorOptions().dtype(at::kByte));
  return {dev, host};
}

// name / header_name: the operator's argument names (the dispatch ops call theirs plan / plan_header).
inline SavedState state_of(const at::Tensor& dev, const at::Tensor& host, int headers, const char* name = "state",
                           const char* header_name = "state_header") {
  MOE_CHECK(dev.defined() && dev.is_cuda() && dev.scalar_type() == at::kByte && dev.dim() == 1 && dev.is_contiguous(),
            "argument '", name, "': expected the CUDA uint8 state tensor returned by the forward");
  MOE_CHECK(host.defined() && !host.is_cuda() && host.scalar_type() == at::kByte && host.dim() == 1 &&
                host.is_contiguous() && host.numel() == int64_t(headers) * int64_t(sizeof(StateHeader)),
            "argument '", header_name, "': expected the CPU uint8 header tensor returned by the forward");
  return SavedState::borrow(dev.data_ptr(), static_cast<size_t>(dev.numel()),
                            reinterpret_cast<StateHeader*>(host.data_ptr()), headers);
}

}  // namespace moe::torch_ext
