// The quantized weight copies of an FP8 or emulated layer (GroupedExperts::fp8_weights) as PyTorch
// tensors over the op's own memory: Python clones them for a snapshot or copies loaded bytes into
// them, within the call that asked for them, and then accepts them (GroupedExperts::
// accept_fp8_weights). The views do not own that memory, so they never leave moe_engine.
#pragma once

#include <ATen/ATen.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <tuple>
#include <vector>

#include "moe/error.h"
#include "moe/grouped_experts.h"

namespace moe::torch_ext {

// The PyTorch dtype of a copy's bytes: packed FP4 as bytes (two values each, low nibble first).
inline at::ScalarType copy_scalar_type(DType t) {
  switch (t) {
    case DType::kFP8E4M3: return at::kFloat8_e4m3fn;
    case DType::kE8M0: return at::kFloat8_e8m0fnu;
    case DType::kFP32: return at::kFloat;
    case DType::kFP4E2M1:
    case DType::kUInt8: return at::kByte;
    default: break;
  }
  detail::throw_error("fp8_weights: a quantized copy of dtype ", dtype_name(t), " has no PyTorch dtype");
}

// The indices of the parts the layer's format stores, and a view of each. A weight has five parts, in
// QuantizedTensor's order (rowwise data, its scales, columnwise data, its scales, NVFP4's global
// amax): part i is part i % 5 of fc1.weight (i < 5) or of fc2.weight.
inline std::tuple<std::vector<int64_t>, std::vector<at::Tensor>> fp8_weight_views(const GroupedExperts& experts) {
  std::vector<int64_t> parts;
  std::vector<at::Tensor> views;
  int64_t index = 0;
  for (Param param : {Param::kFc1Weight, Param::kFc2Weight}) {
    const QuantizedTensor q = experts.fp8_weights(param);
    for (const TensorView* v :
         {&q.rowwise_data, &q.rowwise_scale, &q.columnwise_data, &q.columnwise_scale, &q.global_amax}) {
      if (v->data != nullptr) {
        cudaPointerAttributes where{};
        MOE_CHECK(cudaPointerGetAttributes(&where, v->data) == cudaSuccess && where.type == cudaMemoryTypeDevice,
                  "fp8_weights: the quantized copies are not in device memory");
        std::vector<int64_t> shape(v->shape, v->shape + v->ndim);
        if (v->dtype == DType::kFP4E2M1) shape.back() /= 2;  // two values a byte (the last dimension is even)
        parts.push_back(index);
        views.push_back(at::from_blob(v->data, shape,
                                      at::TensorOptions()
                                          .dtype(copy_scalar_type(v->dtype))
                                          .device(at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(where.device)))));
      }
      ++index;
    }
  }
  return {std::move(parts), std::move(views)};
}

}  // namespace moe::torch_ext
