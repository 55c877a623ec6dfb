// wgrad, cooperative 128x256x64, cluster 2x1x1, fp32 output written or added into main_grad
// (beta = 1, C = D), each consumer warp group storing its own 64 rows of the tile
// (warp_group_store_epilogue.cuh). Taken for main_grad accumulation, where it skips CUTLASS's load
// of C (tile_heuristic.cpp).
#include "gemm/sm90_grouped_kernel.cuh"
#include "gemm/warp_group_store_epilogue.cuh"

MOE_GROUPED_KERNEL(entry_wgrad_coop_128x256x64_c2x1_f32_wgstores, "coop_128x256x64_c2x1_wgstores", Op::kWgrad,
                   Sm90Gemm<Bf16Operands<Op::kWgrad>, float, float, cute::Shape<cute::_128, cute::_256, cute::_64>,
                            cute::Shape<cute::_2, cute::_1, cute::_1>, Cooperative,
                            cutlass::epilogue::collective::EpilogueTileAuto, WarpGroupStores>)
