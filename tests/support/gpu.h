// GPU test support: skip cleanly without a device, RAII device buffers, host<->device copies.
#pragma once

#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "device/cuda_check.h"

namespace moe::testing {

bool gpu_available();

// GTEST_SKIP (reported as SKIPPED, never as passed) when no CUDA device is usable.
#define MOE_REQUIRE_GPU()                                                           \
  do {                                                                              \
    if (!::moe::testing::gpu_available()) GTEST_SKIP() << "no CUDA device: GPU test skipped"; \
  } while (0)

// A GPU test with a non-blocking stream of its own (skipped without a device).
class StreamTest : public ::testing::Test {
 protected:
  void SetUp() override {
    MOE_REQUIRE_GPU();
    MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream) cudaStreamDestroy(stream);
  }
  cudaStream_t stream = nullptr;
};

// The work `enqueue` puts on `stream`, captured once into an instantiated CUDA graph; launch()
// replays it on the stream and waits for it.
class CapturedGraph {
 public:
  template <typename Enqueue>
  CapturedGraph(cudaStream_t stream, Enqueue&& enqueue) : stream_(stream) {
    MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
    enqueue();
    MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph_));
    MOE_CUDA_CHECK(cudaGraphInstantiate(&exec_, graph_, 0));
  }
  ~CapturedGraph() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (graph_) cudaGraphDestroy(graph_);
  }
  CapturedGraph(const CapturedGraph&) = delete;
  CapturedGraph& operator=(const CapturedGraph&) = delete;
  void launch() const {
    MOE_CUDA_CHECK(cudaGraphLaunch(exec_, stream_));
    MOE_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }

 private:
  cudaStream_t stream_;
  cudaGraph_t graph_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

// Owns a device allocation of n elements of T.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t n) : n_(n) {
    if (n) MOE_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&p_), n * sizeof(T)));
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() { if (p_) cudaFree(p_); }
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(o.p_), n_(o.n_) { o.p_ = nullptr; o.n_ = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(n_, o.n_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return p_; }
  size_t size() const { return n_; }
  // upload and fill_bytes complete before they return: cudaMemset (and a pageable cudaMemcpy's
  // last DMA) are asynchronous on the legacy stream, which non-blocking streams do not wait for.
  void upload(const std::vector<T>& host) {
    MOE_CHECK(host.size() == n_, "DeviceBuffer::upload: size mismatch");
    if (n_) MOE_CUDA_CHECK(cudaMemcpy(p_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    if (n_) MOE_CUDA_CHECK(cudaMemcpy(host.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }
  // Fills every byte with `byte` (poison before a run to catch unwritten outputs).
  void fill_bytes(int byte) {
    if (n_) MOE_CUDA_CHECK(cudaMemset(p_, byte, n_ * sizeof(T)));
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }

 private:
  T* p_ = nullptr;
  size_t n_ = 0;
};

}  // namespace moe::testing
