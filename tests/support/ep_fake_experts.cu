// The stand-in experts of ep_fake_experts.h: one thread per element of the rows of the groups.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "device/cuda_check.h"
#include "moe/error.h"
#include "support/ep_fake_experts.h"

namespace moe::testing {
namespace {

constexpr int kThreads = 256;

__device__ float load(const float* p, int64_t i) { return p[i]; }
__device__ float load(const __nv_bfloat16* p, int64_t i) { return __bfloat162float(p[i]); }
__device__ float load(const __half* p, int64_t i) { return __half2float(p[i]); }
__device__ void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ void store(__nv_bfloat16* p, int64_t i, float v) { p[i] = __float2bfloat16_rn(v); }
__device__ void store(__half* p, int64_t i, float v) { p[i] = __float2half_rn(v); }

// The group of row r (-1 past the groups): the last e with g[e] <= r, found by bisection.
__device__ int expert_of(const int32_t* g, int E, int64_t r) {
  if (r >= g[E]) return -1;
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (g[mid] <= r) lo = mid; else hi = mid - 1;
  }
  return lo;
}

template <typename T>
__global__ void forward_kernel(const T* x, T* y, const int32_t* g, int E, const float* probs, int64_t rows, int64_t H) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * H) return;
  const int64_t r = i / H;
  const int e = expert_of(g, E, r);
  if (e < 0) return;
  store(y, i, load(x, i) * (1.0f + 0.25f * e) + 0.5f * probs[r]);
}

template <typename T>
__global__ void backward_kernel(const T* dY, T* dx, float* d_probs, const int32_t* g, int E, const float* probs,
                                int64_t rows, int64_t H) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (i >= rows * H) return;
  const int64_t r = i / H;
  const int e = expert_of(g, E, r);
  if (e < 0) return;
  store(dx, i, load(dY, i) * (2.0f - 0.125f * e) - probs[r]);
  if (d_probs && i % H == 0) d_probs[r] = load(dY, i) * 0.75f + static_cast<float>(e);
}

template <typename T>
void launch(const EpChunk& c, bool backward, cudaStream_t stream) {
  const int64_t rows = c.in.shape[0], H = c.in.shape[1], n = rows * H;
  const int E = static_cast<int>(c.group_offsets.shape[0]) - 1;
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  const T* in = static_cast<const T*>(c.in.data);
  T* out = static_cast<T*>(c.out.data);
  const int32_t* g = c.group_offsets.ptr<int32_t>();
  const float* p = c.probs_perm.ptr<float>();
  if (backward) {
    float* dp = c.d_probs_perm.data ? static_cast<float*>(c.d_probs_perm.data) : nullptr;
    backward_kernel<T><<<blocks, kThreads, 0, stream>>>(in, out, dp, g, E, p, rows, H);
  } else {
    forward_kernel<T><<<blocks, kThreads, 0, stream>>>(in, out, g, E, p, rows, H);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

void dispatch(const EpChunk& c, bool backward, cudaStream_t stream) {
  switch (c.in.dtype) {
    case DType::kBF16: return launch<__nv_bfloat16>(c, backward, stream);
    case DType::kFP16: return launch<__half>(c, backward, stream);
    case DType::kFP32: return launch<float>(c, backward, stream);
    default: MOE_CHECK(false, "fake experts: row dtype ", dtype_name(c.in.dtype), " not supported");
  }
}

}  // namespace

void fake_experts_forward(const EpChunk& chunk, cudaStream_t stream) { dispatch(chunk, false, stream); }
void fake_experts_backward(const EpChunk& chunk, cudaStream_t stream) { dispatch(chunk, true, stream); }

}  // namespace moe::testing
