// Forward activation x prob: out[r, :] = act(h[r, :]) * p[r], bf16 in/out, fp32 math.
// Bandwidth-bound: a warp per two rows, 16-byte loads and stores, nothing stored but the output.
#include <cuda_bf16.h>

#include "kernels/activation_args.h"
#include "kernels/activation_math.cuh"
#include "device/cuda_check.h"
#include "moe/activation_ops.h"

namespace moe {
namespace kernels {
namespace {

struct ForwardArgs {
  const __nv_bfloat16* h;
  const float* probs;           // null: scale 1
  const int32_t* group_offsets;  // null: all R rows
  int groups;
  int64_t R;
  int F;
  int interleave;
  ActConsts c;
  __nv_bfloat16* out;
};

// Each warp takes two adjacent rows and issues both rows' loads before computing: twice the bytes
// in flight per warp and half the per-row overhead (the dependent group_offsets / probs reads), which
// matters for small F (F = 256: one 16-byte vector per lane per row).
constexpr int kRowsPerWarp = 2;
constexpr int kRowsPerBlock = kActRowsPerBlock * kRowsPerWarp;

template <Activation A, bool kProbs>
__global__ void __launch_bounds__(kActThreads) activation_forward_kernel(const ForwardArgs a) {
  constexpr bool kGated = A != Activation::kSquaredReLU;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kActRowsPerBlock + threadIdx.x / 32) * kRowsPerWarp;
  const int lane = threadIdx.x % 32;
  const int64_t valid = valid_rows(a.group_offsets, a.groups, a.R);
  if (first >= valid) return;
  const int rows = valid - first < kRowsPerWarp ? static_cast<int>(valid - first) : kRowsPerWarp;
  const int F = a.F;
  const int64_t in_cols = kGated ? 2 * F : F;
  float p[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) p[r] = (kProbs && r < rows) ? a.probs[first + r] : 1.0f;
  for (int j = lane * kVec; j < F; j += 32 * kVec) {
    const int cg = kGated ? gate_col(j, F, a.interleave) : j;
    const int cl = kGated ? linear_col(j, F, a.interleave) : 0;
    float g[kRowsPerWarp][kVec], l[kRowsPerWarp][kVec];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (r >= rows) break;
      const __nv_bfloat16* __restrict__ hr = a.h + (first + r) * in_cols;
      if (kGated && a.interleave == 1) {
        load_glu_alternating(hr, j, g[r], l[r]);
      } else {
        load_bf16x8(hr + cg, g[r]);
        if (kGated) load_bf16x8(hr + cl, l[r]);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      if (r >= rows) break;
      float o[kVec];
#pragma unroll
      for (int i = 0; i < kVec; ++i) o[i] = ActOp<A>::value(g[r][i], kGated ? l[r][i] : 0.0f, a.c) * p[r];
      store_bf16x8(a.out + (first + r) * F + j, o);
    }
  }
}

template <Activation A>
void launch(const ForwardArgs& a, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>((a.R + kRowsPerBlock - 1) / kRowsPerBlock));
  if (a.probs != nullptr)
    activation_forward_kernel<A, true><<<grid, kActThreads, 0, stream>>>(a);
  else
    activation_forward_kernel<A, false><<<grid, kActThreads, 0, stream>>>(a);
}

}  // namespace
}  // namespace kernels

void activation_forward(const ActivationParams& params, const TensorView& h, const TensorView& probs,
                        const TensorView& group_offsets, const TensorView& out, cudaStream_t stream) {
  using namespace kernels;
  const ActivationDims d = check_activation_args(params, h, probs, group_offsets, out, "out");
  if (d.R == 0) return;
  ForwardArgs a;
  a.h = h.ptr<const __nv_bfloat16>();
  a.probs = is_absent(probs) ? nullptr : probs.ptr<const float>();
  a.group_offsets = is_absent(group_offsets) ? nullptr : group_offsets.ptr<const int32_t>();
  a.groups = d.groups;
  a.R = d.R;
  a.F = static_cast<int>(d.F);
  a.interleave = params.glu_interleave;
  a.c = ActConsts{params.alpha, params.limit, params.offset};
  a.out = out.ptr<__nv_bfloat16>();
  switch (params.kind) {
    case Activation::kSwiGLU: launch<Activation::kSwiGLU>(a, stream); break;
    case Activation::kGeGLU: launch<Activation::kGeGLU>(a, stream); break;
    case Activation::kClampedSwiGLU: launch<Activation::kClampedSwiGLU>(a, stream); break;
    case Activation::kSquaredReLU: launch<Activation::kSquaredReLU>(a, stream); break;
  }
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe
