// Element types the library understands. Sub-byte and scale types are here from the start so that
// FP8/MXFP8/NVFP4 rows and scales can travel through the same tensor views later
// (docs/semantics.md, Quantized formats).
#pragma once

#include <cstdint>
#include <string>

namespace moe {

enum class DType : uint8_t {
  kBF16,
  kFP16,
  kFP32,
  kFP64,
  kInt32,
  kInt64,
  kUInt8,
  kBool,
  kFP8E4M3,
  kFP8E5M2,
  kE8M0,     // MX shared exponent (one byte, bias 127)
  kFP4E2M1,  // packed: two values per byte, low nibble first
};

// Bits per element (4 for packed FP4).
int dtype_bits(DType t);
// Bytes for `numel` elements (rounded up for packed types).
int64_t dtype_bytes(DType t, int64_t numel);
// Short lower-case name, e.g. "bf16", "fp8_e4m3".
const char* dtype_name(DType t);
// Parses a dtype_name(); throws moe::Error naming `what` on an unknown name.
DType dtype_from_name(const std::string& name, const char* what = "dtype");

}  // namespace moe
