#include "support/device_random.h"

#include <cuda_bf16.h>

#include "device/cuda_check.h"

namespace moe::bench {

namespace {
// splitmix64: a good 64-bit mix of (seed, index), independent per element.
__device__ uint64_t mix(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

__device__ float value_at(uint64_t seed, int64_t i, float scale) {
  const double u = (mix(seed * 0x100000001B3ull + i) >> 11) * (1.0 / 9007199254740992.0);  // [0, 1)
  return static_cast<float>((2.0 * u - 1.0) * 1.7320508075688772 * scale);
}

__global__ void fill_bf16_kernel(__nv_bfloat16* out, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(value_at(seed, i, scale));
}

__global__ void fill_fp32_kernel(float* out, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = value_at(seed, i, scale);
}
}  // namespace

void fill_random_bf16(void* data, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_bf16_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(data), n, seed, scale);
  MOE_CUDA_CHECK_LAUNCH();
}

void fill_random_fp32(float* data, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_fp32_kernel<<<1024, 256, 0, stream>>>(data, n, seed, scale);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::bench
