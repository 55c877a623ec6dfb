#include "reference/dispatch_ref.h"

#include <algorithm>

#include "moe/error.h"

namespace moe::ref {

void permute(const DispatchPlan& plan, const double* x, int64_t H, double* x_perm, double* probs_perm) {
  for (int64_t r = 0; r < plan.R; ++r) {
    const int64_t t = plan.row_token[r];
    double* dst = x_perm + r * H;
    if (t < 0) {
      std::fill(dst, dst + H, 0.0);  // pad row or a row past sum(padded)
      if (probs_perm) probs_perm[r] = 0.0;
      continue;
    }
    std::copy(x + t * H, x + (t + 1) * H, dst);
    if (probs_perm) probs_perm[r] = plan.slot_prob[plan.row_slot[r]];
  }
}

void permute_backward(const DispatchPlan& plan, const double* d_x_perm, const double* d_probs_perm, int64_t H,
                      double* dx, double* dprobs) {
  for (int64_t t = 0; t < plan.T; ++t) {
    double* out = dx + t * H;
    std::fill(out, out + H, 0.0);
    for (int s = 0; s < plan.slots; ++s) {
      const size_t i = static_cast<size_t>(t) * plan.slots + s;
      const int64_t row = plan.slot_row[i];
      if (dprobs) dprobs[i] = (row >= 0 && d_probs_perm) ? d_probs_perm[row] : 0.0;
      if (row < 0) continue;
      for (int64_t h = 0; h < H; ++h) out[h] += d_x_perm[row * H + h];
    }
  }
}

void unpermute(const DispatchPlan& plan, const double* Y, int64_t H, bool merge_probs, double* y) {
  for (int64_t t = 0; t < plan.T; ++t) {
    double* out = y + t * H;
    std::fill(out, out + H, 0.0);
    for (int s = 0; s < plan.slots; ++s) {
      const size_t i = static_cast<size_t>(t) * plan.slots + s;
      const int64_t row = plan.slot_row[i];
      if (row < 0) continue;
      const double w = merge_probs ? plan.slot_prob[i] : 1.0;
      for (int64_t h = 0; h < H; ++h) out[h] += w * Y[row * H + h];
    }
  }
}

void unpermute_backward(const DispatchPlan& plan, const double* Y, const double* dy, int64_t H, bool merge_probs,
                        double* dY, double* dprobs) {
  std::fill(dY, dY + plan.R * H, 0.0);
  if (dprobs) std::fill(dprobs, dprobs + plan.T * plan.slots, 0.0);
  for (int64_t t = 0; t < plan.T; ++t)
    for (int s = 0; s < plan.slots; ++s) {
      const size_t i = static_cast<size_t>(t) * plan.slots + s;
      const int64_t row = plan.slot_row[i];
      if (row < 0) continue;
      const double w = merge_probs ? plan.slot_prob[i] : 1.0;
      for (int64_t h = 0; h < H; ++h) dY[row * H + h] = w * dy[t * H + h];
      // Without merged probs y does not depend on them: their gradient stays zero.
      if (!dprobs || !merge_probs) continue;
      double dot = 0.0;
      for (int64_t h = 0; h < H; ++h) dot += Y[row * H + h] * dy[t * H + h];
      dprobs[i] = dot;
    }
}

ChunkWindows chunk_windows(const DispatchPlan& plan, int chunks) {
  MOE_CHECK(chunks >= 1, "argument 'chunks': expected >= 1, got ", chunks);
  const int E = plan.E, S = plan.slots;
  ChunkWindows w;
  w.Tc = std::max<int64_t>(1, (plan.T + chunks - 1) / chunks);
  w.row_begin.assign(chunks, std::vector<int64_t>(E, 0));
  w.offsets.assign(chunks, std::vector<int64_t>(E + 1, 0));
  w.local_row.assign(static_cast<size_t>(plan.T * S), -1);
  for (int c = 0; c < chunks; ++c) {
    const int64_t first = c * w.Tc, last = (c + 1) * w.Tc;  // tokens [first, last)
    for (int e = 0; e < E; ++e) {
      // e's real rows inside [0, R), in row order; the chunk's are those of its tokens.
      const int64_t lo = std::min(plan.offset[e], plan.R), hi = std::min(plan.offset[e] + plan.count[e], plan.R);
      int64_t begin = hi, n = 0;
      for (int64_t r = lo; r < hi; ++r) {
        const int64_t t = plan.row_token[r];
        if (t >= first && begin == hi) begin = r;
        if (t >= first && t < last) {
          MOE_CHECK(r == begin + n, "chunk_windows: the rows of expert ", e, " for chunk ", c, " are not contiguous");
          ++n;
        }
      }
      w.row_begin[c][e] = begin;
      w.offsets[c][e + 1] = w.offsets[c][e] + n;
    }
  }
  for (int64_t i = 0; i < plan.T * S; ++i) {
    const int64_t r = plan.slot_row[i], e = plan.slot_expert[i];
    if (r < 0 || e < 0) continue;
    const int64_t c = (i / S) / w.Tc;
    w.local_row[i] = r - w.row_begin[c][e] + w.offsets[c][e];
  }
  return w;
}

}  // namespace moe::ref
