// Backward of activation x prob: dh from the activation's derivative (recomputed from h) and
// dprobs[r] = sum_j d_out[r, j] * act_unscaled[r, j]; fp32 math, bf16 dh.
// One warp per row: each lane sums its own vectors in order, then a fixed xor-shuffle tree adds the
// 32 partials -- the same order on every run (deterministic, no atomics).
#include <cuda_bf16.h>

#include "kernels/activation_args.h"
#include "kernels/activation_math.cuh"
#include "device/cuda_check.h"
#include "moe/activation_ops.h"

namespace moe {
namespace kernels {
namespace {

struct BackwardArgs {
  const __nv_bfloat16* h;
  const float* probs;            // null: scale 1
  const __nv_bfloat16* d_out;
  const int32_t* group_offsets;  // null: all R rows
  int groups;
  int64_t R;
  int F;
  int interleave;
  ActConsts c;
  __nv_bfloat16* dh;
  float* dprobs;  // null: not computed
};

template <Activation A, bool kProbs>
__global__ void __launch_bounds__(kActThreads) activation_backward_kernel(const BackwardArgs a) {
  constexpr bool kGated = A != Activation::kSquaredReLU;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kActRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  // A warp owns one row, so whole warps exit here and the shuffles below always have 32 lanes.
  if (row >= valid_rows(a.group_offsets, a.groups, a.R)) return;
  const float p = kProbs ? a.probs[row] : 1.0f;
  const int F = a.F;
  const int64_t in_cols = kGated ? 2 * F : F;
  // h and dh may be one buffer (in place): no __restrict__ on them; each thread reads the h elements
  // of its columns before it writes their gradients, and no two threads share a column.
  const __nv_bfloat16* hr = a.h + row * in_cols;
  const __nv_bfloat16* __restrict__ dor = a.d_out + row * F;
  __nv_bfloat16* dhr = a.dh + row * in_cols;
  float dp = 0.0f;
  for (int j = lane * kVec; j < F; j += 32 * kVec) {
    float go[kVec];
    load_bf16x8(dor + j, go);
    activation_backward_x8<A>(hr, dhr, j, F, a.interleave, a.c, go, p, dp);
  }
  if (a.dprobs != nullptr) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) dp += __shfl_xor_sync(0xffffffffu, dp, m);
    if (lane == 0) a.dprobs[row] = dp;
  }
}

template <Activation A>
void launch(const BackwardArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.R + kActRowsPerBlock - 1) / kActRowsPerBlock));
  if (a.probs != nullptr)
    activation_backward_kernel<A, true><<<grid, kActThreads, 0, stream>>>(a);
  else
    activation_backward_kernel<A, false><<<grid, kActThreads, 0, stream>>>(a);
}

}  // namespace
}  // namespace kernels

void activation_backward(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                         const TensorView& d_out, const TensorView& group_offsets, const TensorView& dh,
                         const TensorView& dprobs, cudaStream_t stream) {
  using namespace kernels;
  const ActivationDims d = check_activation_args(params, h, probs, group_offsets, d_out, "d_out");
  check_device_tensor(dh, "dh", DType::kBF16, {d.R, d.in_cols});
  check_row_vector(dprobs, "dprobs", d.R);
  if (d.R == 0) return;
  BackwardArgs a;
  a.h = h.ptr<const __nv_bfloat16>();
  a.probs = is_absent(probs) ? nullptr : probs.ptr<const float>();
  a.d_out = d_out.ptr<const __nv_bfloat16>();
  a.group_offsets = is_absent(group_offsets) ? nullptr : group_offsets.ptr<const int32_t>();
  a.groups = d.groups;
  a.R = d.R;
  a.F = static_cast<int>(d.F);
  a.interleave = params.glu_interleave;
  a.c = ActConsts{params.alpha, params.limit, params.offset};
  a.dh = dh.ptr<__nv_bfloat16>();
  a.dprobs = is_absent(dprobs) ? nullptr : dprobs.ptr<float>();
  switch (params.kind) {
    case Activation::kSwiGLU: launch<Activation::kSwiGLU>(a, stream); break;
    case Activation::kGeGLU: launch<Activation::kGeGLU>(a, stream); break;
    case Activation::kClampedSwiGLU: launch<Activation::kClampedSwiGLU>(a, stream); break;
    case Activation::kSquaredReLU: launch<Activation::kSquaredReLU>(a, stream); break;
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe
