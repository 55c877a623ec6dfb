// Destination rank of every routing slot of one source rank, read through the single-GPU plan's
// SlotReader (src/kernels/slot_reader.cuh), so the same entries are skipped with the same bits
// (docs/semantics.md, Errors): an expert id outside [0, E) other than -1, a repeat of an earlier
// expert of the same top-k row (the first occurrence stays), a non-finite prob of a routed entry.
// One thread per slot, a warp per 32 consecutive slots (SlotReader's step); a warp ORs its bits once.
#include "device/cuda_check.h"
#include "device/vec16.cuh"
#include "ep/ep_kernels.h"
#include "kernels/slot_reader.cuh"

namespace moe::kernels {
namespace {

constexpr int kThreads = 256;

__global__ void __launch_bounds__(kThreads)
    slot_destinations_kernel(SlotReader rd, int E_local, int32_t* slot_dest, uint32_t* error_word) {
  // int32: n + kThreads < 2^31, checked by the pack plan's Dispatcher (T_max * slots + its chunk
  // and pad allowance).
  const int32_t i = static_cast<int32_t>(blockIdx.x) * kThreads + static_cast<int32_t>(threadIdx.x);
  const int lane = static_cast<int>(threadIdx.x & 31);
  const int32_t first = i - lane;  // the warp's step
  uint32_t bits = 0;
  unsigned peers;
  SlotReader::StepLoad ld = rd.load_step(first, lane);
  rd.load_step_probs(first, lane, ld);
  const int e = rd.decide_step(first, lane, ld, bits, peers);
  if (i < rd.n) slot_dest[i] = e >= 0 ? e / E_local : -1;
  bits = __reduce_or_sync(kFullMask, bits);
  if (lane == 0 && bits) atomicOr(error_word, bits);
}

}  // namespace

void launch_ep_slot_destinations(const EpRouting& r, int E_local, int32_t* slot_dest, uint32_t* error_word,
                                 cudaStream_t stream) {
  const int64_t n = static_cast<int64_t>(r.T) * r.slots;
  if (n == 0) return;
  const unsigned blocks = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  const SlotReader rd{r.form, static_cast<int32_t>(n), r.slots, r.E, r.indices, r.map, r.probs};
  slot_destinations_kernel<<<blocks, kThreads, 0, stream>>>(rd, E_local, slot_dest, error_word);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::kernels
