// SavedState and the default device allocator (see include/moe/saved_state.h).
#include "moe/saved_state.h"

#include <atomic>

#include <cuda_runtime_api.h>

#include "device/cuda_check.h"
#include "moe/error.h"

namespace moe {

namespace {

class CudaMallocAllocator final : public DeviceAllocator {
 public:
  DeviceBuffer allocate(size_t bytes) override {
    void* p = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&p, bytes == 0 ? 1 : bytes));
    return DeviceBuffer(p, [](void* q) { cudaFree(q); });
  }
};

}  // namespace

DeviceAllocator& cuda_malloc_allocator() {
  static CudaMallocAllocator a;
  return a;
}

const char* state_status_name(StateStatus s) {
  switch (s) {
    case StateStatus::kEmpty: return "empty";
    case StateStatus::kFilled: return "filled by a forward";
    case StateStatus::kAwaitingWgrad: return "awaiting backward_dw";
    case StateStatus::kConsumed: return "consumed by its backward";
  }
  return "invalid";
}

uint64_t next_op_serial() {
  static std::atomic<uint64_t> serial{0};
  return ++serial;
}

SavedState SavedState::allocate(size_t device_bytes, int headers, DeviceAllocator& allocator) {
  MOE_CHECK(headers >= 1, "argument 'headers': expected >= 1, got ", headers);
  SavedState s;
  s.device_owner_ = allocator.allocate(device_bytes);
  MOE_CHECK(s.device_owner_ != nullptr || device_bytes == 0, "argument 'allocator': returned no memory for ",
            device_bytes, " bytes");
  MOE_CHECK(reinterpret_cast<uintptr_t>(s.device_owner_.get()) % 256 == 0, "argument 'allocator': returned memory ",
            "that is not 256-byte aligned");
  s.device_ = s.device_owner_.get();
  s.device_bytes_ = device_bytes;
  s.host_owner_ = std::shared_ptr<StateHeader>(new StateHeader[headers](), std::default_delete<StateHeader[]>());
  s.headers_ = s.host_owner_.get();
  s.header_count_ = headers;
  return s;
}

SavedState SavedState::borrow(void* device, size_t device_bytes, StateHeader* headers, int header_count) {
  MOE_CHECK(headers != nullptr && header_count >= 1, "argument 'headers': expected at least one host header");
  MOE_CHECK(device != nullptr || device_bytes == 0, "argument 'device': expected device memory for ", device_bytes,
            " bytes, got null");
  MOE_CHECK(reinterpret_cast<uintptr_t>(device) % 256 == 0, "argument 'device': expected 256-byte aligned memory");
  SavedState s;
  s.device_ = device;
  s.device_bytes_ = device_bytes;
  s.headers_ = headers;
  s.header_count_ = header_count;
  return s;
}

StateHeader& SavedState::header(int i) const {
  MOE_CHECK(headers_ != nullptr, "argument 'state': the saved state is undefined (make it with the op's new_state)");
  MOE_CHECK(i >= 0 && i < header_count_, "saved state: header ", i, " of ", header_count_, " requested");
  return headers_[i];
}

StateStatus SavedState::status() const { return static_cast<StateStatus>(header(0).status); }

void SavedState::reset() {
  for (int i = 0; i < header_count_; ++i) headers_[i] = StateHeader{};
}

SavedState SavedState::slice(size_t device_offset, size_t device_bytes, int first_header, int header_count) const {
  // Compared by subtraction, so that no sum can wrap around and pass.
  MOE_CHECK(device_offset <= device_bytes_ && device_bytes <= device_bytes_ - device_offset && first_header >= 0 &&
                first_header < header_count_ && header_count >= 1 && header_count <= header_count_ - first_header,
            "saved state: slice outside the state");
  SavedState s = *this;
  s.device_ = static_cast<char*>(device_) + device_offset;
  s.device_bytes_ = device_bytes;
  s.headers_ = headers_ + first_header;
  s.header_count_ = header_count;
  return s;
}

}  // namespace moe
