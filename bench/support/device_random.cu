#include "support/device_random.h"

#include <cuda_bf16.h>

#include <type_traits>

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

// One kernel for every element type: the same value per index, rounded to T.
template <typename T>
__global__ void fill_kernel(T* out, int64_t n, uint64_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
      out[i] = __float2bfloat16(value_at(seed, i, scale));
    else
      out[i] = value_at(seed, i, scale);
  }
}

template <typename T>
void fill(T* data, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  if (n == 0) return;
  fill_kernel<T><<<1024, 256, 0, stream>>>(data, n, seed, scale);
  MOE_CUDA_CHECK_LAUNCH();
}
}  // namespace

void fill_random_bf16(void* data, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  fill(static_cast<__nv_bfloat16*>(data), n, seed, scale, stream);
}

void fill_random_fp32(float* data, int64_t n, uint64_t seed, float scale, cudaStream_t stream) {
  fill(data, n, seed, scale, stream);
}

}  // namespace moe::bench
