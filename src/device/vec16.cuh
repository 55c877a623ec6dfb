// 16-byte vectors shared by the kernel families (dispatch, activation, bias): every row moves as uint4 (one 16-byte load or store
// per lane), and arithmetic unpacks a vector to fp32, works in fp32, and packs with round to
// nearest even (the rounding of moe/float_convert.h).
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace moe::kernels {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T>
struct RowVec {
  static constexpr int kElems = 16 / static_cast<int>(sizeof(T));
};

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }

template <typename T>
__device__ __forceinline__ void unpack(const uint4& v, float (&f)[RowVec<T>::kElems]) {
  T e[RowVec<T>::kElems];
  memcpy(e, &v, 16);
#pragma unroll
  for (int i = 0; i < RowVec<T>::kElems; ++i) f[i] = to_float(e[i]);
}

template <typename T>
__device__ __forceinline__ uint4 pack(const float (&f)[RowVec<T>::kElems]) {
  T e[RowVec<T>::kElems];
#pragma unroll
  for (int i = 0; i < RowVec<T>::kElems; ++i) e[i] = from_float<T>(f[i]);
  uint4 v;
  memcpy(&v, e, 16);
  return v;
}

// 8 bf16 values = one 16-byte vector.
constexpr int kVec = 8;

__device__ __forceinline__ void load_bf16x8(const __nv_bfloat16* p, float (&v)[kVec]) {
  uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) {
    float2 f = __bfloat1622float2(h2[i]);
    v[2 * i] = f.x;
    v[2 * i + 1] = f.y;
  }
}

// Round to nearest even, like moe::float_to_bf16_bits on the host.
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* p, const float (&v)[kVec]) {
  uint4 raw;
  __nv_bfloat162* h2 = reinterpret_cast<__nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec / 2; ++i) h2[i] = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = raw;
}

__device__ __forceinline__ unsigned lanemask_lt() {
  unsigned m;
  asm("mov.u32 %0, %%lanemask_lt;" : "=r"(m));
  return m;
}

}  // namespace moe::kernels
