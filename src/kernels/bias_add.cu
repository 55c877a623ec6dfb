// y[r, :] += (p[r] *) bias[e(r), :]: one warp per row, 16-byte vectors, one fp32 fma per element
// rounded to bf16 once. The bias rows are small and stay in L2; y streams through once.
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
    bias_add_kernel(__nv_bfloat16* __restrict__ y, const DeviceRows<const __nv_bfloat16> bias,
                    const float* __restrict__ probs, const DeviceGroups groups, int N) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= groups.valid()) return;
  const int e = groups.expert_of(row);
  if (e >= groups.E) return;  // only with invalid (non-monotonic) offsets
  const float p = probs != nullptr ? probs[row] : 1.0f;
  const __nv_bfloat16* b = bias.row(e);
  __nv_bfloat16* yr = y + row * N;
  for (int j = lane * kVec; j < N; j += 32 * kVec) {
    float yv[kVec], bv[kVec];
    load_bf16x8(yr + j, yv);
    load_bf16x8(b + j, bv);
#pragma unroll
    for (int i = 0; i < kVec; ++i) yv[i] = __fmaf_rn(p, bv[i], yv[i]);
    store_bf16x8(yr + j, yv);
  }
}

}  // namespace
}  // namespace kernels

void bias_add(const TensorView& y, const ExpertRows& bias, const TensorView& probs, const TensorView& group_offsets,
              cudaStream_t stream) {
  using namespace kernels;
  const BiasDims d = check_grouped_matrix(y, "y", group_offsets);
  check_expert_rows(bias, "bias", d, {DType::kBF16});
  check_row_vector(probs, "probs", d.R);
  if (d.R == 0 || d.E == 0) return;
  const DeviceRows<const __nv_bfloat16> rows{static_cast<const __nv_bfloat16*>(bias.stacked),
                                             reinterpret_cast<const __nv_bfloat16* const*>(bias.table), d.N};
  const DeviceGroups groups{group_offsets.ptr<const int32_t>(), d.E, d.R};
  const dim3 grid(static_cast<unsigned>((d.R + kRowsPerBlock - 1) / kRowsPerBlock));
  bias_add_kernel<<<grid, kThreads, 0, stream>>>(y.ptr<__nv_bfloat16>(), rows,
                                                 is_absent(probs) ? nullptr : probs.ptr<const float>(), groups,
                                                 static_cast<int>(d.N));
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe
