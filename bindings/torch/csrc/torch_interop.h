// Bridges between PyTorch and the library: at::Tensor -> moe::TensorView, moe::Error -> Python
// exceptions (argument errors -> ValueError, everything else -> RuntimeError), current stream.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/util/Exception.h>

#include <vector>

#include "moe/error.h"
#include "moe/tensor.h"

namespace moe::torch_ext {

inline DType to_moe_dtype(at::ScalarType t) {
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
    default: TORCH_CHECK_VALUE(false, "moe_engine: unsupported tensor dtype ", t);
  }
}

// A view of `t` (any strides; the library checks contiguity where it needs it).
inline TensorView view(const at::Tensor& t) {
  TensorView v;
  if (!t.defined()) return v;
  TORCH_CHECK_VALUE(t.dim() <= TensorView::kMaxDims, "moe_engine: at most ", TensorView::kMaxDims,
                    " dimensions, got ", t.dim());
  v.data = t.data_ptr();
  v.dtype = to_moe_dtype(t.scalar_type());
  v.device = t.is_cuda() ? Device::kCUDA : Device::kCPU;
  v.ndim = static_cast<int>(t.dim());
  for (int d = 0; d < v.ndim; ++d) {
    v.shape[d] = t.size(d);
    v.strides[d] = t.stride(d);
  }
  return v;
}

inline std::vector<TensorView> views(const std::vector<at::Tensor>& ts) {
  std::vector<TensorView> out;
  out.reserve(ts.size());
  for (const auto& t : ts) out.push_back(view(t));
  return out;
}

inline cudaStream_t current_stream() { return at::cuda::getCurrentCUDAStream().stream(); }

// Runs f, turning moe::Error into a Python ValueError (bad argument / input) with its message.
template <typename F>
auto translate_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const Error& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace moe::torch_ext
