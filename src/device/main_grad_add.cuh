// Adding a weight gradient into an fp32 main_grad from a GEMM's epilogue: one vector reduction per
// 16 bytes, performed in L2 -- no load of main_grad into the SM, nothing for the thread to wait
// for. Each element gets one addend per product, so the result is main_grad + value rounded once
// to nearest, what a load, an fp32 add and a store give, except that the PTX f32 reduction may
// flush subnormal operands and results to zero (magnitudes below 2^-126).
#pragma once

namespace moe::kernels {

// dst: 16-byte aligned global memory.
__device__ __forceinline__ void add_to_main_grad(float* dst, float4 v) {
  asm volatile("red.global.add.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w)
               : "memory");
}

}  // namespace moe::kernels
