// Rows of a row dtype (bf16, fp16, fp32) on the host: values as doubles <-> the bytes the device
// holds, and rounding to the dtype. Shared by the GPU tests that compare rows bit for bit.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "moe/dtype.h"
#include "moe/float_convert.h"

namespace moe::testing {

using Bytes = std::vector<uint8_t>;

inline int elem_bytes(DType dt) { return dtype_bits(dt) / 8; }

inline double round_to(double v, DType dt) {
  const float f = static_cast<float>(v);
  if (dt == DType::kBF16) return round_to_bf16(f);
  if (dt == DType::kFP16) return round_to_fp16(f);
  return f;
}

// Rounds to fp32 first (what the device computes in), then to the row dtype.
inline Bytes encode(const std::vector<double>& v, DType dt) {
  Bytes b(v.size() * elem_bytes(dt));
  for (size_t i = 0; i < v.size(); ++i) {
    const float f = static_cast<float>(v[i]);
    if (dt == DType::kFP32) {
      std::memcpy(&b[4 * i], &f, 4);
    } else {
      const uint16_t h = dt == DType::kBF16 ? float_to_bf16_bits(f) : float_to_fp16_bits(f);
      std::memcpy(&b[2 * i], &h, 2);
    }
  }
  return b;
}

inline std::vector<double> decode(const Bytes& b, DType dt) {
  const size_t n = b.size() / elem_bytes(dt);
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) {
    if (dt == DType::kFP32) {
      float f;
      std::memcpy(&f, &b[4 * i], 4);
      v[i] = f;
    } else {
      uint16_t h;
      std::memcpy(&h, &b[2 * i], 2);
      v[i] = dt == DType::kBF16 ? bf16_bits_to_float(h) : fp16_bits_to_float(h);
    }
  }
  return v;
}

}  // namespace moe::testing
