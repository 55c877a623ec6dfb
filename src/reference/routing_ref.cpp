#include "reference/routing_ref.h"

#include <algorithm>
#include <cmath>

#include "moe/device_errors.h"
#include "moe/error.h"

namespace moe::ref {

namespace {

// Checks the host-side shape of the routing (sizes of the vectors against T, k, E).
void check_routing(const Routing& r) {
  MOE_CHECK(r.T >= 0, "argument 'routing.T': expected >= 0, got ", r.T);
  MOE_CHECK(r.E > 0, "argument 'routing.E': expected > 0, got ", r.E);
  const size_t slots = static_cast<size_t>(r.T) * static_cast<size_t>(r.slots());
  if (r.form == RoutingForm::kTopK) {
    MOE_CHECK(r.k > 0, "argument 'routing.k': expected > 0 for top-k routing, got ", r.k);
    MOE_CHECK(r.indices.size() == slots, "argument 'routing.indices': expected ", slots, " entries (T*k), got ",
              r.indices.size());
  } else {
    MOE_CHECK(r.map.size() == slots, "argument 'routing.map': expected ", slots, " entries (T*E), got ",
              r.map.size());
  }
  MOE_CHECK(r.probs.size() == slots, "argument 'routing.probs': expected ", slots, " entries, got ",
            r.probs.size());
}

// The expert of slot s of token t, or -1 when the slot is empty or skipped; raises the error bits
// of a skipped entry. Order of the checks: range, repeat, prob -- so a repeat of an expert is a
// repeat whatever happened to its first occurrence (which is what the GPU kernel does too).
int32_t slot_expert(const Routing& r, int64_t t, int s, uint32_t& bits) {
  const int slots = r.slots();
  const size_t i = static_cast<size_t>(t) * slots + s;
  int32_t e = -1;
  if (r.form == RoutingForm::kTopK) {
    e = r.indices[i];
    if (e == -1) return -1;  // an empty slot, not an error
    if (e < 0 || e >= r.E) {
      bits |= kErrExpertOutOfRange;
      return -1;
    }
    for (int s2 = 0; s2 < s; ++s2)
      if (r.indices[static_cast<size_t>(t) * slots + s2] == e) {
        bits |= kErrDuplicateExpert;  // the first occurrence stays, the repeat is skipped
        return -1;
      }
  } else {
    if (r.map[i] == 0) return -1;
    e = s;  // map form: slot e is expert e
  }
  if (!std::isfinite(r.probs[i])) {
    bits |= kErrNonFiniteProb;
    return -1;
  }
  return e;
}

}  // namespace

int64_t DispatchPlan::rows_in_bound(int e) const {
  const int64_t end = std::min(offset[e] + padded[e], R);
  return std::max<int64_t>(0, end - offset[e]);
}

DispatchPlan plan_dispatch(const Routing& routing, const DispatchOptions& opts) {
  check_routing(routing);
  DispatchPlan p;
  p.T = routing.T;
  p.E = routing.E;
  p.slots = routing.slots();
  p.align = opts.align;
  p.R = resolve_row_bound(opts, routing.form, routing.T, routing.k, routing.E);
  const size_t n_slots = static_cast<size_t>(p.T) * p.slots;

  // 1. Validate every slot and count tokens per expert.
  p.slot_expert.assign(n_slots, -1);
  p.count.assign(p.E, 0);
  for (int64_t t = 0; t < p.T; ++t)
    for (int s = 0; s < p.slots; ++s) {
      int32_t e = slot_expert(routing, t, s, p.error_bits);
      p.slot_expert[t * p.slots + s] = e;
      if (e >= 0) ++p.count[e];
    }

  // 2. Padded counts and offsets (offsets are the true values, even past R).
  p.padded.assign(p.E, 0);
  p.offset.assign(p.E, 0);
  int64_t total = 0;
  for (int e = 0; e < p.E; ++e) {
    const int64_t c = p.count[e];
    if (opts.pre_padded || opts.align == 0) {
      p.padded[e] = c;
      if (opts.pre_padded && opts.align > 0 && c % opts.align != 0) p.error_bits |= kErrMisalignedPrepadded;
    } else {
      p.padded[e] = (c + opts.align - 1) / opts.align * opts.align;
    }
    p.offset[e] = total;
    total += p.padded[e];
  }
  if (total > p.R) p.error_bits |= kErrRowOverflow;

  // 3. Destination rows: expert-major, stable token order inside each expert.
  p.slot_row.assign(n_slots, -1);
  p.slot_prob.assign(n_slots, 0.0);
  p.row_token.assign(static_cast<size_t>(p.R), -1);
  p.row_slot.assign(static_cast<size_t>(p.R), -1);
  std::vector<int64_t> next(p.offset);
  for (int64_t t = 0; t < p.T; ++t)
    for (int s = 0; s < p.slots; ++s) {
      const size_t i = static_cast<size_t>(t) * p.slots + s;
      const int32_t e = p.slot_expert[i];
      if (e < 0) continue;
      p.slot_prob[i] = routing.probs[i];
      const int64_t row = next[e]++;
      if (row >= p.R) continue;  // overflow: not written (the flag is raised above)
      p.slot_row[i] = row;
      p.row_token[row] = t;
      p.row_slot[row] = static_cast<int64_t>(i);
    }
  return p;
}

}  // namespace moe::ref
