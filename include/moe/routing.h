// Routing input forms and dispatch options (docs/semantics.md, Routing input and Dispatch).
#pragma once

#include <cstdint>

#include "moe/tensor.h"

namespace moe {

enum class RoutingForm : uint8_t {
  kTopK,  // indices int32 [T, k] (-1 = empty slot) + probs fp32 [T, k]
  kMap,   // routing_map bool/uint8 [T, E] + probs fp32 [T, E] (zero off the map)
};

// Every routing entry is a "slot": top-k form has k slots per token (slot s -> indices[t, s]),
// map form has E slots per token (slot e -> expert e when map[t, e] is set). Per-slot outputs such
// as dprobs have the routing's own shape: [T, k] or [T, E].
inline int slots_per_token(RoutingForm form, int k, int E) { return form == RoutingForm::kTopK ? k : E; }

// Routing on the device (or host for the reference), as views.
struct RoutingView {
  RoutingForm form = RoutingForm::kTopK;
  TensorView indices;  // top-k form: int32 [T, k]
  TensorView map;      // map form: bool or uint8 [T, E]
  TensorView probs;    // fp32 [T, k] or [T, E]
};

struct DispatchOptions {
  int align = 0;            // A in {0, 16, 32, 64, 128, 256}: rows per expert padded to a multiple
  bool pre_padded = false;  // counts are already multiples of A: never pad a second time
  int64_t row_bound = -1;   // R, a static bound on rows; -1 = default_row_bound (top-k form only)
};

bool is_valid_alignment(int align);
// Dropless bound T*k + E*(A-1) (T*k when A is 0 or the input is pre-padded).
int64_t default_row_bound(int64_t T, int k, int E, int align, bool pre_padded);
// R for these options: row_bound if given, else the default (an error for map form: the caller
// must give the bound there, since a token may go to any number of experts).
int64_t resolve_row_bound(const DispatchOptions& opts, RoutingForm form, int64_t T, int k, int E);
// Throws moe::Error naming the bad option.
void validate_dispatch_options(const DispatchOptions& opts);

}  // namespace moe
