// mxfp4_to_bf16 (checkpoint/hf_mxfp4.h).
#include "checkpoint/hf_mxfp4.h"

#include <cmath>
#include <cstdint>

#include "moe/float_convert.h"

namespace moe {

namespace {

// E2M1 codes: sign bit 3, magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6.
constexpr float kE2M1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                             -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

}  // namespace

HostTensor mxfp4_to_bf16(const HostTensor& blocks, const HostTensor& scales) {
  const int64_t E = blocks.size(0), rows = blocks.size(1), G = blocks.size(2), cols = G * 32;
  HostTensor out(DType::kBF16, {E, cols, rows});
  auto* o = reinterpret_cast<uint16_t*>(out.mutable_data());
  const uint8_t* b = blocks.data();
  const uint8_t* sc = scales.data();
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const int exponent = sc[(e * rows + r) * G + g] - 127;
        const uint8_t* byte = b + ((e * rows + r) * G + g) * 16;
        for (int i = 0; i < 32; ++i) {
          const int code = i % 2 == 0 ? byte[i / 2] & 0x0F : byte[i / 2] >> 4;
          // Exact in double; to float, exact or (from 2^128 on) inf; to bf16, exact.
          const auto v = static_cast<float>(std::ldexp(static_cast<double>(kE2M1[code]), exponent));
          o[(e * cols + g * 32 + i) * rows + r] = float_to_bf16_bits(v);
        }
      }
  return out;
}

}  // namespace moe
