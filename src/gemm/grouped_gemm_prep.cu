// Device-side preparation of grouped launches (see grouped_gemm_prep.h).
#include "gemm/grouped_gemm_prep.h"

#include <algorithm>

#include "device/cuda_check.h"
#include "device/device_groups.cuh"
#include "moe/device_errors.h"

namespace moe::gemm {
namespace {

__device__ inline const char* expert_ptr(const ExpertPtrs& w, int e) {
  return w.table ? static_cast<const char*>(w.table[e]) : w.base + e * w.stride_bytes;
}

// FP8 wgrad: the tokens' scale blocks run over whole 128-token blocks of the rows, so a group can
// only be computed when its tokens fill whole blocks -- it starts on the grid, and it ends on the
// grid or at the end of the rows (any other end shares its last block with other tokens).
__device__ inline bool off_token_grid(int64_t start, int64_t end, int64_t rows) {
  return end > start && (start % 128 != 0 || (end % 128 != 0 && end != rows));
}

__global__ void restate_weight_scales_kernel(ExpertPtrs src, int64_t src_rows, int64_t cols, float* dst,
                                             int64_t dst_rows) {
  const int e = blockIdx.y;
  const float* s = reinterpret_cast<const float*>(expert_ptr(src, e));
  float* d = dst + e * dst_rows * cols;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < dst_rows * cols;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    d[i] = s[std::min(r / 2, src_rows - 1) * cols + c];
  }
}

// The first row of `a` of group e (fprop, dgrad) and its row count m, which a window of
// a_row_begin clamps to a's rows (raising kErrBadGroupOffsets).
__device__ inline int64_t a_window(const PrepParams& p, int e, int64_t start, int32_t* m) {
  if (p.a_row_begin == nullptr) return start;
  int64_t begin = p.a_row_begin[e];
  if (begin < 0 || begin + *m > p.a_rows) {
    if (p.error_word != nullptr) atomicOr(p.error_word, kErrBadGroupOffsets);
    begin = begin < 0 ? 0 : (begin > p.a_rows ? p.a_rows : begin);
    if (begin + *m > p.a_rows) *m = static_cast<int32_t>(p.a_rows - begin);
  }
  return begin;
}

__global__ void prep_kernel(PrepParams p, ArgArrays out) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= p.groups) return;
  if (p.error_word != nullptr) {
    const int32_t lo = p.offsets[e], hi = p.offsets[e + 1];
    if ((e == 0 && lo != 0) || hi < lo || (e == p.groups - 1 && hi > p.rows)) atomicOr(p.error_word, kErrBadGroupOffsets);
  }
  int64_t start, end;
  kernels::group_rows(p.offsets, e, p.rows, &start, &end);
  int32_t m = static_cast<int32_t>(end - start);
  const int32_t N = static_cast<int32_t>(p.N), K = static_cast<int32_t>(p.K);
  const int64_t eb = p.fp8 ? 1 : 2;  // bytes of an operand element
  const char* w = expert_ptr(p.weights, e);
  int32_t* shape = out.shapes + 3 * e;
  switch (p.op) {
    case Op::kFprop: {  // Y_e [m, N] = X_e [m, K] W_e^T
      const int64_t a_start = a_window(p, e, start, &m);
      shape[0] = m, shape[1] = N, shape[2] = K;
      out.ptr_a[e] = p.a + a_start * p.K * eb, out.ld_a[e] = p.K;
      out.ptr_b[e] = w, out.ld_b[e] = p.K;
      out.ptr_d[e] = p.d + start * p.N * 2, out.ld_d[e] = p.N;
      if (p.fp8) {
        out.ptr_sfa[e] = p.a_scale + (p.a_scale_mn_major ? start : start * ((p.K + 127) / 128));
        out.ptr_sfb[e] = reinterpret_cast<const float*>(expert_ptr(p.w_scale, e));
      }
      break;
    }
    case Op::kDgrad: {  // dX_e [m, K] = dY_e [m, N] W_e
      const int64_t a_start = a_window(p, e, start, &m);
      shape[0] = m, shape[1] = K, shape[2] = N;
      out.ptr_a[e] = p.a + a_start * p.N * eb, out.ld_a[e] = p.N;
      out.ptr_b[e] = w, out.ld_b[e] = p.K;
      out.ptr_d[e] = p.d + start * p.K * 2, out.ld_d[e] = p.K;
      break;
    }
    case Op::kWgrad:  // dW_e [N, K] = dY_e^T X_e, reduction over the group's m rows.
      if (p.fp8 && off_token_grid(start, end, p.rows)) {
        // Its scale blocks would straddle other tokens (and its TMA base could be misaligned):
        // skipped like an empty group (zero-filled in write mode).
        if (p.error_word != nullptr) atomicOr(p.error_word, kErrUnalignedGroup);
        m = 0;
      }
      // An empty group becomes a GEMM with no tiles (M = 0): a ragged-K GEMM with K = 0 is never
      // launched (it has hung CUTLASS elsewhere), and dW_e is zero-filled separately in write mode
      // or left untouched when accumulating.
      shape[0] = m > 0 ? N : 0, shape[1] = m > 0 ? K : 0, shape[2] = m;
      if (p.fp8) {  // columnwise copies: the group is columns [start, start + m) of rows of p.rows
        out.ptr_a[e] = p.a + start, out.ld_a[e] = p.rows;
        out.ptr_b[e] = p.b_tokens + start, out.ld_b[e] = p.rows;
        out.ptr_sfa[e] = p.a_scale + (start / 128) * p.N;
        out.ptr_sfb[e] = p.b_scale + (start / 128) * p.K;
      } else {
        out.ptr_a[e] = p.a + start * p.N * eb, out.ld_a[e] = p.N;
        out.ptr_b[e] = p.b_tokens + start * p.K * eb, out.ld_b[e] = p.K;
      }
      out.ptr_c[e] = w, out.ld_c[e] = p.K;  // read only when accumulating (beta = 1)
      out.ptr_d[e] = const_cast<char*>(w), out.ld_d[e] = p.K;
      break;
  }
}

