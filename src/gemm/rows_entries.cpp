// The rows GEMM (src/fused/rows_gemm.h) as GroupedGemm configurations of the bf16 fprop and dgrad:
// our own persistent kernel that reads the token rows in place and the weights through one tensor
// map, in three schedules. GroupedGemm hands it the operands themselves (GroupedArgs::contiguous)
// and skips the prep kernel; calls it cannot take (per-expert weight tables, more than 4096
// experts, no rows) run the heuristic's CUTLASS kernel instead.
#include "fused/rows_gemm.h"
#include "gemm/grouped_kernel.h"

namespace moe::gemm {
namespace {

template <Op kOp, fused::RowsGemmSchedule kSchedule>
void run_rows(const GroupedArgs& a, cudaStream_t stream) {
  static_assert(kOp == Op::kFprop || kOp == Op::kDgrad, "the rows GEMM computes the token-side products");
  const GroupedArgs::Contiguous& c = a.contiguous;
  fused::RowsGemmArgs r;
  r.a = c.a;
  r.R = c.rows;
  // fprop Y = X W^T reduces over K into N columns; dgrad dX = dY W over N into K columns.
  r.red = static_cast<int>(kOp == Op::kFprop ? c.K : c.N);
  r.out = static_cast<int>(kOp == Op::kFprop ? c.N : c.K);
  r.b = c.weights;
  r.b_out_major = kOp == Op::kFprop;
  r.d = c.d;
  r.group_offsets = c.offsets;
  r.experts = a.groups;
  r.error_word = c.error_word;
  r.a_row_begin = c.a_row_begin;
  r.a_rows = c.a_rows;
  r.sm_count = a.sm_count;
  r.schedule = kSchedule;
  fused::launch_rows_gemm(r, stream);
}

size_t no_workspace(int, int) { return 0; }

template <Op kOp, fused::RowsGemmSchedule kSchedule>
KernelEntry rows_entry(const char* name) {
  KernelEntry e{{kOp, DType::kBF16, DType::kBF16, false}, name, &run_rows<kOp, kSchedule>, &no_workspace,
                /*tile_runs=*/false, /*weight_scale_rows=*/0};
  e.contiguous_rows = true;
  return e;
}

}  // namespace

const KernelEntry& entry_fprop_rows_coop_128x256x64_c2x1() {
  static const KernelEntry e =
      rows_entry<Op::kFprop, fused::RowsGemmSchedule::kCooperative>("rows_coop_128x256x64_c2x1");
  return e;
}
const KernelEntry& entry_fprop_rows_pong_64x256x64_c2x1() {
  static const KernelEntry e = rows_entry<Op::kFprop, fused::RowsGemmSchedule::kPingPong>("rows_pong_64x256x64_c2x1");
  return e;
}
const KernelEntry& entry_fprop_rows_pong_128x192x64_c2x1() {
  static const KernelEntry e =
      rows_entry<Op::kFprop, fused::RowsGemmSchedule::kPingPong128x192>("rows_pong_128x192x64_c2x1");
  return e;
}
const KernelEntry& entry_dgrad_rows_coop_128x256x64_c2x1() {
  static const KernelEntry e =
      rows_entry<Op::kDgrad, fused::RowsGemmSchedule::kCooperative>("rows_coop_128x256x64_c2x1");
  return e;
}
const KernelEntry& entry_dgrad_rows_pong_64x256x64_c2x1() {
  static const KernelEntry e = rows_entry<Op::kDgrad, fused::RowsGemmSchedule::kPingPong>("rows_pong_64x256x64_c2x1");
  return e;
}
const KernelEntry& entry_dgrad_rows_pong_128x192x64_c2x1() {
  static const KernelEntry e =
      rows_entry<Op::kDgrad, fused::RowsGemmSchedule::kPingPong128x192>("rows_pong_128x192x64_c2x1");
  return e;
}

}  // namespace moe::gemm
