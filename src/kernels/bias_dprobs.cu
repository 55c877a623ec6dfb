// dprobs[r] (+)= <dy[r, :], bias[e(r), :]>: the prob's gradient through the p-scaled fc2 bias.
// One warp per row; each lane sums its vectors in order, then a fixed xor-shuffle tree: the same
// order on every run (deterministic, no atomics).
#include <cuda_bf16.h>

#include "kernels/activation_args.h"
#include "kernels/activation_math.cuh"
#include "kernels/bias_args.h"
#include "device/device_groups.cuh"
#include "device/cuda_check.h"
#include "moe/bias_ops.h"

namespace moe {
namespace kernels {
namespace {

constexpr int kThreads = 256, kRowsPerBlock = kThreads / 32;

__global__ void __launch_bounds__(kThreads)
    bias_dprobs_kernel(const __nv_bfloat16* __restrict__ dy, const DeviceRows<const __nv_bfloat16> bias,
                       const DeviceGroups groups, int N, bool accumulate, float* __restrict__ dprobs) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= groups.valid()) return;  // whole warps: the shuffles below always have 32 lanes
  const int e = groups.expert_of(row);
  if (e >= groups.E) return;
  const __nv_bfloat16* b = bias.row(e);
  const __nv_bfloat16* dyr = dy + row * N;
  float dot = 0.0f;
  for (int j = lane * kVec; j < N; j += 32 * kVec) {
    float dv[kVec], bv[kVec];
    load_bf16x8(dyr + j, dv);
    load_bf16x8(b + j, bv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) dot = __fmaf_rn(dv[i], bv[i], dot);
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, m);
  if (lane == 0) dprobs[row] = accumulate ? dprobs[row] + dot : dot;
}

}  // namespace
}  // namespace kernels

void bias_dprobs(const TensorView& dy, const ExpertRows& bias, const TensorView& group_offsets,
                 const TensorView& dprobs, bool accumulate, cudaStream_t stream) {
  using namespace kernels;
  const BiasDims d = check_grouped_matrix(dy, "dy", group_offsets);
  check_expert_rows(bias, "bias", d, {DType::kBF16});
  MOE_CHECK(!is_absent(dprobs), "argument 'dprobs': required (fp32 [R])");
  check_row_vector(dprobs, "dprobs", d.R);
  if (d.R == 0 || d.E == 0) return;
  const DeviceRows<const __nv_bfloat16> rows{static_cast<const __nv_bfloat16*>(bias.stacked),
                                             reinterpret_cast<const __nv_bfloat16* const*>(bias.table), d.N};
  const DeviceGroups groups{group_offsets.ptr<const int32_t>(), d.E, d.R};
  const dim3 grid(static_cast<unsigned>((d.R + kRowsPerBlock - 1) / kRowsPerBlock));
  bias_dprobs_kernel<<<grid, kThreads, 0, stream>>>(dy.ptr<const __nv_bfloat16>(), rows, groups,
                                                    static_cast<int>(d.N), accumulate, dprobs.ptr<float>());
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe
