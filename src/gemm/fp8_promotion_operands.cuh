// What a consumer thread of the FP8 promotion main loops (fp8_overlapped_promotion.cuh,
// fp8_wide_tile_promotion.cuh) works on, built from the shared memory of CUTLASS's FP8 block-scaled
// collective: its warp group's WGMMA operand fragments over the pipeline stages, and each operand's
// block scales as a (BLK_M, BLK_N, (BLK_K, PIPE)) view broadcast over the other operand's mode,
// partitioned like the accumulator, with a register fragment for one stage.
#pragma once

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>

namespace moe::gemm {

// The barrier of one consumer warp group (128 threads, a user named barrier per group) that orders
// the scale reads of all its warps before the stage is released: CUTLASS's pipeline lets only two
// threads of a warp group arrive on a stage's empty barrier (one per CTA of the cluster), and
// nothing else orders the other warps' shared-memory reads before the producer's next copies into
// that stage.
struct ScalesReadBarrier {
  CUTE_DEVICE explicit ScalesReadBarrier(int thread_idx)
      : id(uint32_t(thread_idx / cutlass::NumThreadsPerWarpGroup)) {}
  CUTE_DEVICE void sync() const { cutlass::arch::NamedBarrier::sync(cutlass::NumThreadsPerWarpGroup, id); }
  uint32_t id;
};

// Returns (tCrA, tCrB, tCsSFA, tCsSFB, tCrSFA, tCrSFB):
//   tCrA, tCrB      (MMA, MMA_M / MMA_N, MMA_K, PIPE) operand descriptors
//   tCsSFA, tCsSFB  (MMA, MMA_M, MMA_N, (MMA_K, PIPE)) scales in shared memory
//   tCrSFA, tCrSFB  (MMA, MMA_M, MMA_N) one stage's scales in registers
template <class Base, class TensorStorage>
CUTE_DEVICE auto promotion_operands(TensorStorage& shared_tensors, int thread_idx) {
  using namespace cute;
  using TileShape = typename Base::TileShape;
  using TiledMma = typename Base::TiledMma;
  using LA = typename Base::SmemLayoutSFA;
  using LB = typename Base::SmemLayoutSFB;
  Tensor sA = make_tensor(make_smem_ptr(shared_tensors.smem_A.data()), typename Base::SmemLayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(shared_tensors.smem_B.data()), typename Base::SmemLayoutB{});
  Tensor sSFA = make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()),
                            make_layout(make_shape(shape<0>(LA{}), get<1>(TileShape{}), make_shape(shape<1>(LA{}), shape<2>(LA{}))),
                                        make_stride(stride<0>(LA{}), _0{}, make_stride(stride<1>(LA{}), stride<2>(LA{})))));
  Tensor sSFB = make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()),
                            make_layout(make_shape(get<0>(TileShape{}), shape<0>(LB{}), make_shape(shape<1>(LB{}), shape<2>(LB{}))),
                                        make_stride(_0{}, stride<0>(LB{}), make_stride(stride<1>(LB{}), stride<2>(LB{})))));

  constexpr int kWarpGroups = size(TiledMma{}) / cutlass::NumThreadsPerWarpGroup;
  const Layout group_layout = make_layout(Int<kWarpGroups>{}, Int<cutlass::NumThreadsPerWarpGroup>{});
  const int group = __shfl_sync(0xffffffff, thread_idx / cutlass::NumThreadsPerWarpGroup, 0);
  TiledMma tiled_mma;
  auto thread_mma = tiled_mma.get_slice(group_layout(group));
  Tensor tCsSFA = tiled_mma.get_slice(thread_idx).partition_C(sSFA);
  Tensor tCsSFB = tiled_mma.get_slice(thread_idx).partition_C(sSFB);
  Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));
  Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));
  Tensor tCrSFA = make_tensor_like<typename Base::ElementBlockScale>(tCsSFA(_, _, _, _0{}));
  Tensor tCrSFB = make_tensor_like<typename Base::ElementBlockScale>(tCsSFB(_, _, _, _0{}));
  return cute::make_tuple(tCrA, tCrB, tCsSFA, tCsSFB, tCrSFA, tCrSFB);
}

}  // namespace moe::gemm
