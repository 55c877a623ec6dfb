// One device allocation carved into 256-byte aligned pieces: the dispatcher and the layer plan all
// of their memory at construction (docs/semantics.md, Graph safety) and never allocate afterwards.
#pragma once

#include <cstddef>
#include <cstdint>

namespace moe {

class DeviceArena {
 public:
  // Two passes: first with base == nullptr to measure, then with the real allocation.
  explicit DeviceArena(char* base) : base_(base) {}
  template <typename T>
  T* take(int64_t count) {
    T* p = base_ ? reinterpret_cast<T*>(base_ + used_) : nullptr;
    used_ += (static_cast<size_t>(count) * sizeof(T) + 255) / 256 * 256;
    return p;
  }
  size_t used() const { return used_; }

 private:
  char* base_;
  size_t used_ = 0;
};

}  // namespace moe
