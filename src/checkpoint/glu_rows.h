// fc1's gate and linear rows (GLU interleave s, include/moe/activation.h) to and from the separate gate
// and up rows a checkpoint stores: gate row j at gate + j * stride, up row j at up + j * stride, each
// `row` bytes. The same for the rows of 128x128 block scales (F / 128 rows, interleave s / 128: a
// block row moves with its 128 rows when F and s are multiples of 128) and for biases (one element a row).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "moe/activation.h"

namespace moe::detail {

inline void place_glu_rows(uint8_t* fc1, const uint8_t* gate, const uint8_t* up, size_t stride, int64_t F, int s,
                           size_t row) {
  for (int64_t j = 0; j < F; ++j) {
    std::memcpy(fc1 + gate_column(j, F, s) * row, gate + j * stride, row);
    std::memcpy(fc1 + linear_column(j, F, s) * row, up + j * stride, row);
  }
}

inline void take_glu_rows(const uint8_t* fc1, uint8_t* gate, uint8_t* up, size_t stride, int64_t F, int s,
                          size_t row) {
  for (int64_t j = 0; j < F; ++j) {
    std::memcpy(gate + j * stride, fc1 + gate_column(j, F, s) * row, row);
    std::memcpy(up + j * stride, fc1 + linear_column(j, F, s) * row, row);
  }
}

}  // namespace moe::detail
