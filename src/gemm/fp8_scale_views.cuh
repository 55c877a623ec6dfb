// The shared-memory block scales of CUTLASS's FP8 block-scaled collective as the promotion main
// loops read them (fp8_overlapped_promotion.cuh, fp8_wide_tile_promotion.cuh): each operand's
// scales as a (BLK_M, BLK_N, (BLK_K, PIPE)) view broadcast over the other operand's mode, so that
// the tiled MMA partitions them like the accumulator.
#pragma once

#include <cute/tensor.hpp>

namespace moe::gemm {

template <class Base, class TensorStorage>
CUTE_DEVICE auto a_scale_view(TensorStorage& shared_tensors) {
  using namespace cute;
  using L = typename Base::SmemLayoutSFA;
  return make_tensor(make_smem_ptr(shared_tensors.smem_SFA.data()),
                     make_layout(make_shape(shape<0>(L{}), get<1>(typename Base::TileShape{}),
                                            make_shape(shape<1>(L{}), shape<2>(L{}))),
                                 make_stride(stride<0>(L{}), _0{}, make_stride(stride<1>(L{}), stride<2>(L{})))));
}

template <class Base, class TensorStorage>
CUTE_DEVICE auto b_scale_view(TensorStorage& shared_tensors) {
  using namespace cute;
  using L = typename Base::SmemLayoutSFB;
  return make_tensor(make_smem_ptr(shared_tensors.smem_SFB.data()),
                     make_layout(make_shape(get<0>(typename Base::TileShape{}), shape<0>(L{}),
                                            make_shape(shape<1>(L{}), shape<2>(L{}))),
                                 make_stride(_0{}, stride<0>(L{}), make_stride(stride<1>(L{}), stride<2>(L{})))));
}

}  // namespace moe::gemm
