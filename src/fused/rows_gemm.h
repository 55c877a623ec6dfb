// Grouped GEMM over contiguous expert rows (docs/gemm.md, "Our own kernel for the token-side
// products"): for every row r of every expert group e,
//
//   D[r, :] = bf16(A[r, :] B_e)      A [R, red] bf16, D [R, out] bf16, fp32 accumulation
//
// with B_e stored either [out, red] (the fprop form: Y = X W^T) or [red, out] (the dgrad form:
// dX = dY W), the experts' matrices one contiguous [E, ., .] tensor read by TMA. It is the fused
// row-tile kernels' design (fc1_activation.cu, fc2_dgrad_activation.cu) with a plain epilogue: the
// rows of a tile are read through one base pointer, the weights through one tensor map, so moving
// to another expert costs nothing, where CUTLASS's pointer-array kernel rewrites its TMA
// descriptors. Plain C++ interface; GroupedGemm offers it as the configurations "rows_*"
// (src/gemm/rows_entries.cpp).
#pragma once

#include <cstdint>
#include <string>

#include <cuda_runtime_api.h>

namespace moe::fused {

// How the two consumer warp groups share the tiles: as in the fused fc2 dgrad, 256 output columns a
// tile, ping-pong (a 64-row tile each, in turn, one's epilogue under the other's main loop) or
// cooperative (both on one 128-row tile); or ping-pong with a 128 x 192 tile each (SonicMoE's tile
// for short reductions; the producer then loads both operands by TMA). The first two give the same
// bits.
enum class RowsGemmSchedule { kPingPong, kCooperative, kPingPong128x192 };

struct RowsGemmArgs {
  const void* a = nullptr;  // bf16 [R, red] (a_rows rows with windows), row-major
  int64_t R = 0;
  int red = 0;  // reduction length, multiple of 8
  int out = 0;  // output columns, multiple of 8
  // B: one contiguous bf16 tensor [E, out, red] (b_out_major: the fprop form) or [E, red, out].
  const void* b = nullptr;
  bool b_out_major = true;
  void* d = nullptr;  // bf16 [R, out]; rows past the last group are not written
  const int32_t* group_offsets = nullptr;  // [E + 1], read on the device (clamped into [0, R])
  int experts = 0;
  // Optional windows (GemmProblem::a_row_begin): expert e reads its rows of `a` from row
  // a_row_begin[e] of a_rows on and still writes its rows [offsets[e], offsets[e + 1]) of d; a
  // window that starts below 0 or runs past a_rows is clamped to them (kErrBadGroupOffsets).
  const int32_t* a_row_begin = nullptr;
  int64_t a_rows = 0;
  // Optional: kErrBadGroupOffsets for offsets that are not 0-based, decrease or run past R.
  uint32_t* error_word = nullptr;
  int sm_count = 0;  // CTAs of the persistent grid at most (rounded down to clusters of 2)
  RowsGemmSchedule schedule = RowsGemmSchedule::kCooperative;
};

// Empty when the kernel takes these sizes; otherwise why not (the caller falls back).
std::string rows_gemm_unsupported(int experts, int64_t R, int64_t red, int64_t out);

// Enqueues the kernel; nothing when R == 0. Graph-safe: group sizes are read on the device only.
void launch_rows_gemm(const RowsGemmArgs& args, cudaStream_t stream);

}  // namespace moe::fused
