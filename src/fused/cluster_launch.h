// Launch of a fused kernel on a grid of thread-block clusters (1-D), with its dynamic shared memory.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

#include "device/cuda_check.h"

namespace moe::fused {

// `max_smem`: the kernel's dynamic shared memory limit (set per launch: the attribute belongs to the
// current device, and setting it is a cheap host call, fine while capturing); `smem`: this launch's.
template <class Params>
void launch_clustered(void (*kernel)(Params), const Params& p, int grid, int threads, int cluster, size_t smem,
                      size_t max_smem, cudaStream_t stream) {
  MOE_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(max_smem)));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(grid));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr;
  attr.id = cudaLaunchAttributeClusterDimension;
  attr.val.clusterDim.x = static_cast<unsigned>(cluster);
  attr.val.clusterDim.y = 1;
  attr.val.clusterDim.z = 1;
  config.attrs = &attr;
  config.numAttrs = 1;
  MOE_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, p));
}

}  // namespace moe::fused
