// Grouped weight gradient with gathered rows (docs/fused.md): for every expert group e of rows
// [g[e], g[e+1]),
//
//   dW_e  = dY_e^T X_e      dY [R, M] (rows contiguous), dW_e [M, N]
//
// where row r of X is row r of a permuted buffer [R, N] (row_slots null) or -- gathering -- row
// row_slots[r] / slots of the caller's x [T, N] (zeros where row_slots[r] < 0). The gathering form
// is the fc1 weight gradient straight from x: the permuted copy x_perm never has to exist. With
// x_major the result is stored transposed, dW_e^T [N, M]: the fc2 weight gradient
// dW2_e = dY_perm_e^T act_e [H, F] with X = dy gathered (N = H) and act in the dY role (M = F).
// fp32 accumulation; dW_e written as bf16 or fp32, or accumulated into an fp32 main_grad; an empty
// group writes a zero dW_e (or leaves main_grad as it is). Under skewed routing the clusters draw
// their tiles from a queue, the experts with the most rows first, so every SM stays busy; each tile
// is still one CTA's whole reduction, so the result does not depend on the schedule (bitwise the same).
// Plain C++ interface; the kernel lives in wgrad_gathered.cu.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace moe::fused {

// How the persistent clusters walk the output tiles. kAuto: the kernel estimates, from the group
// sizes on the device, whether the fixed stride would leave clusters idle, and takes the queue if
// so. kStride / kQueue force one (tests, benchmarks).
enum class WgradSchedule { kAuto, kStride, kQueue };

struct WgradGatheredArgs {
  const void* dy = nullptr;  // bf16 [R, M]
  // X rows: bf16 [R, N] (row_slots null) or x [T, N] gathered through row_slots [R].
  const void* x = nullptr;
  const int32_t* row_slots = nullptr;
  int slots = 1;
  const int32_t* group_offsets = nullptr;  // [E + 1], read on the device (clamped into [0, R])
  int experts = 0;
  int64_t R = 0;
  int M = 0;  // multiple of 8
  int N = 0;  // multiple of 8
  // dW_e [M, N] row-major ([N, M] with x_major): base + e * stride (single grouped) or table[e].
  void* dw_base = nullptr;
  int64_t dw_stride_bytes = 0;
  void* const* dw_table = nullptr;
  bool dw_fp32 = false;     // fp32 (else bf16) dW
  bool accumulate = false;  // fp32 dW += result (main_grad)
  bool x_major = false;     // store dW_e^T [N, M]
  int sm_count = 0;         // SMs of the device (0: queried per launch)
  // The tile queue's counter: one int, zero before the first launch (the kernel leaves it zero).
  // Launches that may run at the same time need a counter each. Required whatever the schedule.
  int* tile_counter = nullptr;
  WgradSchedule schedule = WgradSchedule::kAuto;
};

// Whether the kernel handles these sizes (host check). Empty string: yes; otherwise the reason.
const char* wgrad_gathered_unsupported(int experts, int64_t M, int64_t N);

// Enqueues the kernel. Graph-safe: group sizes are read on the device only.
void launch_wgrad_gathered(const WgradGatheredArgs& args, cudaStream_t stream);

}  // namespace moe::fused
