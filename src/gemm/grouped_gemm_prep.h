// The device-side preparation of a grouped launch: per-group problem shapes, operand pointers and
// leading dimensions computed on the device from the device group offsets (no host read, so a
// captured graph replays correctly with new group sizes), and the zero-fill of the weight
// gradients of empty experts.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

#include "gemm/grouped_kernel.h"

namespace moe::gemm {

// The E matrices of a parameter on the device: table[e] when table is set (per-expert layout),
// else base + e * stride_bytes (single grouped layout). Both give the same pointers to the kernel.
struct ExpertPtrs {
  const char* base = nullptr;
  int64_t stride_bytes = 0;
  const void* const* table = nullptr;
};

// Writable device argument arrays of one op (allocated once, fixed addresses).
struct ArgArrays {
  int32_t* shapes;  // [E][3]
  const void** ptr_a;
  const void** ptr_b;
  const void** ptr_c;
  void** ptr_d;
  int64_t* ld_a;
  int64_t* ld_b;
  int64_t* ld_c;
  int64_t* ld_d;
  const float** ptr_sfa;  // FP8 only
  const float** ptr_sfb;
};

struct PrepParams {
  Op op;
  int groups;
  int64_t rows;  // rows of the token-side matrices: offsets are clamped to [0, rows]
  int64_t N, K;  // the expert matrices are [N, K]
  const int32_t* offsets;  // device [groups + 1]
  // fprop: a = X [rows, K], d = Y [rows, N]; dgrad: a = dY [rows, N], d = dX [rows, K];
  // wgrad: a = dY [rows, N], b_tokens = X [rows, K], d = experts' dW.
  const char* a = nullptr;
  const char* b_tokens = nullptr;
  char* d = nullptr;
  ExpertPtrs weights;  // fprop/dgrad: W; wgrad: dW (also C when accumulating)
  uint32_t* error_word = nullptr;  // optional: kErrBadGroupOffsets for offsets that had to be clamped
  // FP8 block scaling (fp8 = true): operands of one byte with fp32 scale_inv tensors. The fprop
  // form reads a_scale [rows, ceil(K / 128)] and w_scale per expert; wgrad reads the tokens'
  // columnwise copies (a = dY^T [N, rows], b_tokens = X^T [K, rows]) and their scales
  // a_scale [ceil(rows / 128), N], b_scale [ceil(rows / 128), K]. A wgrad group must fill whole
  // 128-token blocks (start on the grid, end on it or at the end of the rows): one that does not is
  // skipped (as if empty) and raises kErrUnalignedGroup.
  bool fp8 = false;
  bool a_scale_mn_major = false;  // fprop form: a_scale [ceil(K / 128), ld] (pointers at each group's first row)
  const float* a_scale = nullptr;
  const float* b_scale = nullptr;
  ExpertPtrs w_scale;
  // fprop / dgrad, bf16: group e's rows of `a` start at a_row_begin[e] (of a_rows rows) instead of
  // its first row of `d` (GemmProblem::a_row_begin); null: at offsets[e].
  const int32_t* a_row_begin = nullptr;
  int64_t a_rows = 0;
};

// One thread per group; enqueued on `stream`.
void launch_prep(const PrepParams& p, const ArgArrays& out, cudaStream_t stream);

// FP8 fprop form with 64-row weight scales (KernelEntry::weight_scale_rows == 64): dst[e] [dst_rows,
// cols] row-major gets row r of expert e's [src_rows, cols] scales at row min(r / 2, src_rows - 1)
// (each 128-row block's scale for both of its 64-row halves; rows past the last block repeat it).
// dst_rows covers whole 192-wide tiles, 3 * ceil(B rows / 192), and the rows past ceil(B rows / 64)
// are needed for memory safety, not only for the tile columns past the matrix: CUTLASS 4.2's scale
// producer predicates a 64-row block by the coordinate of block b / 2, so in a tile that ends past
// the matrix it reads up to one row beyond ceil(B rows / 64) (always below 3 * ceil(B rows / 192),
// checked on the host for B rows 16..7168).
void launch_restate_weight_scales(ExpertPtrs src, int experts, int64_t src_rows, int64_t cols, float* dst,
                                  int64_t dst_rows, cudaStream_t stream);

// Write mode of wgrad: zero-fills dW_e of every expert whose (clamped) group is empty -- or, with
// fp8, skipped off the token grid; the GEMM skips those groups (problem shape M = 0), so nothing
// else writes them. Never hangs, and touches nothing when every group has rows.
void launch_zero_empty_experts(const int32_t* offsets, int groups, int64_t rows, ExpertPtrs dw, int64_t matrix_bytes,
                               bool fp8, cudaStream_t stream);

}  // namespace moe::gemm
