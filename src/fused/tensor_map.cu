#include "fused/tensor_map.h"

#include <cuda_runtime_api.h>
#include <cutlass/cuda_host_adapter.hpp>

#include "device/cuda_check.h"
#include "moe/error.h"

namespace moe::fused {

CUtensorMap bf16_tensor_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides,
                            const uint32_t* box, const char* who) {
  CUtensorMap map;
  cuuint64_t d[5], s[4];
  cuuint32_t b[5], unit[5];
  for (int i = 0; i < rank; ++i) {
    d[i] = dims[i];
    b[i] = box[i];
    unit[i] = 1;
    if (i + 1 < rank) s[i] = strides[i];
  }
  auto encode = [&] {
    return CUTLASS_CUDA_DRIVER_WRAPPER_CALL(cuTensorMapEncodeTiled)(
        &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, static_cast<cuuint32_t>(rank), const_cast<void*>(base), d, s, b,
        unit, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  };
  CUresult r = encode();
  if (r == CUDA_ERROR_INVALID_CONTEXT) {
    // The encoder is a driver call and needs a current context, which the runtime makes current on
    // a thread only at that thread's first runtime call: a backward on a fresh thread (PyTorch's
    // autograd worker) can get here first. cudaSetDevice makes the device's primary context
    // current; then encode again.
    int device = 0;
    MOE_CUDA_CHECK(cudaGetDevice(&device));
    MOE_CUDA_CHECK(cudaSetDevice(device));
    r = encode();
  }
  MOE_CHECK(r == CUDA_SUCCESS, who, ": cuTensorMapEncodeTiled failed (", static_cast<int>(r), ")");
  return map;
}

}  // namespace moe::fused
