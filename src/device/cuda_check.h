// CUDA runtime error checking: a failed call becomes a moe::Error naming the call and the location.
#pragma once

#include <cuda_runtime_api.h>

#include "moe/error.h"

#define MOE_CUDA_CHECK(call)                                                                       \
  do {                                                                                             \
    cudaError_t moe_cuda_status_ = (call);                                                         \
    if (moe_cuda_status_ != cudaSuccess)                                                           \
      ::moe::detail::throw_error("CUDA error '", cudaGetErrorString(moe_cuda_status_), "' in ", #call, \
                                 " at ", __FILE__, ":", __LINE__);                                 \
  } while (0)

// After a kernel launch: reports launch-configuration errors without synchronising.
#define MOE_CUDA_CHECK_LAUNCH() MOE_CUDA_CHECK(cudaGetLastError())
