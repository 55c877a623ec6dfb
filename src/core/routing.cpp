#include "moe/routing.h"

#include <cstdint>
#include <limits>

#include "moe/error.h"

namespace moe {

bool is_valid_alignment(int align) {
  return align == 0 || align == 16 || align == 32 || align == 64 || align == 128 || align == 256;
}

int64_t default_row_bound(int64_t T, int k, int E, int align, bool pre_padded) {
  // Row indices are int32 on the device. Checked by division, so that T * k cannot wrap into a small
  // bound that every later check would pass.
  constexpr int64_t kMaxRows = std::numeric_limits<int32_t>::max();
  MOE_CHECK(k >= 1, "argument 'topk': expected >= 1, got ", k);
  MOE_CHECK(T >= 0 && T <= kMaxRows / k, "argument 'max_tokens': expected 0..", kMaxRows / k, " (T_max x ", k,
            " slots must fit the int32 row indices), got ", T);
  int64_t pad = (align == 0 || pre_padded) ? 0 : static_cast<int64_t>(E) * (align - 1);
  return T * k + pad;
}

void validate_dispatch_options(const DispatchOptions& opts) {
  MOE_CHECK(is_valid_alignment(opts.align), "argument 'align': expected one of 0, 16, 32, 64, 128, 256, got ",
            opts.align);
  MOE_CHECK(opts.row_bound >= -1, "argument 'row_bound': expected -1 (default) or >= 0, got ", opts.row_bound);
}

int64_t resolve_row_bound(const DispatchOptions& opts, RoutingForm form, int64_t T, int k, int E) {
  validate_dispatch_options(opts);
  if (opts.row_bound >= 0) return opts.row_bound;
  MOE_CHECK(form == RoutingForm::kTopK,
            "argument 'row_bound': map-form routing needs an explicit row bound R (a token may go to any "
            "number of experts)");
  return default_row_bound(T, k, E, opts.align, opts.pre_padded);
}

}  // namespace moe
