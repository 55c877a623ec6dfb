#include "support/gpu.h"

namespace moe::testing {

bool gpu_available() {
  static const bool available = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();  // clear the sticky "no device" error
      return false;
    }
    return n > 0;
  }();
  return available;
}

}  // namespace moe::testing
