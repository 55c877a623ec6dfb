// The sizes the fused row-tile kernels (fused fc1, fused fc2 dgrad) take: one host check shared by
// both, so that their configs refuse the same shapes with the same words.
#pragma once

#include <cstdint>
#include <string>

#include "moe/activation.h"

namespace moe::fused {

// The per-expert tile prefix lives in shared memory: one int per expert.
constexpr int kMaxRowTileExperts = 4096;

// Empty when `kernel` (e.g. "the fused fc1") takes these sizes; otherwise why not, as a sentence
// that starts with `kernel`.
inline std::string row_tile_sizes_unsupported(const char* kernel, int experts, int64_t H, int64_t F,
                                              const ActivationParams& activation) {
  const std::string who(kernel);
  if (experts < 1 || experts > kMaxRowTileExperts)
    return who + " takes 1 to " + std::to_string(kMaxRowTileExperts) + " experts";
  if (H < 8 || H % 8 != 0 || F < 8 || F % 8 != 0) return who + " needs H and F multiples of 8";
  if (H >= (int64_t(1) << 30) || F >= (int64_t(1) << 29)) return who + " needs H < 2^30 and F < 2^29";
  if (is_gated(activation.kind) &&
      !(activation.glu_interleave == 0 || activation.glu_interleave == 1 || activation.glu_interleave % 8 == 0))
    return who + " needs a GLU interleave of 0, 1 or a multiple of 8";
  return "";
}

}  // namespace moe::fused
