#include "support/interleaved_timing.h"

#include <cuda_bf16.h>

#include <algorithm>

#include "device/cuda_check.h"
#include "moe/error.h"

namespace moe::bench {

DeviceMem::DeviceMem(size_t bytes) { MOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
DeviceMem::~DeviceMem() { cudaFree(p); }

namespace {
__global__ void fill_bf16_kernel(__nv_bfloat16* p, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 15, h *= 2246822519u, h ^= h >> 13;
    p[i] = __float2bfloat16(float(h & 0xFFFF) / 32768.0f - 1.0f);
  }
}
}  // namespace

void fill_bf16_uniform(void* p, int64_t n, uint32_t seed, cudaStream_t stream) {
  if (n <= 0) return;
  fill_bf16_kernel<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(p), n, seed);
  MOE_CUDA_CHECK_LAUNCH();
}

std::vector<double> interleaved_ms(const std::vector<Candidate>& cands, cudaStream_t stream, int rounds,
                                   double batch_ms, double warmup_ms) {
  MOE_CHECK(rounds >= 1, "interleaved_ms: 'rounds' must be at least 1, got ", rounds);
  const size_t n = cands.size();
  std::vector<cudaGraphExec_t> execs(n, nullptr);
  std::vector<std::function<void()>> launch(n);
  for (size_t i = 0; i < n; ++i) {
    if (cands[i].graph) {
      cudaGraph_t g;
      MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
      cands[i].fn();
      MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &g));
      MOE_CUDA_CHECK(cudaGraphInstantiate(&execs[i], g, 0));
      MOE_CUDA_CHECK(cudaGraphDestroy(g));
      launch[i] = [&, i] { MOE_CUDA_CHECK(cudaGraphLaunch(execs[i], stream)); };
    } else {
      launch[i] = cands[i].fn;
    }
  }
  cudaEvent_t e0, e1;
  MOE_CUDA_CHECK(cudaEventCreate(&e0));
  MOE_CUDA_CHECK(cudaEventCreate(&e1));
  auto time_batch = [&](size_t i, int b) {
    MOE_CUDA_CHECK(cudaEventRecord(e0, stream));
    for (int j = 0; j < b; ++j) launch[i]();
    MOE_CUDA_CHECK(cudaEventRecord(e1, stream));
    MOE_CUDA_CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
    return double(ms) / b;
  };
  // Batch sizes from a first estimate, then a warm-up long enough for clocks to settle.
  std::vector<int> batch(n);
  for (size_t i = 0; i < n; ++i) {
    time_batch(i, 2);
    batch[i] = std::max(1, std::min(50, int(batch_ms / std::max(time_batch(i, 2), 1e-3) + 0.5)));
  }
  for (double spent = 0; spent < warmup_ms;)
    for (size_t i = 0; i < n; ++i) spent += time_batch(i, batch[i]) * batch[i];
  std::vector<std::vector<double>> samples(n);
  for (int r = 0; r < rounds; ++r)
    for (size_t j = 0; j < n; ++j) {
      const size_t i = (j + r) % n;
      samples[i].push_back(time_batch(i, batch[i]));
    }
  std::vector<double> med(n);
  for (size_t i = 0; i < n; ++i) {
    std::sort(samples[i].begin(), samples[i].end());
    med[i] = samples[i][samples[i].size() / 2];
    if (execs[i]) cudaGraphExecDestroy(execs[i]);
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return med;
}

}  // namespace moe::bench
