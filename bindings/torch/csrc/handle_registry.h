// Library objects that own device workspace (a layer, a dispatcher) live in C++ and are named from
// Python by an integer handle, so the operators stay plain TORCH_LIBRARY ops (traceable by
// torch.compile: the handle is a constant of the graph).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>

#include <c10/util/Exception.h>

namespace moe::torch_ext {

template <typename T>
class HandleRegistry {
 public:
  int64_t add(std::unique_ptr<T> obj) {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t h = next_++;
    objects_[h] = std::move(obj);
    return h;
  }
  T& get(int64_t h) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = objects_.find(h);
    TORCH_CHECK_VALUE(it != objects_.end(), "moe_engine: unknown or destroyed handle ", h);
    return *it->second;
  }
  void remove(int64_t h) {
    std::lock_guard<std::mutex> lock(mu_);
    objects_.erase(h);
  }

 private:
  std::mutex mu_;
  int64_t next_ = 1;
  std::unordered_map<int64_t, std::unique_ptr<T>> objects_;
};

}  // namespace moe::torch_ext
