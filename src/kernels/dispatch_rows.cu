// Row-parallel dispatch kernels: one warp per row r of the permuted buffer [R, H].
//   permute:            x_perm[r] = x[token of r] (or zero), the per-row scale block likewise.
//   unpermute backward: dY[r] = w * dy[token of r] (or zero), and dprobs[slot of r] = <Y[r], dy[t]>.
// Every row of [0, R) is written on every call (pad rows and rows past sum(padded) with zeros), so
// x_perm never holds stale data from an earlier step. Lanes move 16-byte vectors; kUnroll of them
// are loaded before any is stored to keep enough bytes in flight.
#include "device/cuda_check.h"
#include "kernels/dispatch_kernels.h"
#include "device/vec16.cuh"

namespace moe::kernels {
namespace {

constexpr int kWarps = 4;  // rows per block
constexpr int kUnroll = 4;

// dst[0, n) = src[0, n) (src null: zeros), one warp, V-sized units.
template <typename V>
__device__ __forceinline__ void warp_copy(V* dst, const V* src, int64_t n, int lane) {
  for (int64_t v0 = lane; v0 < n; v0 += 32 * kUnroll) {
    V r[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * 32;
      r[u] = (src && v < n) ? __ldg(src + v) : V{};
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * 32;
      if (v < n) dst[v] = r[u];
    }
  }
}

// The scale block of a row: the widest unit that divides its size (rows start at multiples of it).
__device__ __forceinline__ void warp_copy_bytes(char* dst, const char* src, int64_t bytes, int lane) {
  if (bytes % 16 == 0)
    warp_copy(reinterpret_cast<uint4*>(dst), reinterpret_cast<const uint4*>(src), bytes / 16, lane);
  else if (bytes % 4 == 0)
    warp_copy(reinterpret_cast<uint32_t*>(dst), reinterpret_cast<const uint32_t*>(src), bytes / 4, lane);
  else
    warp_copy(reinterpret_cast<uint8_t*>(dst), reinterpret_cast<const uint8_t*>(src), bytes, lane);
}

__global__ void __launch_bounds__(kWarps * 32)
    permute_rows_kernel(const uint4* x, uint4* x_perm, int64_t nvec, const char* x_scale, char* x_perm_scale,
                        int64_t scale_bytes, const int32_t* row_slot, int slots, int32_t R) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t r = blockIdx.x * kWarps + warp;
  if (r >= R) return;
  const int32_t slot = __ldg(row_slot + r);
  const int64_t t = slot >= 0 ? slot / slots : -1;
  warp_copy(x_perm + r * nvec, t >= 0 ? x + t * nvec : nullptr, nvec, lane);
  if (scale_bytes > 0)
    warp_copy_bytes(x_perm_scale + r * scale_bytes, t >= 0 ? x_scale + t * scale_bytes : nullptr, scale_bytes, lane);
}

template <typename T>
__global__ void __launch_bounds__(kWarps * 32)
    scale_rows_backward_kernel(const uint4* dy, const uint4* Y, uint4* dY, int64_t nvec, const int32_t* row_slot,
                               int slots, int32_t R, const float* probs_perm, const float* slot_probs, bool merge,
                               float* dprobs) {
  constexpr int kE = RowVec<T>::kElems;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t r = blockIdx.x * kWarps + warp;
  if (r >= R) return;
  const int32_t slot = __ldg(row_slot + r);
  uint4* out = dY + r * nvec;
  if (slot < 0) {  // pad or unused row: its gradient is zero
    warp_copy<uint4>(out, nullptr, nvec, lane);
    return;
  }
  const uint4* in = dy + static_cast<int64_t>(slot / slots) * nvec;
  const uint4* yrow = Y + r * nvec;
  const float w = !merge ? 1.0f : slot_probs ? __ldg(slot_probs + slot) : __ldg(probs_perm + r);
  const bool want_dot = merge && dprobs != nullptr;
  float dot = 0.0f;
  for (int64_t v0 = lane; v0 < nvec; v0 += 32 * kUnroll) {
    uint4 g[kUnroll], yv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * 32;
      g[u] = v < nvec ? __ldg(in + v) : uint4{};
      yv[u] = (want_dot && v < nvec) ? __ldg(yrow + v) : uint4{};
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * 32;
      if (v >= nvec) continue;
      float gf[kE], o[kE];
      unpack<T>(g[u], gf);
#pragma unroll
      for (int i = 0; i < kE; ++i) o[i] = w * gf[i];
      out[v] = pack<T>(o);
      if (want_dot) {
        float yf[kE];
        unpack<T>(yv[u], yf);
#pragma unroll
        for (int i = 0; i < kE; ++i) dot = fmaf(yf[i], gf[i], dot);
      }
    }
  }
  if (want_dot) {
    // Fixed butterfly: the same bits every run.
#pragma unroll
    for (int m = 16; m > 0; m /= 2) dot += __shfl_xor_sync(kFullMask, dot, m);
    if (lane == 0) dprobs[slot] = dot;
  }
}

unsigned row_blocks(int32_t R) { return static_cast<unsigned>((R + kWarps - 1) / kWarps); }

}  // namespace

void launch_permute_rows(const void* x, void* x_perm, int64_t row_bytes, const void* x_scale, void* x_perm_scale,
                         int64_t scale_bytes, const int32_t* row_slot, int slots, int32_t R, cudaStream_t stream) {
  if (R == 0) return;
  permute_rows_kernel<<<row_blocks(R), kWarps * 32, 0, stream>>>(
      static_cast<const uint4*>(x), static_cast<uint4*>(x_perm), row_bytes / 16, static_cast<const char*>(x_scale),
      static_cast<char*>(x_perm_scale), scale_bytes, row_slot, slots, R);
  MOE_CUDA_CHECK_LAUNCH();
}

void launch_scale_rows_backward(DType dtype, const void* dy, const void* Y, void* dY, int64_t H,
                                const int32_t* row_slot, int slots, int32_t R, const float* probs_perm,
                                const float* slot_probs, bool merge, float* dprobs, cudaStream_t stream) {
  if (R == 0) return;
  auto launch = [&](auto zero) {
    using T = decltype(zero);
    const int64_t nvec = H / RowVec<T>::kElems;
    scale_rows_backward_kernel<T><<<row_blocks(R), kWarps * 32, 0, stream>>>(
        static_cast<const uint4*>(dy), static_cast<const uint4*>(Y), static_cast<uint4*>(dY), nvec, row_slot, slots,
        R, probs_perm, slot_probs, merge, dprobs);
  };
  switch (dtype) {
    case DType::kBF16: launch(__nv_bfloat16{}); break;
    case DType::kFP16: launch(__half{}); break;
    case DType::kFP32: launch(float{}); break;
    default: detail::throw_error("launch_scale_rows_backward: unsupported dtype ", dtype_name(dtype));
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::kernels
