// SlotReader: how every kernel that plans from a routing reads one slot of it -- which entries are
// empty, which are skipped as bad input (and why), and the expert of the rest. One definition for
// the single-GPU plan (dispatch_plan.cu) and the expert-parallel pack (src/ep/ep_destinations.cu),
// so both skip exactly the same entries and raise the same bits (docs/semantics.md, Errors).
#pragma once

#include <cstdint>

#include "moe/device_errors.h"
#include "moe/routing.h"

namespace moe::kernels {

struct SlotReader {
  RoutingForm form;
  int32_t n;  // T * slots
  int slots;
  int E;
  const int32_t* indices;
  const uint8_t* map;
  const float* probs;

  // The expert of flat slot i, or -1 when the slot is empty, skipped or past the end. A skipped
  // entry ORs its reason into `bits`; checks in the order of the CPU reference (routing_ref.h).
  __device__ __forceinline__ int expert(int32_t i, uint32_t& bits, float& prob) const {
    prob = 0.0f;
    if (i >= n) return -1;
    int e;
    if (form == RoutingForm::kTopK) {
      e = __ldg(indices + i);
      if (e == -1) return -1;  // empty slot
      if (e < 0 || e >= E) {
        bits |= kErrExpertOutOfRange;
        return -1;
      }
      // A repeat of an earlier slot of the row is skipped: the first occurrence stays.
      for (int32_t j = i - i % slots; j < i; ++j)
        if (__ldg(indices + j) == e) {
          bits |= kErrDuplicateExpert;
          return -1;
        }
    } else {
      if (__ldg(map + i) == 0) return -1;
      e = i % slots;  // map form: slot e is expert e
    }
    prob = __ldg(probs + i);
    if (!isfinite(prob)) {
      bits |= kErrNonFiniteProb;
      return -1;
    }
    return e;
  }
};

}  // namespace moe::kernels
