// CPU reference: routing held on the host, and the dispatch plan derived from it
// (docs/semantics.md, Routing input, Dispatch and Errors). Plain, obviously-correct C++: this is
// the executable spec the GPU kernels are tested against.
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

// Where every routing slot goes. Bad entries are skipped (slot_expert = slot_row = -1) and flagged
// in error_bits, checked in this order: an expert id outside [0, E) other than -1
// (kErrExpertOutOfRange); an in-range id equal to the id of an earlier slot of the same top-k row
// (kErrDuplicateExpert: the first occurrence stays, the repeat is skipped, whatever became of the
// first); a non-finite prob of a routed entry (kErrNonFiniteProb). -1 in top-k form is an empty
// slot, not an error; probs of empty slots and off-map entries are not looked at.
// Map form: slot e of token t is expert e.
// Padding: padded = ceil(count / A) * A; pre-padded input keeps padded = count and flags
// kErrMisalignedPrepadded when a count is not a multiple of A (A > 0).
// Overflow: when sum(padded) > R, kErrRowOverflow is raised and rows at or past R are not
// written: such a slot keeps slot_expert and slot_prob but has slot_row = -1. count, padded and
// offset keep their true values (offset may exceed R); rows_in_bound(e) clips to [0, R).
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
