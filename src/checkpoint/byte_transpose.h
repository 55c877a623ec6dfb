// Transposes of raw tensors for the checkpoint conversions (x @ W weights, FP8 columnwise copies):
// element bytes move, in cache-sized tiles -- a whole model's experts go through here.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe::detail {

// dst [cols, rows] = src [rows, cols]^T, elements of `el` bytes.
void transpose_bytes(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols, size_t el);

// Whether at [cols, rows] is the transpose of a [rows, cols], elements of `el` bytes (compared bitwise).
bool is_transpose_bytes(const uint8_t* a, const uint8_t* at, int64_t rows, int64_t cols, size_t el);

}  // namespace moe::detail
