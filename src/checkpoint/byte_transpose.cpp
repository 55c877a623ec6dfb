// transpose_bytes / is_transpose_bytes (checkpoint/byte_transpose.h).
#include "checkpoint/byte_transpose.h"

#include <algorithm>
#include <cstring>

namespace moe::detail {

namespace {

// Tiles of kTile x kTile elements: a tile's source rows and destination rows stay in cache while it moves.
constexpr int64_t kTile = 64;

// One element of N bytes (a fixed-size memcpy the compiler turns into one load and store).
template <size_t N>
struct Elem {
  unsigned char b[N];
};

template <size_t N>
void transpose_tiled(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) std::memcpy(dst + (c * rows + r) * N, src + (r * cols + c) * N, N);
    }
}

// 8 x 8 bytes at src (row stride src_stride) transposed into dst (row stride dst_stride): the rows as
// eight 64-bit words, transposed by swapping 1-, 2- and 4-byte blocks between them (SWAR).
void transpose8x8(const uint8_t* src, int64_t src_stride, uint8_t* dst, int64_t dst_stride) {
  uint64_t a[8];
  for (int i = 0; i < 8; ++i) std::memcpy(&a[i], src + i * src_stride, 8);  // byte j of a[i]: element (i, j)
  for (int i = 0; i < 8; i += 2) {
    const uint64_t t = ((a[i] >> 8) ^ a[i + 1]) & 0x00FF00FF00FF00FFull;
    a[i + 1] ^= t;
    a[i] ^= t << 8;
  }
  for (int i : {0, 1, 4, 5}) {
    const uint64_t t = ((a[i] >> 16) ^ a[i + 2]) & 0x0000FFFF0000FFFFull;
    a[i + 2] ^= t;
    a[i] ^= t << 16;
  }
  for (int i = 0; i < 4; ++i) {
    const uint64_t t = ((a[i] >> 32) ^ a[i + 4]) & 0x00000000FFFFFFFFull;
    a[i + 4] ^= t;
    a[i] ^= t << 32;
  }
  for (int j = 0; j < 8; ++j) std::memcpy(dst + j * dst_stride, &a[j], 8);  // byte i of a[j]: element (i, j)
}

// One-byte elements (FP8 codes): whole 8 x 8 blocks by transpose8x8, the edges element by element.
void transpose_u8(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols) {
  const int64_t rows8 = rows / 8 * 8, cols8 = cols / 8 * 8;
  for (int64_t r0 = 0; r0 < rows8; r0 += kTile)
    for (int64_t c0 = 0; c0 < cols8; c0 += kTile) {
      const int64_t r1 = std::min(rows8, r0 + kTile), c1 = std::min(cols8, c0 + kTile);
      for (int64_t r = r0; r < r1; r += 8)
        for (int64_t c = c0; c < c1; c += 8) transpose8x8(src + r * cols + c, cols, dst + c * rows + r, rows);
    }
  for (int64_t r = 0; r < rows; ++r)  // the last rows % 8 rows and cols % 8 columns
    for (int64_t c = r < rows8 ? cols8 : 0; c < cols; ++c) dst[c * rows + r] = src[r * cols + c];
}

template <size_t N>
bool is_transpose_tiled(const uint8_t* a, const uint8_t* at, int64_t rows, int64_t cols) {
  for (int64_t r0 = 0; r0 < rows; r0 += kTile)
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      bool same = true;
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = c0; c < c1; ++c) same &= std::memcmp(at + (c * rows + r) * N, a + (r * cols + c) * N, N) == 0;
      if (!same) return false;
    }
  return true;
}

}  // namespace

void transpose_bytes(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols, size_t el) {
  switch (el) {
    case 1: return transpose_u8(src, dst, rows, cols);
    case 2: return transpose_tiled<2>(src, dst, rows, cols);
    case 4: return transpose_tiled<4>(src, dst, rows, cols);
    case 8: return transpose_tiled<8>(src, dst, rows, cols);
    default:
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) std::memcpy(dst + (c * rows + r) * el, src + (r * cols + c) * el, el);
  }
}

bool is_transpose_bytes(const uint8_t* a, const uint8_t* at, int64_t rows, int64_t cols, size_t el) {
  switch (el) {
    case 1: return is_transpose_tiled<1>(a, at, rows, cols);
    case 2: return is_transpose_tiled<2>(a, at, rows, cols);
    case 4: return is_transpose_tiled<4>(a, at, rows, cols);
    case 8: return is_transpose_tiled<8>(a, at, rows, cols);
    default:
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          if (std::memcmp(at + (c * rows + r) * el, a + (r * cols + c) * el, el) != 0) return false;
      return true;
  }
}

}  // namespace moe::detail
