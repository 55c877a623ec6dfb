// One element of a floating tensor's bytes read or written by dtype (bf16, fp16, fp32, fp64), shared by
// the checkpoint sources that convert between dtypes.
#pragma once

#include <cstdint>
#include <cstring>

#include "moe/dtype.h"
#include "moe/error.h"
#include "moe/float_convert.h"

namespace moe::detail {

inline double load_element(DType t, const uint8_t* p, int64_t i) {
  switch (t) {
    case DType::kBF16: { uint16_t b; std::memcpy(&b, p + 2 * i, 2); return bf16_bits_to_float(b); }
    case DType::kFP16: { uint16_t b; std::memcpy(&b, p + 2 * i, 2); return fp16_bits_to_float(b); }
    case DType::kFP32: { float f; std::memcpy(&f, p + 4 * i, 4); return f; }
    case DType::kFP64: { double d; std::memcpy(&d, p + 8 * i, 8); return d; }
    default: throw_error("checkpoint: dtype ", dtype_name(t), " is not a weight dtype");
  }
}

// bf16 / fp16 round to nearest even (from fp32: a value of fp64 rounds twice, exact for every value a
// narrower dtype holds).
inline void store_element(DType t, uint8_t* p, int64_t i, double v) {
  switch (t) {
    case DType::kBF16: { uint16_t b = float_to_bf16_bits(static_cast<float>(v)); std::memcpy(p + 2 * i, &b, 2); return; }
    case DType::kFP16: { uint16_t b = float_to_fp16_bits(static_cast<float>(v)); std::memcpy(p + 2 * i, &b, 2); return; }
    case DType::kFP32: { float f = static_cast<float>(v); std::memcpy(p + 4 * i, &f, 4); return; }
    case DType::kFP64: std::memcpy(p + 8 * i, &v, 8); return;
    default: throw_error("checkpoint: dtype ", dtype_name(t), " is not a weight dtype");
  }
}

}  // namespace moe::detail
