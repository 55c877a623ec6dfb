// Device helpers of the top-k row kernels (router_topk_rows.cu: plain top-k; router_biased_rows.cu:
// with an expert bias or a group limit): sorted lists of keys and their merges, the candidate
// filter's fp32 passes, and the vector stores of a lane's output slots (docs/router.md, "Plain
// top-k"). A row's lane owns 16-byte vectors c = i G + lane_g (vector i of the lane, G lanes a row).
#pragma once

#include <cuda_bf16.h>

#include <cfloat>
#include <cstdint>

#include "router/router_math.cuh"

namespace moe::kernels::router {

constexpr int kMaxExperts = 512;  // 16 lanes x 32 experts
constexpr int kMaxK = 8;
// The most candidates a lane inserts one by one; a warp with a lane above it sorts every vector (an
// insertion costs 20-35 instructions, sorting and merging a lane's four vectors ~470).
constexpr int kMaxLaneCandidates = 10;
// The most candidates a row ranks (fp32 lists of L >= 4) or sorts across its lanes (bf16: its slots,
// a power of two); a warp with a row above it sorts every vector.
constexpr int kMaxRowCandidates = 32;
// Two bf16 -3.39e38 (the lowest finite value): the filter's filler for vectors past E or rows past T
// (finite, so never taken for a non-finite logit; their candidate bits are cleared).
constexpr uint32_t kLowestPair = 0xff7fff7fu;

// Keeps in a the top L of the sorted (descending) lists a and b: elementwise max against b reversed
// gives a bitonic sequence holding the top L of both; log2(L) exchange stages sort it.
template <int L, typename K>
__device__ __forceinline__ void merge_top(K (&a)[L], const K (&b)[L]) {
#pragma unroll
  for (int i = 0; i < L; ++i) a[i] = max(a[i], b[L - 1 - i]);
#pragma unroll
  for (int stride = L / 2; stride > 0; stride /= 2)
#pragma unroll
    for (int i = 0; i < L; ++i)
      if ((i & stride) == 0) compare_swap(a[i], a[i + stride]);
}

// Two bf16 logits of a 32-bit word (the low half first).
__device__ __forceinline__ __nv_bfloat162 as_bf162(uint32_t w) { return *reinterpret_cast<const __nv_bfloat162*>(&w); }

__device__ __forceinline__ uint32_t bits_of(int v) { return static_cast<uint32_t>(v); }
__device__ __forceinline__ uint32_t bits_of(float v) { return __float_as_uint(v); }

// Stores n consecutive 4-byte values from registers as 16- or 8-byte vectors (dst aligned to 4 n bytes).
template <int n, class T>
__device__ __forceinline__ void store_slots(T* dst, const T (&v)[n]) {
  static_assert(sizeof(T) == 4, "int32 or float slots");
  if constexpr (n % 4 == 0) {
#pragma unroll
    for (int i = 0; i < n; i += 4)
      *reinterpret_cast<uint4*>(dst + i) = make_uint4(bits_of(v[i]),
                                                      bits_of(v[i + 1]), bits_of(v[i + 2]), bits_of(v[i + 3]));
  } else if constexpr (n == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(bits_of(v[0]), bits_of(v[1]));
  } else {
    dst[0] = v[0];
  }
}

// The number of keys of list[0, n) above key; list holds zeros (below every key) up to n rounded up
// to 4, and is 16-byte aligned.
template <typename K>
__device__ __forceinline__ int keys_above(const K* list, int n, K key) {
  int r = 0;
  for (int i = 0; i < n; i += 4) {
    if constexpr (sizeof(K) == 4) {
      const uint4 q = *reinterpret_cast<const uint4*>(list + i);
      r += (q.x > key) + (q.y > key) + (q.z > key) + (q.w > key);
    } else {
      const ulonglong2 a = *reinterpret_cast<const ulonglong2*>(list + i);
      const ulonglong2 b = *reinterpret_cast<const ulonglong2*>(list + i + 2);
      r += (a.x > key) + (a.y > key) + (b.x > key) + (b.y > key);
    }
  }
  return r;
}

// The k-th largest of the G lanes' values v (every lane of the group gets it): a bitonic sort across
// the group, descending by lane, then lane k - 1's value; for k = G (the minimum) and k = 1 (the
// maximum) a butterfly, a fifth of the sort's instructions, and for k = 2 a butterfly that merges the
// lanes' two largest.
template <int G>
__device__ __forceinline__ float group_kth_largest(float v, int k, int lane_g) {
  if (k == G || k == 1) {  // k is the kernel's argument: the whole warp takes the same branch
#pragma unroll
    for (int o = 1; o < G; o *= 2) {
      const float u = __shfl_xor_sync(kFull, v, o);
      v = k == 1 ? fmaxf(v, u) : fminf(v, u);
    }
    return v;
  }
  if (k == 2) {  // (a, b): the two largest of the lanes merged so far
    const float u = __shfl_xor_sync(kFull, v, 1);
    float a = fmaxf(v, u), b = fminf(v, u);
#pragma unroll
    for (int o = 2; o < G; o *= 2) {
      const float oa = __shfl_xor_sync(kFull, a, o), ob = __shfl_xor_sync(kFull, b, o);
      merge_top2(a, b, oa, ob);
    }
    return b;
  }
#pragma unroll
  for (int size = 2; size <= G; size *= 2)
#pragma unroll
    for (int stride = size / 2; stride > 0; stride /= 2) {
      const float o = __shfl_xor_sync(kFull, v, stride);
      const bool descending = (lane_g & size) == 0, lower = (lane_g & stride) == 0;
      v = descending == lower ? fmaxf(v, o) : fminf(v, o);
    }
  return __shfl_sync(kFull, v, ((threadIdx.x & 31) & ~(G - 1)) + k - 1);
}

// What differs between bf16 and fp32 logits: a 16-byte vector holds 8 or 4 of them; a key is 32 bits
// (the bf16 value, then the id) or 64 (the fp32 value, then the id); the filler of vectors past E
// and rows past T is the lowest finite value.
template <class In>
struct Logits;
template <>
struct Logits<__nv_bfloat16> {
  using Key = Key32;
  using K = uint32_t;
  static constexpr int kPerVector = 8;
  static constexpr uint32_t kFill = kLowestPair;
  // Logit j of a vector: the low half of word j / 2 for even j, the high half for odd j.
  __device__ static float at(const uint4& r, int j) {
    const uint32_t w = j / 2 == 0 ? r.x : j / 2 == 1 ? r.y : j / 2 == 2 ? r.z : r.w;
    return __uint_as_float(j % 2 == 0 ? w << 16 : w & 0xffff0000u);
  }
};
template <>
struct Logits<float> {
  using Key = Key64;
  using K = uint64_t;
  static constexpr int kPerVector = 4;
  static constexpr uint32_t kFill = 0xff7fffffu;
  __device__ static float at(const uint4& r, int j) {
    return __uint_as_float(j == 0 ? r.x : j == 1 ? r.y : j == 2 ? r.z : r.w);
  }
};

// Entry m S + i of the sorted list (m < M, the lane's own slot; i < S, compile-time): a tree of
// selects on the bits of m, where indexing the list by m would put it in local memory.
template <int M, int S, int L, typename K>
__device__ __forceinline__ K pick_entry(const K (&top)[L], int m, int i) {
  K c[M];
#pragma unroll
  for (int u = 0; u < M; ++u) c[u] = top[u * S + i];
#pragma unroll
  for (int width = M, b = 0; width > 1; width /= 2, ++b)
#pragma unroll
    for (int u = 0; u < width / 2; ++u) c[u] = (m >> b) & 1 ? c[2 * u + 1] : c[2 * u];
  return c[0];
}

// fp32 logits: the sorted top L of a lane's V vectors of 4 (keys 0 for vectors that are not valid,
// bit i of `valid`), two vectors per sorted group of 8 keys. (The non-finite test is the extremes'.)
template <int G, int V, int L>
__device__ __forceinline__ void lane_top_sorted_fp32(const uint4 (&raw)[V], uint32_t valid, int lane_g,
                                                     uint64_t (&top)[L]) {
  static_assert(V % 2 == 0, "two vectors of 4 per group of 8 keys");
#pragma unroll
  for (int g = 0; g < V / 2; ++g) {
    uint64_t key[8];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int i = 2 * g + u;
      const bool ok = (valid >> i) & 1u;
      const uint32_t id0 = Key64::id_of((i * G + lane_g) * 4);  // expert 4 c + m has id id0 - m
#pragma unroll
      for (int m = 0; m < 4; ++m) key[4 * u + m] = ok ? Key64::make_id(Logits<float>::at(raw[i], m), id0 - m) : 0u;
    }
    sort_desc<8>(key);
    if (g == 0) {
#pragma unroll
      for (int j = 0; j < L; ++j) top[j] = key[j];
    } else {
      uint64_t b[L];
#pragma unroll
      for (int j = 0; j < L; ++j) b[j] = key[j];
      merge_top<L>(top, b);
    }
  }
}

