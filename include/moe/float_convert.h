// Host-side conversions between fp32 and the narrow floating formats, bit-exact with the device
// conversions (round to nearest even, NaN preserved). Used by the CPU reference, tests, checkpoints.
#pragma once

#include <cstdint>

namespace moe {

// The IEEE-754 bits of an fp32 value, and back.
uint32_t float_bits(float x);
float float_from_bits(uint32_t u);

uint16_t float_to_bf16_bits(float x);
float bf16_bits_to_float(uint16_t b);
uint16_t float_to_fp16_bits(float x);
float fp16_bits_to_float(uint16_t h);

// Value after a round trip through bf16 / fp16 (what storing to that dtype does to it).
inline float round_to_bf16(float x) { return bf16_bits_to_float(float_to_bf16_bits(x)); }
inline float round_to_fp16(float x) { return fp16_bits_to_float(float_to_fp16_bits(x)); }

}  // namespace moe
