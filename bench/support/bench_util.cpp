#include "support/bench_util.h"

#include <algorithm>
#include <sstream>

#include "device/cuda_check.h"
#include "moe/error.h"

namespace moe::bench {

const std::vector<Shape>& named_shapes() {
  static const std::vector<Shape> shapes = {
      {"sonic-7b-fine", 24576, 1536, 256, 128, 8},   {"sonic-7b-coarse", 24576, 1536, 1024, 32, 2},
      {"sonic-30b-fine", 32768, 4096, 512, 128, 8},  {"sonic-30b-coarse", 32768, 4096, 1024, 64, 4},
      {"sonic-120b-coarse", 32768, 4096, 2048, 64, 4}, {"qwen3-30b-a3b-ep8", 16384, 2048, 768, 16, 8},
      {"deepseek-v3-ep32", 8192, 7168, 2048, 8, 8},  {"mixtral-8x7b", 8192, 4096, 14336, 8, 2},
      {"olmoe-1b-7b", 16384, 2048, 1024, 64, 8},
  };
  return shapes;
}

const Shape& shape_by_name(const std::string& name) {
  std::string known;
  for (const auto& s : named_shapes()) {
    if (name == s.name) return s;
    known += (known.empty() ? "" : ", ") + std::string(s.name);
  }
  detail::throw_error("argument 'shape': unknown shape '", name, "'; known: ", known);
}

namespace {
Timing summarize(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  Timing t;
  t.min_ms = ms.front();
  t.max_ms = ms.back();
  size_t n = ms.size();
  t.median_ms = n % 2 ? ms[n / 2] : 0.5 * (ms[n / 2 - 1] + ms[n / 2]);
  return t;
}

Timing time_launches(const std::function<void()>& launch, cudaStream_t stream, int warmup, int repeats) {
  for (int i = 0; i < warmup; ++i) launch();
  std::vector<cudaEvent_t> ev(2 * repeats);
  for (auto& e : ev) MOE_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < repeats; ++i) {
    MOE_CUDA_CHECK(cudaEventRecord(ev[2 * i], stream));
    launch();
    MOE_CUDA_CHECK(cudaEventRecord(ev[2 * i + 1], stream));
  }
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> ms(repeats);
  for (int i = 0; i < repeats; ++i) MOE_CUDA_CHECK(cudaEventElapsedTime(&ms[i], ev[2 * i], ev[2 * i + 1]));
  for (auto& e : ev) cudaEventDestroy(e);
  return summarize(ms);
}
}  // namespace

Timing time_cuda(const std::function<void()>& fn, cudaStream_t stream, int warmup, int repeats) {
  return time_launches(fn, stream, warmup, repeats);
}

Timing time_cuda_graph(const std::function<void()>& fn, cudaStream_t stream, int warmup, int repeats) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  fn();
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  Timing t = time_launches([&] { MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }, stream, warmup, repeats);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  return t;
}

double copy_bandwidth_gbs(cudaStream_t stream, size_t bytes) {
  void *src = nullptr, *dst = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&src, bytes));
  MOE_CUDA_CHECK(cudaMalloc(&dst, bytes));
  MOE_CUDA_CHECK(cudaMemsetAsync(src, 1, bytes, stream));
  Timing t = time_cuda(
      [&] { MOE_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream)); }, stream, 3, 20);
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * static_cast<double>(bytes) / (t.median_ms * 1e-3) / 1e9;
}

std::string device_description() {
  int dev = 0;
  cudaDeviceProp prop{};
  MOE_CUDA_CHECK(cudaGetDevice(&dev));
  MOE_CUDA_CHECK(cudaGetDeviceProperties(&prop, dev));
  std::ostringstream os;
  os << prop.name << " (" << prop.multiProcessorCount << " SMs)";
  return os.str();
}

}  // namespace moe::bench
