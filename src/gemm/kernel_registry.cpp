// The compiled kernel configurations. Each CUTLASS one lives in its own .cu (one instantiation per
// translation unit), the rows GEMM's in rows_entries.cpp; this list is the only place that names
// them all.
#include <cstring>

#include "gemm/grouped_kernel.h"

namespace moe::gemm {

const KernelEntry& entry_fprop_coop_128x256x64_c2x1();
const KernelEntry& entry_fprop_coop_128x256x64_c1x2();
const KernelEntry& entry_fprop_pong_128x128x64_c1x2();
const KernelEntry& entry_fprop_pong_128x192x64_c2x1();
const KernelEntry& entry_fprop_pong_128x192x64_c1x2();
const KernelEntry& entry_dgrad_coop_128x256x64_c2x1();
const KernelEntry& entry_dgrad_coop_128x256x64_c1x2();
const KernelEntry& entry_dgrad_pong_128x128x64_c2x1();
const KernelEntry& entry_dgrad_pong_128x192x64_c2x1();
const KernelEntry& entry_dgrad_pong_128x192x64_c1x2();
const KernelEntry& entry_fprop_rows_coop_128x256x64_c2x1();
const KernelEntry& entry_fprop_rows_pong_64x256x64_c2x1();
const KernelEntry& entry_fprop_rows_pong_128x192x64_c2x1();
const KernelEntry& entry_dgrad_rows_coop_128x256x64_c2x1();
const KernelEntry& entry_dgrad_rows_pong_64x256x64_c2x1();
const KernelEntry& entry_dgrad_rows_pong_128x192x64_c2x1();
const KernelEntry& entry_wgrad_coop_128x256x64_c2x1();
const KernelEntry& entry_wgrad_coop_128x256x64_c2x1_f32();
const KernelEntry& entry_wgrad_coop_128x256x64_c2x1_f32_wgstores();
const KernelEntry& entry_fp8_fprop_coop_128x128x128_c1x2();
const KernelEntry& entry_fp8_fprop_coop_128x192x128_c2x1();
const KernelEntry& entry_fp8_wgrad_coop_128x128x128_c2x1();
const KernelEntry& entry_fp8_wgrad_coop_128x128x128_c2x1_f32();
const KernelEntry& entry_fp8_wgrad_coop_128x128x128_c2x1_f32_wgstores();

const KernelEntry* const* kernel_registry(int* count) {
  static const KernelEntry* const entries[] = {
      &entry_fprop_coop_128x256x64_c2x1(),
      &entry_fprop_coop_128x256x64_c1x2(),
      &entry_fprop_pong_128x128x64_c1x2(),
      &entry_fprop_pong_128x192x64_c2x1(),
      &entry_fprop_pong_128x192x64_c1x2(),
      &entry_dgrad_coop_128x256x64_c2x1(),
      &entry_dgrad_coop_128x256x64_c1x2(),
      &entry_dgrad_pong_128x128x64_c2x1(),
      &entry_dgrad_pong_128x192x64_c2x1(),
      &entry_dgrad_pong_128x192x64_c1x2(),
      &entry_fprop_rows_coop_128x256x64_c2x1(),
      &entry_fprop_rows_pong_64x256x64_c2x1(),
      &entry_fprop_rows_pong_128x192x64_c2x1(),
      &entry_dgrad_rows_coop_128x256x64_c2x1(),
      &entry_dgrad_rows_pong_64x256x64_c2x1(),
      &entry_dgrad_rows_pong_128x192x64_c2x1(),
      &entry_wgrad_coop_128x256x64_c2x1(),
      &entry_wgrad_coop_128x256x64_c2x1_f32(),
      &entry_wgrad_coop_128x256x64_c2x1_f32_wgstores(),
      &entry_fp8_fprop_coop_128x128x128_c1x2(),
      &entry_fp8_fprop_coop_128x192x128_c2x1(),
      &entry_fp8_wgrad_coop_128x128x128_c2x1(),
      &entry_fp8_wgrad_coop_128x128x128_c2x1_f32(),
      &entry_fp8_wgrad_coop_128x128x128_c2x1_f32_wgstores(),
  };
  *count = static_cast<int>(sizeof(entries) / sizeof(entries[0]));
  return entries;
}

const KernelEntry* find_kernel(Op op, DType ab, DType out, bool accumulate, const char* name) {
  int n = 0;
  const KernelEntry* const* all = kernel_registry(&n);
  for (int i = 0; i < n; ++i) {
    const KernelCaps& c = all[i]->caps;
    if (c.op == op && c.ab == ab && c.out == out && (!accumulate || c.can_accumulate) &&
        std::strcmp(all[i]->name, name) == 0)
      return all[i];
  }
  return nullptr;
}

}  // namespace moe::gemm