// grid (chunks, groups): each block zero-fills a slice of dW_e if group e is empty (or, FP8, skipped
// off the token grid).
__global__ void zero_empty_kernel(const int32_t* offsets, int64_t rows, ExpertPtrs dw, int64_t vecs, bool fp8) {
  const int e = blockIdx.y;
  int64_t start, end;
  kernels::group_rows(offsets, e, rows, &start, &end);
  if (end > start && !(fp8 && off_token_grid(start, end, rows))) return;
  uint4* dst = reinterpret_cast<uint4*>(const_cast<char*>(expert_ptr(dw, e)));
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < vecs; i += int64_t(gridDim.x) * blockDim.x)
    dst[i] = make_uint4(0, 0, 0, 0);
}

}  // namespace

void launch_prep(const PrepParams& p, const ArgArrays& out, cudaStream_t stream) {
  if (p.groups == 0) return;
  constexpr int kThreads = 128;
  prep_kernel<<<(p.groups + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p, out);
  MOE_CUDA_CHECK_LAUNCH();
}

void launch_zero_empty_experts(const int32_t* offsets, int groups, int64_t rows, ExpertPtrs dw, int64_t matrix_bytes,
                               bool fp8, cudaStream_t stream) {
  if (groups == 0 || matrix_bytes == 0) return;
  // matrix_bytes is a multiple of 16 (N, K multiples of 8) and every dW_e is 16-byte aligned
  // (checked on the host), so 16-byte stores cover it exactly.
  const int64_t vecs = matrix_bytes / 16;
  constexpr int kThreads = 256;
  const int chunks = static_cast<int>(std::min<int64_t>((vecs + kThreads * 4 - 1) / (kThreads * 4), 64));
  zero_empty_kernel<<<dim3(chunks, groups), kThreads, 0, stream>>>(offsets, rows, dw, vecs, fp8);
  MOE_CUDA_CHECK_LAUNCH();
}

void launch_restate_weight_scales(ExpertPtrs src, int experts, int64_t src_rows, int64_t cols, float* dst,
                                  int64_t dst_rows, cudaStream_t stream) {
  if (experts <= 0 || src_rows <= 0 || cols <= 0) return;
  const int64_t n = dst_rows * cols;
  const int blocks = static_cast<int>(std::min<int64_t>((n + 255) / 256, 1024));
  restate_weight_scales_kernel<<<dim3(blocks, experts), 256, 0, stream>>>(src, src_rows, cols, dst, dst_rows);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::gemm
