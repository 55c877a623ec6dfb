// Destination rank of every routing slot of one source rank, with the validation of the
// single-GPU plan (docs/semantics.md, Errors; src/kernels/dispatch_plan.cu SlotReader): an expert id
// outside [0, E) other than -1, a repeat of an earlier expert of the same top-k row (the first
// occurrence stays), a non-finite prob of a routed entry -- checked in that order, the entry
// skipped and its bit raised. One thread per slot; a warp ORs its bits once.
#include "device/cuda_check.h"
#include "device/vec16.cuh"
#include "ep/ep_kernels.h"
#include "moe/device_errors.h"

namespace moe::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    slot_destinations_kernel(EpRouting r, int E_local, int32_t* slot_dest, uint32_t* error_word) {
  const int64_t n = static_cast<int64_t>(r.T) * r.slots;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  uint32_t bits = 0;
  if (i < n) {
    int e = -1;
    if (r.form == RoutingForm::kTopK) {
      e = __ldg(r.indices + i);
      if (e != -1 && (e < 0 || e >= r.E)) {
        bits |= kErrExpertOutOfRange;
        e = -1;
      } else if (e >= 0) {
        for (int64_t j = i - i % r.slots; j < i; ++j)
          if (__ldg(r.indices + j) == e) {
            bits |= kErrDuplicateExpert;
            e = -1;
            break;
          }
      }
    } else {
      e = __ldg(r.map + i) != 0 ? static_cast<int>(i % r.slots) : -1;
    }
    if (e >= 0 && !isfinite(__ldg(r.probs + i))) {
      bits |= kErrNonFiniteProb;
      e = -1;
    }
    slot_dest[i] = e >= 0 ? e / E_local : -1;
  }
  bits = __reduce_or_sync(kFullMask, bits);
  if ((threadIdx.x & 31) == 0 && bits) atomicOr(error_word, bits);
}

}  // namespace

void launch_ep_slot_destinations(const EpRouting& r, int E_local, int32_t* slot_dest, uint32_t* error_word,
                                 cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(r.T) * r.slots;
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  slot_destinations_kernel<<<blocks, kThreads, 0, stream>>>(r, E_local, slot_dest, error_word);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::kernels