// NaN-propagating max and min (PTX max.NaN / min.NaN, sm_80 and later).
__device__ __forceinline__ float fmax_nan(float a, float b) {
  float d;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}
__device__ __forceinline__ float fmin_nan(float a, float b) {
  float d;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
  return d;
}

// How the fp32 filter finds a lane's second value (a value at most its second largest logit).
enum class SecondValue {
  kNone,    // lists of 2: not needed
  kExact,   // the second largest (a max of minima: two more operations an element)
  kHalves,  // the smaller of the even and the odd elements' maxima (no extra operation)
};

// fp32 logits: the lane's largest logit, its second value and whether one is NaN or infinite
// (vectors past E and rows past T hold the lowest finite value).
template <int V, SecondValue kSecond>
__device__ __forceinline__ void lane_extremes_fp32(const uint4 (&raw)[V], float& first, float& second,
                                                   bool& non_finite) {
  float mx, mn;
  if constexpr (kSecond == SecondValue::kHalves) {
    // Two of the lane's logits (or the filler, the lowest finite value), so the smaller is at most
    // its second largest.
    float me = Logits<float>::at(raw[0], 0), mo = Logits<float>::at(raw[0], 1);
    mn = fmin_nan(me, mo);
#pragma unroll
    for (int i = 0; i < V; ++i)
#pragma unroll
      for (int m = i == 0 ? 2 : 0; m < 4; ++m) {
        const float x = Logits<float>::at(raw[i], m);
        if (m % 2 == 0)
          me = fmax_nan(me, x);
        else
          mo = fmax_nan(mo, x);
        mn = fmin_nan(mn, x);
      }
    mx = fmax_nan(me, mo);
    second = fminf(me, mo);
  } else {
    float m2 = -INFINITY;  // below every value
    mx = mn = Logits<float>::at(raw[0], 0);
#pragma unroll
    for (int i = 0; i < V; ++i)
#pragma unroll
      for (int m = i == 0 ? 1 : 0; m < 4; ++m) {
        const float x = Logits<float>::at(raw[i], m);
        if constexpr (kSecond == SecondValue::kExact) m2 = fmaxf(m2, fminf(mx, x));
        mx = fmax_nan(mx, x);
        mn = fmin_nan(mn, x);
      }
    second = kSecond == SecondValue::kExact ? m2 : mx;
  }
  non_finite = !(mx < INFINITY && mn > -INFINITY);
  first = mx;
}

// fp32 logits: bit 4 i + m of the lane's logits at or above tau (vector i, element m).
template <int V>
__device__ __forceinline__ uint32_t candidate_mask_fp32(const uint4 (&raw)[V], float tau) {
  static_assert(V * 4 <= 32, "a lane's logits fit the mask");
  uint32_t mask = 0;
#pragma unroll
  for (int i = 0; i < V; ++i)
#pragma unroll
    for (int m = 0; m < 4; ++m) mask |= (Logits<float>::at(raw[i], m) >= tau ? 1u : 0u) << (4 * i + m);
  return mask;
}

}  // namespace moe::kernels::router
