// MOE_FUSED_HD marks the fused kernels' arithmetic that the CPU tests share (row_tile_numbering.h,
// wgrad_schedule.h): forced inline on the device, plain inline in host-only translation units.
#pragma once

#if defined(__CUDACC__)
#define MOE_FUSED_HD __host__ __device__ __forceinline__
#else
#define MOE_FUSED_HD inline
#endif
