// Fills device buffers with reproducible pseudo-random values on the GPU (a counter-based hash),
// so benchmarks of multi-GB shapes do not spend minutes generating data on the host.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace moe::bench {

// bf16 values uniform in [-scale * sqrt(3), scale * sqrt(3)) (standard deviation `scale`).
void fill_random_bf16(void* data, int64_t n, uint64_t seed, float scale, cudaStream_t stream);
// The same values (before rounding to bf16) as fp32.
void fill_random_fp32(float* data, int64_t n, uint64_t seed, float scale, cudaStream_t stream);

}  // namespace moe::bench
