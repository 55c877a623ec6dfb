// The grouped weight gradient with gathered rows (wgrad_gathered.h; design in docs/fused.md).
//
// One CTA per output tile (expert, 128-row block of M, 256-column block of N), 384 threads,
// warp-specialized like the fused fc1:
//   * warp group 0 (producer) walks the expert's rows 64 at a time. Per stage it copies the 64 dY
//     rows (128 columns each) and the 64 X rows (256 columns each) with 16-byte cp.async into a
//     4-stage ring of 128-byte-swizzled, MN-major shared-memory tiles; the X rows come straight
//     from x through the dispatch map (a row's source index is read one stage ahead), rows past the
//     group and padding rows are zero-filled.
//   * warp groups 1 and 2 (consumers) run WGMMA 64x256x16 with both operands MN-major (the reduced
//     dimension, rows, is the slow one in both tiles) on M rows 0-63 and 64-127, and write or
//     accumulate the fp32 result.
// The rows of one expert differ in number from expert to expert, so the grid has one CTA per tile
// and the hardware balances them (a long expert's tiles do not hold up a persistent loop).
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/bfloat16.h>

#include "device/cuda_check.h"
#include "device/device_groups.cuh"
#include "fused/async_copy.cuh"
#include "fused/wgrad_gathered.h"
#include "moe/error.h"

namespace moe::fused {
namespace {

using namespace cute;
using bf16 = cutlass::bfloat16_t;

constexpr int kBM = 128, kBN = 256, kBK = 64, kStages = 4;
constexpr int kProducerThreads = 128, kConsumerThreads = 256, kThreads = kProducerThreads + kConsumerThreads;
constexpr int kProducerRegs = 88, kConsumerRegs = 208;  // as in the fused fc1: 128 * 88 + 256 * 208 <= 64K
constexpr uint32_t kFullMask = 0xffffffffu;

// MN-major tiles: 64 consecutive M (or N) elements of one row are 128 contiguous bytes, eight rows
// make a 1024-byte swizzle atom. This is the layout WGMMA reads for a transposed operand.
using SmemAtom = GMMA::Layout_MN_SW128_Atom<bf16>;
using SmemLayoutA = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBM>{}, Int<kBK>{}, Int<kStages>{})));
using SmemLayoutB = decltype(tile_to_shape(SmemAtom{}, make_shape(Int<kBN>{}, Int<kBK>{}, Int<kStages>{})));
using TiledMma = decltype(make_tiled_mma(SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>{},
                                         Layout<Shape<_2, _1, _1>>{}));

// Byte offset of the 16-byte chunk holding elements (m .. m + 7, k) of stage `stage` of a tile:
// the unswizzled position from the layout's plain part, then the 128-byte swizzle, which acts on
// byte addresses (chunk bits 4-6 ^= row bits 7-9; the tiles are 1024-byte aligned).
template <class SmemLayout>
__device__ __forceinline__ uint32_t chunk_offset(int m, int k, int stage) {
  const uint32_t linear = 2u * static_cast<uint32_t>(SmemLayout{}.layout_b()(m, k, stage));
  return linear ^ ((linear >> 3) & 0x70u);
}

struct SharedStorage {
  alignas(1024) bf16 a[cosize_v<SmemLayoutA>];
  alignas(1024) bf16 b[cosize_v<SmemLayoutB>];
  alignas(8) uint64_t full[kStages];   // producer -> consumers: the stage's copies landed
  alignas(8) uint64_t empty[kStages];  // consumers -> producer: the stage's WGMMAs are done
};

struct Params {
  const __nv_bfloat16* dy;
  const __nv_bfloat16* x;
  const int32_t* row_slots;
  int slots;
  const int32_t* offsets;
  int E;
  int64_t R;
  int M, N;
  int m_tiles, n_tiles;
  char* dw_base;
  int64_t dw_stride;  // bytes
  void* const* dw_table;
  bool fp32, accumulate;
};

struct Tile {
  int e, m0, n0;
  int64_t begin, end;  // the expert's rows
};

__device__ __forceinline__ Tile decode_tile(const Params& p) {
  Tile t;
  const int per_expert = p.m_tiles * p.n_tiles;
  t.e = static_cast<int>(blockIdx.x / per_expert);
  const int local = static_cast<int>(blockIdx.x % per_expert);
  t.m0 = (local % p.m_tiles) * kBM;
  t.n0 = (local / p.m_tiles) * kBN;
  kernels::group_rows(p.offsets, t.e, p.R, &t.begin, &t.end);
  return t;
}

