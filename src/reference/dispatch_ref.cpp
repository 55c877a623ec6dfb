#include "reference/dispatch_ref.h"

#include <algorithm>

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

}  // namespace moe::ref
