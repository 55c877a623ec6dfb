// SlotReader: how every kernel that plans from a routing reads its slots, a warp at a time -- which
// entries are empty, which are skipped as bad input (and why), and the expert of the rest. One
// definition for the single-GPU plan (dispatch_plan.cu) and the expert-parallel pack
// (src/ep/ep_destinations.cu), so both skip exactly the same entries and raise the same bits
// (docs/semantics.md, Errors).
#pragma once

#include <cstdint>

#include "device/vec16.cuh"
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

  // A warp reads 32 consecutive slots first .. first + 31 at once (a step), lane l holding slot
  // first + l. The loads come first, for several steps before any is decided, so a warp waits for
  // memory once per batch of steps, not once per load: load_step (top-k form: the indices and
  // probs; map form: the map bytes), then load_step_probs (map form: the probs of the entries on
  // the map, which are few). Then decide_step gives the slot's expert, or -1 when the slot is
  // empty, skipped or past the end; a skipped entry ORs its reason into `bits`, checked in the
  // order of the CPU reference (routing_ref.h): an id outside [0, E), a repeat of an earlier slot
  // of the same top-k row (the first occurrence stays), a non-finite prob. Repeats are found among
  // the step's lanes by one __match_any_sync; only the slots of a row that began in an earlier step
  // are read again. `peers`: the lanes of the step that kept the same expert. Every lane of the
  // warp must call decide_step.
  struct StepLoad {
    int32_t id;  // top-k form: the index as stored (-1 past the end); map form: the map byte (0 past the end)
    float prob;
  };
  __device__ __forceinline__ StepLoad load_step(int32_t first, int lane) const {
    const int32_t i = first + lane;
    StepLoad l{form == RoutingForm::kTopK ? -1 : 0, 0.0f};
    if (i < n) {
      if (form == RoutingForm::kTopK) {
        l.id = __ldg(indices + i);
        l.prob = __ldg(probs + i);
      } else {
        l.id = __ldg(map + i);
      }
    }
    return l;
  }
  __device__ __forceinline__ void load_step_probs(int32_t first, int lane, StepLoad& l) const {
    if (form != RoutingForm::kTopK && l.id != 0) l.prob = __ldg(probs + first + lane);  // l.id != 0: i < n
  }
  __device__ __forceinline__ int decide_step(int32_t first, int lane, const StepLoad& l, uint32_t& bits,
                                             unsigned& peers) const {
    const int32_t i = first + lane;
    const bool top_k = form == RoutingForm::kTopK;
    // The expert the slot names (map form: slot e of a token is expert e), before the checks.
    const int32_t named = top_k ? l.id : (l.id != 0 ? i % slots : -1);
    const bool in_range = named >= 0 && (!top_k || named < E);
    if (top_k && named != -1 && !in_range) bits |= kErrExpertOutOfRange;
    // Every lane takes part (no early exit above): lanes without an expert meet at -1.
    const unsigned same = __match_any_sync(kFullMask, in_range ? named : -1);
    bool keep = in_range;
    if (top_k && in_range) {
      // A repeat of an earlier slot of the row: among this step's lanes from the row's first one,
      // then (a row begun in an earlier step) the row's slots before this step.
      const int32_t row_first = i - i % slots;
      const int first_lane = row_first > first ? row_first - first : 0;
      bool repeat = (same & lanemask_lt() & ~((1u << first_lane) - 1u)) != 0;
      for (int32_t j = row_first; !repeat && j < first; ++j) repeat = __ldg(indices + j) == named;
      if (repeat) {
        bits |= kErrDuplicateExpert;
        keep = false;
      }
    }
    if (keep && !isfinite(l.prob)) {
      bits |= kErrNonFiniteProb;
      keep = false;
    }
    peers = same & __ballot_sync(kFullMask, keep);
    return keep ? named : -1;
  }
};

}  // namespace moe::kernels
