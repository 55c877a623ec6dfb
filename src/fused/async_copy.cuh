// Small pieces shared by the fused kernels' producers: 16-byte cp.async with zero fill and
// shared-memory addresses.
#pragma once

#include <cstdint>

namespace moe::fused {

// bytes: the source size, 16, or 0 to fill the 16 bytes with zeros without reading src.
__device__ __forceinline__ void cp_async_16_bytes(uint32_t dst, const void* src, uint32_t bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  cp_async_16_bytes(dst, src, valid ? 16u : 0u);
}

__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// The first 1024-byte aligned byte of the dynamic shared memory (`raw`: the extern __shared__ array;
// the launch adds 1024 bytes of slack). Pointer arithmetic on `raw`, not an integer round trip, so
// that the compiler keeps the shared address space: the kernels' SharedStorage fields are then read
// with shared loads instead of generic ones.
__device__ __forceinline__ uint8_t* align_smem_1024(uint8_t* raw) {
  return raw + ((1024u - (smem_u32(raw) & 1023u)) & 1023u);
}

}  // namespace moe::fused
