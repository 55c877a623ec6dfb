// Bias gradients db_e = sum over expert e's rows of (p *) dy, deterministic and graph-safe.
//
// Three small kernels, all sized from the static row bound R:
//   1. layout:   chunk_start[e] = sum_{e' < e} ceil(rows(e') / C)  (one block, a block scan)
//   2. partial:  each C-row chunk of an expert sums its rows (fixed order) into partial[chunk, :]
//   3. finish:   db_e = partial chunks of e summed in order, written or added to main_grad
// Chunks never straddle two experts, and sum_e ceil(rows(e) / C) <= R / C + E partial rows are used.
// C (16..128) and the block shape are functions of the static (R, N) only (bias_grad_plan.h): enough
// blocks to fill the GPU, and one fixed summation order for a given layer. No float atomics: every sum has one fixed
// order, so results are bitwise reproducible.
#include <cub/block/block_scan.cuh>
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/activation_args.h"
#include "kernels/activation_math.cuh"
#include "kernels/bias_args.h"
#include "kernels/bias_grad_plan.h"
#include "device/device_groups.cuh"
#include "device/cuda_check.h"
#include "moe/bias_ops.h"

namespace moe {
namespace kernels {
namespace {

constexpr int kThreads = kBiasGradThreads;

// Workspace: chunk_start int32 [E + 1] (padded to 16 bytes), then partial fp32 [chunks, N].

// Summed in int64 and stored saturated at INT32_MAX: valid offsets sum to at most R / C + E chunks,
// but invalid (non-monotonic) ones could overlap their rows and pass int32, and a wrapped, negative
// start would send the finish kernel before the workspace. Saturation keeps the starts monotonic.
__global__ void __launch_bounds__(kThreads)
    bias_grad_layout_kernel(const DeviceGroups groups, int chunk, int32_t* chunk_start) {
  using Scan = cub::BlockScan<int64_t, kThreads>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int64_t carry;
  if (threadIdx.x == 0) carry = 0;
  __syncthreads();
  for (int base = 0; base < groups.E; base += kThreads) {
    const int e = base + threadIdx.x;
    int64_t n = 0;
    if (e < groups.E) {
      int64_t rows = groups.begin(e + 1) - groups.begin(e);
      n = rows > 0 ? (rows + chunk - 1) / chunk : 0;
    }
    int64_t excl, total;
    Scan(tmp).ExclusiveSum(n, excl, total);
    if (e < groups.E) chunk_start[e] = static_cast<int32_t>(min(carry + excl, static_cast<int64_t>(INT32_MAX)));
    __syncthreads();  // everyone has read carry (and tmp is free again)
    if (threadIdx.x == 0) carry += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) chunk_start[groups.E] = static_cast<int32_t>(min(carry, static_cast<int64_t>(INT32_MAX)));
}

// Block (vx, ry): vx threads across the columns (8 per thread), ry row lanes through the chunk.
template <bool kProbs>
__global__ void __launch_bounds__(kThreads)
    bias_grad_partial_kernel(const __nv_bfloat16* __restrict__ dy, const float* __restrict__ probs,
                             const DeviceGroups groups, const int32_t* __restrict__ chunk_start, int chunk,
                             int N, float* __restrict__ partial) {
  __shared__ float4 red[kThreads][2];
  const int64_t c = blockIdx.x;
  const int E = groups.E;
  if (c >= chunk_start[E]) return;  // block-uniform
  // The expert of chunk c: the last e with chunk_start[e] <= c (skips experts without chunks).
  int lo = 0, hi = E - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (chunk_start[mid] <= c) lo = mid;
    else hi = mid - 1;
  }
  const int e = lo;
  const int64_t r0 = groups.begin(e) + (c - chunk_start[e]) * chunk;
  const int64_t r1 = min(r0 + chunk, groups.begin(e + 1));
  const int tx = threadIdx.x, ty = threadIdx.y, vx = blockDim.x, ry = blockDim.y;
  const int j = (blockIdx.y * vx + tx) * kVec;
  float acc[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
  if (j < N) {
#pragma unroll 4
    for (int64_t r = r0 + ty; r < r1; r += ry) {
      float d[kVec];
      load_bf16x8(dy + r * N + j, d);
      const float p = kProbs ? probs[r] : 1.0f;
#pragma unroll
      for (int i = 0; i < kVec; ++i) acc[i] = kProbs ? __fmaf_rn(p, d[i], acc[i]) : acc[i] + d[i];
    }
  }
  const int t = ty * vx + tx;
  red[t][0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
  red[t][1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  __syncthreads();
  if (ty == 0 && j < N) {
    // Row lanes added in order 0, 1, ..., ry - 1.
    for (int y = 1; y < ry; ++y) {
      float4 a = red[y * vx + tx][0], b = red[y * vx + tx][1];
      acc[0] += a.x; acc[1] += a.y; acc[2] += a.z; acc[3] += a.w;
      acc[4] += b.x; acc[5] += b.y; acc[6] += b.z; acc[7] += b.w;
    }
    float4* out = reinterpret_cast<float4*>(partial + c * N + j);
    out[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
    out[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
  }
}

template <typename G>
__global__ void __launch_bounds__(kThreads)
    bias_grad_finish_kernel(const float* __restrict__ partial, const int32_t* __restrict__ chunk_start,
                            int64_t chunks, int N, bool accumulate, const DeviceRows<G> grad) {
  const int e = blockIdx.x;
  const int j = (blockIdx.y * kThreads + threadIdx.x) * kVec;
  if (j >= N) return;
  // Clamped to the workspace: only invalid offsets could push chunk_start past it.
  const int64_t c0 = min(static_cast<int64_t>(chunk_start[e]), chunks);
  const int64_t c1 = max(c0, min(static_cast<int64_t>(chunk_start[e + 1]), chunks));
  if (c1 == c0 && accumulate) return;  // an expert without rows leaves main_grad untouched
  float s[kVec] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t c = c0; c < c1; ++c) {
    const float4* in = reinterpret_cast<const float4*>(partial + c * N + j);
    float4 a = in[0], b = in[1];
    s[0] += a.x; s[1] += a.y; s[2] += a.z; s[3] += a.w;
    s[4] += b.x; s[5] += b.y; s[6] += b.z; s[7] += b.w;
  }
  G* g = grad.row(e) + j;
  if constexpr (sizeof(G) == 4) {
    float4* g4 = reinterpret_cast<float4*>(g);
    if (accumulate) {
      float4 a = g4[0], b = g4[1];
      s[0] += a.x; s[1] += a.y; s[2] += a.z; s[3] += a.w;
      s[4] += b.x; s[5] += b.y; s[6] += b.z; s[7] += b.w;
    }
    g4[0] = make_float4(s[0], s[1], s[2], s[3]);
    g4[1] = make_float4(s[4], s[5], s[6], s[7]);
  } else {
    store_bf16x8(g, s);  // bf16 gradients: write only (checked on the host)
  }
}

}  // namespace
}  // namespace kernels

size_t bias_grad_workspace_bytes(int64_t R, int experts, int64_t N) {
  // The bounds bias_grad accepts (check_grouped_matrix), so the sizes below cannot wrap.
  MOE_CHECK(R >= 0 && R < kernels::kBiasGradMaxRows, "argument 'R': expected 0 <= R < 2^33, got ", R);
  MOE_CHECK(experts >= 0 && experts < INT32_MAX, "argument 'experts': expected 0 <= experts < 2^31 - 1, got ",
            experts);
  MOE_CHECK(N >= 0 && N <= INT32_MAX, "argument 'N': expected 0 <= N < 2^31, got ", N);
  // Sized for every call of up to R rows: a standalone op may run fewer rows than it was sized for.
  const auto chunks = static_cast<size_t>(kernels::bias_grad_chunk_bound(R, experts, N));
  const size_t row_bytes = static_cast<size_t>(N) * sizeof(float);
  const size_t table = kernels::bias_grad_chunk_table_bytes(experts);
  MOE_CHECK(row_bytes == 0 || chunks <= (SIZE_MAX - table) / row_bytes, "bias_grad_workspace_bytes: ", chunks,
            " partial sums of ", N, " columns overflow the size type");
  return table + chunks * row_bytes;
}

void bias_grad(const TensorView& dy, const TensorView& probs, const TensorView& group_offsets, const ExpertRows& grad,
               bool accumulate, const TensorView& workspace, cudaStream_t stream) {
  using namespace kernels;
  const BiasDims d = check_grouped_matrix(dy, "dy", group_offsets);
  check_expert_rows(grad, "grad", d, {DType::kFP32, DType::kBF16});
  MOE_CHECK(!(accumulate && grad.dtype != DType::kFP32), "argument 'grad': accumulation needs an fp32 main_grad, got ",
            dtype_name(grad.dtype));
  check_row_vector(probs, "probs", d.R);
  const size_t need = bias_grad_workspace_bytes(d.R, d.E, d.N);
  check_device(workspace, "workspace", Device::kCUDA);
  MOE_CHECK(static_cast<size_t>(workspace.nbytes()) >= need, "argument 'workspace': expected at least ", need,
            " bytes (bias_grad_workspace_bytes), got ", workspace.nbytes());
  check_pointer(workspace, "workspace", 16);
  if (d.E == 0) return;
  const DeviceGroups groups{group_offsets.ptr<const int32_t>(), d.E, d.R};
  auto* chunk_start = static_cast<int32_t*>(workspace.data);
  auto* partial = reinterpret_cast<float*>(static_cast<char*>(workspace.data) + bias_grad_chunk_table_bytes(d.E));
  const BiasGradPlan plan = plan_bias_grad(d.R, d.E, d.N);
  const int64_t chunks = plan.chunks;
  const int N = static_cast<int>(d.N);
  const int64_t vecs = d.N / kVec;

  bias_grad_layout_kernel<<<1, kThreads, 0, stream>>>(groups, plan.chunk, chunk_start);
  MOE_CUDA_CHECK_LAUNCH();

  if (d.R > 0) {
    const dim3 block(plan.vx, kThreads / plan.vx);
    const dim3 grid(static_cast<unsigned>(chunks), static_cast<unsigned>(plan.slices));
    const float* pp = is_absent(probs) ? nullptr : probs.ptr<const float>();
    if (pp != nullptr)
      bias_grad_partial_kernel<true><<<grid, block, 0, stream>>>(dy.ptr<const __nv_bfloat16>(), pp, groups,
                                                                 chunk_start, plan.chunk, N, partial);
    else
      bias_grad_partial_kernel<false><<<grid, block, 0, stream>>>(dy.ptr<const __nv_bfloat16>(), pp, groups,
                                                                  chunk_start, plan.chunk, N, partial);
    MOE_CUDA_CHECK_LAUNCH();
  }

  const dim3 grid(static_cast<unsigned>(d.E), static_cast<unsigned>((vecs + kThreads - 1) / kThreads));
  if (grad.dtype == DType::kFP32) {
    const DeviceRows<float> rows{static_cast<float*>(grad.stacked), reinterpret_cast<float* const*>(grad.table), d.N};
    bias_grad_finish_kernel<float><<<grid, kThreads, 0, stream>>>(partial, chunk_start, chunks, N, accumulate, rows);
  } else {
    const DeviceRows<__nv_bfloat16> rows{static_cast<__nv_bfloat16*>(grad.stacked),
                                         reinterpret_cast<__nv_bfloat16* const*>(grad.table), d.N};
    bias_grad_finish_kernel<__nv_bfloat16>
        <<<grid, kThreads, 0, stream>>>(partial, chunk_start, chunks, N, accumulate, rows);
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe
