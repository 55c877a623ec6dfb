// Internal interface between the GroupedGemm front end and the CUTLASS kernel configurations.
// Plain C++ only: every configuration lives in its own .cu (one CUTLASS instantiation per
// translation unit keeps compile time and memory bounded) behind a KernelEntry.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime_api.h>

#include "moe/dtype.h"

namespace moe::gemm {

// The three products of the experts. Their operand layouts (CUTLASS tags) are fixed per op:
//   fprop  Y  = X  W^T : A = X  row-major (K-major), B = W  [N,K] K-major,  D row-major
//   dgrad  dX = dY W   : A = dY row-major (K-major), B = W  [N,K] N-major,  D row-major
//   wgrad  dW = dY^T X : A = dY M-major,             B = X  [m,K] N-major,  D row-major, K = m ragged
// FP8 configurations are all "TN" (both operands K-major, sm90_grouped_kernel.cuh): the fprop-op
// kernel also runs dgrad on the weights' columnwise copy, the wgrad-op kernel reads the tokens'
// columnwise copies (A = dY^T [N, m], B = X^T [K, m]).
enum class Op : uint8_t { kFprop, kDgrad, kWgrad };


// Device argument arrays of one grouped launch, filled by the prep kernel (grouped_gemm_prep.h).
// Every stride type of the pointer-array kernels we instantiate has exactly one dynamic member, an
// int64 leading dimension (checked by static_assert in each configuration), so stride arrays are
// plain int64 arrays here.
struct GroupedArgs {
  int groups = 0;
  const int32_t* problem_shapes = nullptr;  // [groups][3] (M, N, K) of each GEMM
  const void* const* ptr_a = nullptr;
  const int64_t* ld_a = nullptr;
  const void* const* ptr_b = nullptr;
  const int64_t* ld_b = nullptr;
  const void* const* ptr_c = nullptr;  // fp32 kernels only (C = D for accumulation); may be unused when beta = 0
  const int64_t* ld_c = nullptr;
  void* const* ptr_d = nullptr;
  const int64_t* ld_d = nullptr;
  const float* const* ptr_sfa = nullptr;  // FP8 only: each group's scale_inv of A and B
  const float* const* ptr_sfb = nullptr;
  // FP8 fprop form: 0 when the token scales are K-major ([rows, blocks], ptr_sfa at each group's
  // first row), else their MN-major leading dimension ([blocks, ld], ptr_sfa at the group's first
  // column).
  int64_t a_scale_mn_ld = 0;
  float alpha = 1.0f;
  float beta = 0.0f;  // fp32 kernels: 1 accumulates into D
  int sm_count = 0;
  bool raster_along_n = false;  // tile order of the persistent scheduler inside each group
  int tile_run = 1;             // consecutive cluster tiles per visit (run_group_scheduler.cuh); 1 = round-robin
  void* workspace = nullptr;    // fixed address, at least workspace_bytes(groups, sm_count)
  // The operands themselves, for the kernels that read the token rows in place and take no
  // per-group argument arrays (KernelEntry::contiguous_rows): a [rows, .] (or [a_rows, .] with
  // windows) and d [rows, .] at their first row, the experts' matrices one contiguous [groups, N, K]
  // tensor (the op's N and K: fprop reads it as [out, red], dgrad as [red, out]).
  struct Contiguous {
    const void* a = nullptr;
    const void* weights = nullptr;
    void* d = nullptr;
    const int32_t* offsets = nullptr;  // [groups + 1]
    int64_t rows = 0;
    int64_t N = 0, K = 0;
    uint32_t* error_word = nullptr;       // optional: kErrBadGroupOffsets
    const int32_t* a_row_begin = nullptr;  // optional windows (GemmProblem::a_row_begin)
    int64_t a_rows = 0;
  } contiguous;
};

// What a compiled kernel can do -- the registry's key. Derived from the kernel's own types (see
// MOE_GROUPED_KERNEL), so it cannot disagree with what was compiled.
struct KernelCaps {
  Op op;
  DType ab;              // operand dtype
  DType out;             // D dtype
  bool can_accumulate;   // reads C = D with beta = 1 (fp32 main_grad accumulation)
};

struct KernelEntry {
  KernelCaps caps;
  const char* name;  // e.g. "coop_128x256x64_c2x1"
  // Enqueues the grouped GEMM on `stream`; throws moe::Error if CUTLASS rejects the arguments.
  void (*run)(const GroupedArgs& args, cudaStream_t stream);
  size_t (*workspace_bytes)(int groups, int sm_count);
  bool tile_runs;  // takes GroupedArgs::tile_run > 1 (otherwise CUTLASS's round-robin order only)
  // FP8 fprop form: rows of B per weight scale the kernel reads. 128: the 128 x 128 blocks' scales
  // as given; 64: each restated for both 64-row halves (GroupedGemm writes that copy per call), so
  // that a 192-wide tile holds whole scale blocks. 0 for bf16 kernels, 1 for the FP8 wgrad form.
  int weight_scale_rows;
  // Reads GroupedArgs::contiguous instead of the prep kernel's argument arrays: bf16 fprop / dgrad
  // on one contiguous weight tensor (src/gemm/rows_entries.cpp); GroupedGemm runs the heuristic's
  // kernel for any other call.
  bool contiguous_rows = false;
};

// Every compiled configuration (kernel_registry.cpp).
const KernelEntry* const* kernel_registry(int* count);
// The entry named `name` that does `op` on `ab` operands into `out` (and accumulates, when asked),
// or nullptr.
const KernelEntry* find_kernel(Op op, DType ab, DType out, bool accumulate, const char* name);

}  // namespace moe::gemm
