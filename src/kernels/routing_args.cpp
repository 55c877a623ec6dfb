// Argument checks of a device routing and of merging probs (see routing_args.h).
#include "kernels/routing_args.h"

#include "moe/error.h"
#include "moe/tensor.h"

namespace moe::kernels {

int64_t check_routing_args(const RoutingView& routing, const uint32_t* error_word, RoutingForm form, int slots,
                           int64_t max_tokens) {
  MOE_CHECK(routing.form == form, "argument 'routing.form': expected the dispatcher's form (",
            form == RoutingForm::kTopK ? "top-k" : "map", ")");
  MOE_CHECK(error_word != nullptr, "argument 'error_word': expected a device pointer, got null");
  MOE_CHECK(routing.probs.ndim == 2, "argument 'routing.probs': expected shape [T, ", slots, "], got ",
            routing.probs.shape_string());
  const int64_t T = routing.probs.shape[0];
  MOE_CHECK(T <= max_tokens, "argument 'routing.probs': T = ", T, " exceeds max_tokens = ", max_tokens);
  // Routing is read element by element: 4-byte (1-byte map) alignment is enough.
  check_device_tensor(routing.probs, "routing.probs", DType::kFP32, {T, slots}, 4);
  if (form == RoutingForm::kTopK) {
    check_device_tensor(routing.indices, "routing.indices", DType::kInt32, {T, slots}, 4);
  } else {
    const DType md = routing.map.dtype;
    check_device_tensor(routing.map, "routing.map", md == DType::kBool ? DType::kBool : DType::kUInt8, {T, slots},
                        1);
  }
  return T;
}

void merge_weights(MergeProbs merge, const TensorView* probs, const float* planned_by_row, int64_t T, int slots,
                   const char* call, const float** by_row, const float** by_slot) {
  *by_row = nullptr;
  *by_slot = nullptr;
  MOE_CHECK(merge == MergeProbs::kNone || merge == MergeProbs::kPlanned || merge == MergeProbs::kGiven,
            "argument 'merge' of ", call, ": unknown value ", int(merge));
  if (merge == MergeProbs::kPlanned) *by_row = planned_by_row;
  if (merge == MergeProbs::kGiven) {
    MOE_CHECK(probs != nullptr, "argument 'probs' of ", call,
              ": expected the merging probs fp32 [T, slots] with MergeProbs::kGiven, got none");
    check_device_tensor(*probs, "probs", DType::kFP32, {T, slots}, 4);
    *by_slot = probs->ptr<float>();
  }
}

}  // namespace moe::kernels
