// CPU reference: routing held on the host, and the dispatch plan derived from it (SPEC 1-2, 9).
// Plain, obviously-correct C++: this is the executable spec the GPU kernels are tested against.
#pragma once

#include <cstdint>
#include <vector>

#include "moe/routing.h"

namespace moe::ref {

// Routing on the host, in either form.
struct Routing {
  RoutingForm form = RoutingForm::kTopK;
  int64_t T = 0;
  int E = 0;
  int k = 0;                     // top-k form: slots per token
  std::vector<int32_t> indices;  // top-k: [T * k], -1 = empty slot
  std::vector<uint8_t> map;      // map form: [T * E], nonzero = routed
  std::vector<double> probs;     // [T * k] or [T * E]; fp32-representable (the device takes fp32)

  int slots() const { return slots_per_token(form, k, E); }
};

// Where every routing slot goes. Bad entries (expert out of range, a repeat of an expert in a
// top-k row, a non-finite prob) are skipped -- slot_row = -1 -- and flagged in error_bits; rows
// that would land at or past R are not written (slot_row = -1) and flag kErrRowOverflow.
struct DispatchPlan {
  int64_t T = 0;
  int E = 0;
  int slots = 0;  // per token
  int64_t R = 0;  // static row bound of the permuted buffer
  int align = 0;
  std::vector<int64_t> count;      // [E] tokens routed to e
  std::vector<int64_t> padded;     // [E] count rounded up to A (== count when pre-padded or A = 0)
  std::vector<int64_t> offset;     // [E] exclusive prefix sum of padded (may exceed R on overflow)
  std::vector<int32_t> slot_expert;  // [T * slots] expert of each valid slot, -1 if none/skipped
  std::vector<int64_t> slot_row;     // [T * slots] destination row dst(t, e), -1 if not written
  std::vector<double> slot_prob;      // [T * slots] prob of each slot (0 where slot_expert = -1)
  std::vector<int64_t> row_token;    // [R] source token of each row, -1 for pad / unused rows
  std::vector<int64_t> row_slot;     // [R] slot index t * slots + s of each row, -1 for pad / unused
  uint32_t error_bits = 0;

  // Rows of expert e actually inside [0, R): the group sizes a GEMM over the buffer must use.
  int64_t rows_in_bound(int e) const;
};

DispatchPlan plan_dispatch(const Routing& routing, const DispatchOptions& opts);

}  // namespace moe::ref
