// Interleaved timing of several kernels that compete for the same clock (bench_grouped_gemm,
// bench_fused): GPU clocks on the H100 and H200 follow the power draw, so back-to-back measurements
// of different kernels drift by up to ~10%. Every candidate of one measurement is therefore timed
// in rounds: after a warm-up, each round times one batch (>= ~4 ms) of every candidate in rotating
// order, and the median per-launch time over the rounds is reported.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace moe::bench {

// A device allocation freed on scope exit (benchmark buffers; at least 16 bytes).
struct DeviceMem {
  void* p = nullptr;
  explicit DeviceMem(size_t bytes);
  ~DeviceMem();
  DeviceMem(const DeviceMem&) = delete;
  DeviceMem& operator=(const DeviceMem&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(p); }
};

// Fills n bf16 values with uniform values in [-1, 1) from a hash of the index and `seed`: cheap,
// deterministic, no host transfer.
void fill_bf16_uniform(void* p, int64_t n, uint32_t seed, cudaStream_t stream);

// One thing to time: a function that enqueues work on the stream, optionally replayed from a CUDA
// graph captured once.
struct Candidate {
  std::string label;
  std::function<void()> fn;
  bool graph = false;
};

// Median milliseconds per call of each candidate over `rounds` interleaved rounds (see above).
std::vector<double> interleaved_ms(const std::vector<Candidate>& cands, cudaStream_t stream, int rounds,
                                   double batch_ms = 4.0, double warmup_ms = 60.0);

// TFLOP/s of `flops` in `ms` milliseconds (0 for a zero time).
inline double tflops(double flops, double ms) { return ms > 0 ? flops / (ms * 1e-3) / 1e12 : 0.0; }

}  // namespace moe::bench