// Row of x holding permuted row r (-1: past the group or a padding row: zeros).
__device__ __forceinline__ int source_row(const Params& p, int64_t r, int64_t end) {
  if (r >= end) return -1;
  if (p.row_slots == nullptr) return static_cast<int>(r);
  const int slot = p.row_slots[r];
  return slot >= 0 ? slot / p.slots : -1;
}

__device__ void produce(SharedStorage& s, const Params& p, const Tile& t) {
  const int tid = threadIdx.x;  // 0..127
  const int warp = tid >> 5, lane = tid & 31;
  // dY: thread copies columns m .. m + 7 of rows (tid / 16) + 8 i; X: columns n .. n + 7 of rows
  // warp + 4 i (a warp moves two whole 512-byte row segments per instruction).
  static_assert(kBM == 128 && kBN == 256 && kProducerThreads == 128, "the copy mapping below covers these tiles");
  const int ma = (tid & 15) * 8, nb = lane * 8;
  const int m = t.m0 + ma, n = t.n0 + nb;
  const bool m_in = m < p.M, n_in = n < p.N;
  const uint32_t a_base = smem_u32(s.a), b_base = smem_u32(s.b);
  const int64_t rows = t.end - t.begin;
  const int k_blocks = static_cast<int>((rows + kBK - 1) / kBK);
  int stage = 0;
  uint32_t phase = 1;  // a fresh barrier counts as released for parity 1
  // Lanes 0..15 of each warp hold the source row of this warp's X rows warp + 4 lane, one k block
  // ahead of its copies (the index load's latency is off the copy path).
  int next_src = lane < 16 ? source_row(p, t.begin + warp + 4 * lane, t.end) : -1;
#pragma unroll 1
  for (int kb = 0; kb < k_blocks; ++kb) {
    const int src = next_src;
    if (kb + 1 < k_blocks && lane < 16) next_src = source_row(p, t.begin + (kb + 1) * kBK + warp + 4 * lane, t.end);
    cutlass::arch::ClusterBarrier::wait(&s.empty[stage], phase);
    const int64_t row0 = t.begin + static_cast<int64_t>(kb) * kBK;
#pragma unroll
    for (int i = 0; i < kBK / 8; ++i) {
      const int k = (tid >> 4) + 8 * i;
      const bool v = m_in && row0 + k < t.end;
      const uint32_t dst = a_base + chunk_offset<SmemLayoutA>(ma, k, stage);
      cp_async_16(dst, v ? p.dy + ((row0 + k) * p.M + m) : p.dy, v);
    }
#pragma unroll
    for (int i = 0; i < kBK / 4; ++i) {
      const int k = warp + 4 * i;
      const int row = __shfl_sync(kFullMask, src, i);
      const bool v = n_in && row >= 0;
      const uint32_t dst = b_base + chunk_offset<SmemLayoutB>(nb, k, stage);
      cp_async_16(dst, v ? p.x + (static_cast<int64_t>(row) * p.N + n) : p.x, v);
    }
    // Arrives on full[stage] once this thread's copies have landed.
    cutlass::arch::cpasync_barrier_arrive_noinc(&s.full[stage]);
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  cute::cp_async_wait<0>();
}

__device__ void consume(SharedStorage& s, const Params& p, const Tile& t) {
  const int ctid = threadIdx.x - kProducerThreads;
  const int lane = threadIdx.x & 31;
  TiledMma mma;
  Tensor sA = make_tensor(make_smem_ptr(s.a), SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(s.b), SmemLayoutB{});
  auto thr = mma.get_thread_slice(ctid);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, Shape<Int<kBM>, Int<kBN>>{});
  Tensor coord = thr.partition_C(make_identity_tensor(Shape<Int<kBM>, Int<kBN>>{}));

  const int k_blocks = static_cast<int>((t.end - t.begin + kBK - 1) / kBK);
  clear(acc);  // an empty group's gradient is zero
  mma.accumulate_ = GMMA::ScaleOut::One;
  int stage = 0;
  uint32_t phase = 0;
  int prev = -1;
  for (int kb = 0; kb < k_blocks; ++kb) {
    cutlass::arch::ClusterBarrier::wait(&s.full[stage], phase);
    cutlass::arch::fence_view_async_shared();  // cp.async (generic proxy) writes -> WGMMA reads
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
#pragma unroll
    for (int kk = 0; kk < size<2>(tCrA); ++kk) cute::gemm(mma, tCrA(_, _, kk, stage), tCrB(_, _, kk, stage), acc);
    warpgroup_commit_batch();
    warpgroup_wait<1>();  // the previous stage's WGMMAs are done: hand it back
    warpgroup_fence_operand(acc);
    if (prev >= 0) {
      __syncwarp();
      if (lane == 0) cutlass::arch::ClusterBarrier::arrive(&s.empty[prev]);
    }
    prev = stage;
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);

  // Epilogue: accumulator pairs (i, i + 1) are two adjacent columns of one row.
  if (p.accumulate && k_blocks == 0) return;  // main_grad keeps its value
  char* dw = p.dw_table != nullptr ? static_cast<char*>(p.dw_table[t.e]) : p.dw_base + t.e * p.dw_stride;
#pragma unroll
  for (int i = 0; i < size(acc); i += 2) {
    const int m = t.m0 + get<0>(coord(i)), n = t.n0 + get<1>(coord(i));
    if (m >= p.M || n >= p.N) continue;
    const int64_t at = static_cast<int64_t>(m) * p.N + n;
    if (p.fp32) {
      float2* q = reinterpret_cast<float2*>(dw) + at / 2;
      float2 v = make_float2(acc(i), acc(i + 1));
      if (p.accumulate) {
        const float2 old = *q;
        v.x += old.x;
        v.y += old.y;
      }
      *q = v;
    } else {
      reinterpret_cast<__nv_bfloat162*>(dw)[at / 2] = __floats2bfloat162_rn(acc(i), acc(i + 1));
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) wgrad_gathered_kernel(const __grid_constant__ Params p) {
  extern __shared__ uint8_t smem_raw[];
  // The swizzle is a function of the address bits: the tiles must start 1024-byte aligned.
  SharedStorage& s = *reinterpret_cast<SharedStorage*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  if (threadIdx.x == 32) {
    // full: every producer thread's cp.async arrival; empty: every consumer warp.
    for (int i = 0; i < kStages; ++i) {
      cutlass::arch::ClusterBarrier::init(&s.full[i], kProducerThreads);
      cutlass::arch::ClusterBarrier::init(&s.empty[i], kConsumerThreads / 32);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
  const Tile t = decode_tile(p);
  if (threadIdx.x < kProducerThreads) {
    cutlass::arch::warpgroup_reg_dealloc<kProducerRegs>();
    produce(s, p, t);
  } else {
    cutlass::arch::warpgroup_reg_alloc<kConsumerRegs>();
    consume(s, p, t);
  }
}

constexpr size_t kSmemBytes = 1024 + sizeof(SharedStorage);

}  // namespace

const char* wgrad_gathered_unsupported(int experts, int64_t M, int64_t N) {
  if (experts < 1) return "the gathered weight gradient needs at least one expert";
  if (M < 8 || M % 8 != 0 || N < 8 || N % 8 != 0) return "the gathered weight gradient needs M and N multiples of 8";
  if (M >= (int64_t(1) << 30) || N >= (int64_t(1) << 30)) return "the gathered weight gradient needs M, N < 2^30";
  const int64_t tiles = int64_t(experts) * ((M + kBM - 1) / kBM) * ((N + kBN - 1) / kBN);
  if (tiles >= (int64_t(1) << 31)) return "the gathered weight gradient needs fewer than 2^31 output tiles";
  return "";
}

void launch_wgrad_gathered(const WgradGatheredArgs& a, cudaStream_t stream) {
  const char* why = wgrad_gathered_unsupported(a.experts, a.M, a.N);
  MOE_CHECK(why[0] == '\0', "gathered wgrad: ", why);
  MOE_CHECK(!a.accumulate || a.dw_fp32, "gathered wgrad: accumulation needs an fp32 gradient");
  Params p;
  p.dy = static_cast<const __nv_bfloat16*>(a.dy);
  p.x = static_cast<const __nv_bfloat16*>(a.x);
  p.row_slots = a.row_slots;
  p.slots = a.slots;
  p.offsets = a.group_offsets;
  p.E = a.experts;
  p.R = a.R;
  p.M = a.M;
  p.N = a.N;
  p.m_tiles = (a.M + kBM - 1) / kBM;
  p.n_tiles = (a.N + kBN - 1) / kBN;
  p.dw_base = static_cast<char*>(a.dw_base);
  p.dw_stride = a.dw_stride_bytes;
  p.dw_table = a.dw_table;
  p.fp32 = a.dw_fp32;
  p.accumulate = a.accumulate;
  // Per launch: the attribute belongs to the current device (a cheap host call, fine while capturing).
  MOE_CUDA_CHECK(cudaFuncSetAttribute(wgrad_gathered_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(kSmemBytes)));
  const int64_t grid = int64_t(a.experts) * p.m_tiles * p.n_tiles;
  wgrad_gathered_kernel<<<static_cast<unsigned>(grid), kThreads, kSmemBytes, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH();
}

}  // namespace moe::fused
