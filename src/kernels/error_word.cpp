#include "moe/error_word.h"

#include "device/cuda_check.h"
#include "moe/device_errors.h"

namespace moe {

ErrorWord::ErrorWord() {
  MOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&word_), sizeof(uint32_t)));
  MOE_CUDA_CHECK(cudaMemset(word_, 0, sizeof(uint32_t)));
}

ErrorWord::~ErrorWord() { cudaFree(word_); }

uint32_t ErrorWord::fetch_and_clear(cudaStream_t stream) {
  uint32_t bits = 0;
  MOE_CUDA_CHECK(cudaMemcpyAsync(&bits, word_, sizeof(bits), cudaMemcpyDeviceToHost, stream));
  MOE_CUDA_CHECK(cudaMemsetAsync(word_, 0, sizeof(uint32_t), stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  return bits;
}

void ErrorWord::check(cudaStream_t stream) {
  raise(fetch_and_clear(stream));
}

void ErrorWord::raise(uint32_t bits) {
  MOE_CHECK(bits == 0, "device error: ", describe_error_bits(bits));
}

}  // namespace moe
