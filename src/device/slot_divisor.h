// Division of a non-negative slot number by the slots per token (k) as a multiply and a shift. The
// dispatch map holds slot = token * k + j; a gathering producer needs the token of every row it copies,
// and a runtime integer division costs about twenty instructions on the GPU.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_SLOT_DIVISOR_FN __host__ __device__ __forceinline__
#else
#define MOE_SLOT_DIVISOR_FN inline
#endif

namespace moe {

struct SlotDivisor {
  uint64_t magic = uint64_t{1} << 32;
  int shift = 32;

  // With 2^s >= d and m = ceil(2^(32+s) / d) = (2^(32+s) + e) / d, 0 <= e < d: for 0 <= n < 2^31,
  // n m / 2^(32+s) = n / d + n e / (d 2^(32+s)), and the second term is below 2^31 / 2^(32+s) <= 1 / (2d),
  // too little to reach the next multiple of 1 / d, so the floor is n / d. m < 2^33, so n m < 2^64.
  static SlotDivisor make(int d) {
    const uint64_t dd = static_cast<uint64_t>(d < 1 ? 1 : d);
    int s = 0;
    while ((uint64_t{1} << s) < dd) ++s;
    SlotDivisor v;
    v.magic = ((uint64_t{1} << (32 + s)) + dd - 1) / dd;
    v.shift = 32 + s;
    return v;
  }

  // n / d for 0 <= n < 2^31.
  MOE_SLOT_DIVISOR_FN int divide(int n) const {
    return static_cast<int>((static_cast<uint64_t>(static_cast<uint32_t>(n)) * magic) >> shift);
  }
};

}  // namespace moe

#undef MOE_SLOT_DIVISOR_FN
