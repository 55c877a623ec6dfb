// Gather-combine, one warp per token t (docs/semantics.md, Dispatch and Combine):
//   y[t] = sum over the token's slots, in slot order, of w * Y[slot_row[t, s]]   (fp32 accumulation)
// It is the unpermute (w = the row's prob from the plan, or the slot's given prob, when merging
// probs, else 1) and the permute backward
// (w = 1, plus dprobs[t, s] = d_probs_perm[row]). A gather in fixed slot order instead of a scatter
// with atomics: deterministic, and pad rows are never read.
#include "device/cuda_check.h"
#include "kernels/dispatch_kernels.h"
#include "device/vec16.cuh"

namespace moe::kernels {
namespace {

constexpr int kWarps = 4;  // tokens per block
// kUnroll: 16-byte vectors per lane and row; kRows: rows (slots) whose loads are all issued before
// the first FMA. The launch picks 4 vectors x 2 rows for tokens of up to 2 slots, 4 x 4 up to 4,
// else 2 x 8: about 8-16 loads in flight per lane at any k, in registers that keep 4 blocks per SM
// (8 x 2 for every k was as fast at k = 8 but 6% slower at k = 2).
template <typename T, int kUnroll, int kRows>
__global__ void __launch_bounds__(kWarps * 32)
    combine_kernel(const uint4* Y, uint4* y, int64_t nvec, const int32_t* slot_row, int slots, int32_t T_tokens,
                   const float* probs_perm, const float* slot_probs, const float* d_probs_perm, float* dprobs,
                   const int32_t* prob_row) {
  constexpr int kE = RowVec<T>::kElems;
  extern __shared__ int32_t lists[];  // per warp: rows [slots], weights [slots]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t t = blockIdx.x * kWarps + warp;
  if (t >= T_tokens) return;
  int32_t* rows = lists + warp * 2 * slots;
  float* ws = reinterpret_cast<float*>(rows + slots);

  // The token's rows, compacted in slot order.
  int n = 0;
  const unsigned lt = lanemask_lt();
  for (int s0 = 0; s0 < slots; s0 += 32) {
    const int s = s0 + lane;
    const int64_t i = static_cast<int64_t>(t) * slots + s;
    const int32_t row = s < slots ? __ldg(slot_row + i) : -1;
    const bool valid = row >= 0;
    const unsigned ballot = __ballot_sync(kFullMask, valid);
    if (valid) {
      const int pos = n + __popc(ballot & lt);
      rows[pos] = row;
      ws[pos] = slot_probs ? __ldg(slot_probs + i) : probs_perm ? __ldg(probs_perm + row) : 1.0f;
    }
    if (dprobs && s < slots)
      dprobs[i] = (valid && d_probs_perm) ? __ldg(d_probs_perm + (prob_row ? __ldg(prob_row + i) : row)) : 0.0f;
    n += __popc(ballot);
  }
  __syncwarp();

  uint4* out = y + static_cast<int64_t>(t) * nvec;
  for (int64_t v0 = lane; v0 < nvec; v0 += 32 * kUnroll) {
    float acc[kUnroll][kE];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int e = 0; e < kE; ++e) acc[u][e] = 0.0f;
    // kRows rows at a time: every load of the batch is issued before the first FMA, then the rows
    // are added in slot order (the sum's order, and so its bits, do not depend on the batching).
    for (int j0 = 0; j0 < n; j0 += kRows) {
      uint4 in[kRows][kUnroll];
#pragma unroll
      for (int jj = 0; jj < kRows; ++jj) {
        const bool ok = j0 + jj < n;
        const uint4* src = Y + static_cast<int64_t>(ok ? rows[j0 + jj] : 0) * nvec;
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int64_t v = v0 + u * 32;
          in[jj][u] = ok && v < nvec ? __ldg(src + v) : uint4{};
        }
      }
#pragma unroll
      for (int jj = 0; jj < kRows; ++jj) {
        if (j0 + jj >= n) break;
        const float w = ws[j0 + jj];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          float f[kE];
          unpack<T>(in[jj][u], f);
#pragma unroll
          for (int e = 0; e < kE; ++e) acc[u][e] = fmaf(w, f[e], acc[u][e]);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t v = v0 + u * 32;
      if (v < nvec) out[v] = pack<T>(acc[u]);
    }
  }
}

}  // namespace

void launch_combine(DType dtype, const void* Y, void* y, int64_t H, const int32_t* slot_row, int slots, int32_t T,
                    const float* probs_perm, const float* slot_probs, const float* d_probs_perm, float* dprobs,
                    cudaStream_t stream, const int32_t* prob_row) {
  if (T == 0) return;
  const unsigned blocks = static_cast<unsigned>((T + kWarps - 1) / kWarps);
  const size_t smem = sizeof(int32_t) * 2 * kWarps * slots;
  auto launch = [&](auto zero) {
    using E = decltype(zero);
    const int64_t nvec = H / RowVec<E>::kElems;
    auto kernel = slots <= 2 ? combine_kernel<E, 4, 2> : slots <= 4 ? combine_kernel<E, 4, 4> : combine_kernel<E, 2, 8>;
    kernel<<<blocks, kWarps * 32, smem, stream>>>(static_cast<const uint4*>(Y), static_cast<uint4*>(y), nvec,
                                                  slot_row, slots, T, probs_perm, slot_probs, d_probs_perm, dprobs,
                                                  prob_row);
  };
  switch (dtype) {
    case DType::kBF16: launch(__nv_bfloat16{}); break;
    case DType::kFP16: launch(__half{}); break;
    case DType::kFP32: launch(float{}); break;
    default: detail::throw_error("launch_combine: unsupported dtype ", dtype_name(dtype));
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::kernels
