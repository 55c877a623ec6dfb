// The device conversions of the quantize / dequantize kernels on every input: the E4M3 encoder
// the kernels use (the hardware conversion with the NaN rewrite, see kHardwareE4M3 in
// src/quant/quant_device.cuh) against the software conversion that implements the rule on every
// one of the 2^32 fp32 bit patterns, and the branch-free decoders against the software ones on
// every code. A mismatch reports the first input and the count.
#include <gtest/gtest.h>

#include <cstdint>

#include "quant/quant_device.cuh"
#include "support/gpu.h"

namespace moe {
namespace {

using ::moe::testing::DeviceBuffer;

// result[0]: mismatches; result[1]: the smallest mismatching input (bits), 0xFFFFFFFF if none.
__global__ void e4m3_encode_all(unsigned int* result) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < (uint64_t(1) << 32);
       i += stride) {
    // Four inputs around i (the packing order is checked too); factor 1 makes the product exact.
    const uint32_t u = static_cast<uint32_t>(i);
    const float x0 = __uint_as_float(u), x1 = __uint_as_float(u ^ 0x80000000u), x2 = __uint_as_float(u ^ 0x1u),
                x3 = __uint_as_float(u ^ 0x00100000u);
    const uint32_t got = quant::encode_e4m3x4(x0, x1, x2, x3, 1.0f);
    const uint32_t want = static_cast<uint32_t>(quant::e4m3_from_float(x0)) |
                          (static_cast<uint32_t>(quant::e4m3_from_float(x1)) << 8) |
                          (static_cast<uint32_t>(quant::e4m3_from_float(x2)) << 16) |
                          (static_cast<uint32_t>(quant::e4m3_from_float(x3)) << 24);
    if (got != want) {
      atomicAdd(result, 1u);
      atomicMin(result + 1, u);
    }
  }
}

__global__ void decode_all(unsigned int* result) {
  const uint32_t c = threadIdx.x;  // 256 threads: every E4M3 code, the low 16 of them as E2M1 too
  const float a = quant::e4m3_decode(c), b = quant::e4m3_to_float(static_cast<uint8_t>(c));
  const bool nan = a != a && b != b;
  if (!nan && __float_as_uint(a) != __float_as_uint(b)) atomicAdd(result, 1u);
  if (c < 16) {
    const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float want = (c & 8u) ? -mag[c & 7u] : mag[c & 7u];
    if (__float_as_uint(quant::e2m1_decode(c)) != __float_as_uint(want)) atomicAdd(result + 1, 1u);
  }
}

TEST(QuantConvert, HardwareE4M3MatchesSoftware) {
  MOE_REQUIRE_GPU();
  DeviceBuffer<unsigned int> result(std::vector<unsigned int>{0u, 0xFFFFFFFFu});
  e4m3_encode_all<<<1024, 256>>>(result.get());
  MOE_CUDA_CHECK(cudaGetLastError());
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<unsigned int> r = result.download();
  EXPECT_EQ(r[0], 0u) << "E4M3 encodings differ; the smallest differing input is fp32 bits 0x" << std::hex << r[1]
                      << " (set kHardwareE4M3 = false in src/quant/quant_device.cuh to use the software path)";
}

TEST(QuantConvert, DecodersMatchSoftware) {
  MOE_REQUIRE_GPU();
  DeviceBuffer<unsigned int> result(std::vector<unsigned int>{0u, 0u});
  decode_all<<<1, 256>>>(result.get());
  MOE_CUDA_CHECK(cudaGetLastError());
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  const std::vector<unsigned int> r = result.download();
  EXPECT_EQ(r[0], 0u) << "E4M3 decode mismatches";
  EXPECT_EQ(r[1], 0u) << "E2M1 decode mismatches";
}

}  // namespace
}  // namespace moe
