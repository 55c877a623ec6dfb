#include "device/pointer_table.h"

#include <algorithm>

#include <cuda_runtime_api.h>

#include "device/cuda_check.h"

namespace moe {

std::shared_ptr<void> upload_pointer_table(const std::vector<const void*>& pointers) {
  void* table = nullptr;
  const size_t bytes = std::max<size_t>(pointers.size(), 1) * sizeof(void*);
  MOE_CUDA_CHECK(cudaMalloc(&table, bytes));
  std::shared_ptr<void> owner(table, [](void* p) { cudaFree(p); });
  if (!pointers.empty())
    MOE_CUDA_CHECK(cudaMemcpy(table, pointers.data(), pointers.size() * sizeof(void*), cudaMemcpyHostToDevice));
  return owner;
}

}  // namespace moe
