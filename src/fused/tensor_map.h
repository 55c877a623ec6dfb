// TMA descriptors of the fused kernels: bf16 tensors read in 128-byte-swizzled boxes (the
// shared-memory layout the WGMMA reads), zeros past the edges.
#pragma once

#include <cstdint>

#include <cuda.h>

namespace moe::fused {

// `rank` dimensions, innermost first: dims[i] elements, strides[i] bytes between consecutive
// indices of dimension i + 1 (rank - 1 of them), box[i] elements per box. `who` names the caller
// in the error.
CUtensorMap bf16_tensor_map(const void* base, int rank, const uint64_t* dims, const uint64_t* strides,
                            const uint32_t* box, const char* who);

}  // namespace moe::fused
