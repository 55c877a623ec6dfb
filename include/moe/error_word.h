// Owner of the device-side error word (docs/semantics.md, Errors). Kernels OR ErrorBits into
// device_ptr(); check() reads and clears it -- it synchronises the stream, so call it outside CUDA
// graphs.
#pragma once

#include <cstdint>

#include <cuda_runtime_api.h>

namespace moe {

class ErrorWord {
 public:
  ErrorWord();   // allocates one zeroed uint32 on the current device
  ~ErrorWord();
  ErrorWord(const ErrorWord&) = delete;
  ErrorWord& operator=(const ErrorWord&) = delete;

  uint32_t* device_ptr() const { return word_; }
  // Reads the bits raised so far (syncs `stream`) and clears them.
  uint32_t fetch_and_clear(cudaStream_t stream);
  // fetch_and_clear, then throws moe::Error describing the bits if any were raised.
  void check(cudaStream_t stream);
  // Throws moe::Error describing `bits` when any is set (for bits gathered from several words).
  static void raise(uint32_t bits);

 private:
  uint32_t* word_ = nullptr;
};

}  // namespace moe
