#include "support/bench_util.h"

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <mutex>
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

// Parses one positive decimal integer field of a custom shape; `what` names the field.
int64_t parse_dimension(const std::string& text, const char* what, const std::string& spec) {
  const bool digits =
      !text.empty() && std::all_of(text.begin(), text.end(), [](char c) { return c >= '0' && c <= '9'; });
  errno = 0;
  const long long v = digits ? std::strtoll(text.c_str(), nullptr, 10) : 0;
  MOE_CHECK(digits && errno == 0 && v > 0, "argument 'shape': ", what, " of '", spec,
            "' must be a positive integer, got '", text, "'");
  return v;
}

// Names of custom shapes: Shape holds a C string, so each name is kept for the life of the program
// (a deque never moves its elements). Benchmarks parse a handful of shapes, once.
const char* keep_name(const std::string& name) {
  static std::mutex mutex;
  static std::deque<std::string> names;
  std::lock_guard<std::mutex> lock(mutex);
  for (const auto& n : names)
    if (n == name) return n.c_str();
  names.push_back(name);
  return names.back().c_str();
}

}  // namespace

Shape parse_shape(const std::string& spec) {
  if (spec.find(',') == std::string::npos) return shape_by_name(spec);
  std::vector<std::string> fields;
  size_t start = 0;
  for (;;) {
    const size_t comma = spec.find(',', start);
    fields.push_back(spec.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  MOE_CHECK(fields.size() == 5, "argument 'shape': expected a shape name or T,H,F,E,k (five integers), got '",
            spec, "'");
  const char* what[5] = {"T", "H", "F", "E", "k"};
  int64_t v[5];
  for (int i = 0; i < 5; ++i) v[i] = parse_dimension(fields[i], what[i], spec);
  MOE_CHECK(v[3] <= (1 << 20), "argument 'shape': E of '", spec, "' must be at most 1048576, got ", v[3]);
  MOE_CHECK(v[4] <= v[3], "argument 'shape': k of '", spec, "' must be at most E (", v[3], "), got ", v[4]);
  const std::string name = detail::concat(v[0], "x", v[1], "x", v[2], "x", v[3], "x", v[4]);
  return Shape{keep_name(name), v[0], v[1], v[2], static_cast<int>(v[3]), static_cast<int>(v[4])};
}

std::vector<std::string> shape_args_or_all(std::vector<std::string> args) {
  if (args.empty())
    for (const auto& s : named_shapes()) args.push_back(s.name);
  return args;
}

std::string shape_table() {
  std::string out;
  char line[128];
  std::snprintf(line, sizeof line, "%-18s %6s %6s %6s %4s %3s\n", "name", "T", "H", "F", "E", "k");
  out += line;
  for (const auto& s : named_shapes()) {
    std::snprintf(line, sizeof line, "%-18s %6lld %6lld %6lld %4d %3d\n", s.name, static_cast<long long>(s.T),
                  static_cast<long long>(s.H), static_cast<long long>(s.F), s.E, s.k);
    out += line;
  }
  return out;
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

Timing time_launches(const std::function<void()>& launch, cudaStream_t stream, int warmup, int repeats,
                     const std::function<void()>& before_each) {
  for (int i = 0; i < warmup; ++i) launch();
  std::vector<cudaEvent_t> ev(2 * repeats);
  for (auto& e : ev) MOE_CUDA_CHECK(cudaEventCreate(&e));
  for (int i = 0; i < repeats; ++i) {
    if (before_each) before_each();
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

Timing time_cuda(const std::function<void()>& fn, cudaStream_t stream, int warmup, int repeats,
                 const std::function<void()>& before_each) {
  return time_launches(fn, stream, warmup, repeats, before_each);
}

Timing time_cuda_graph(const std::function<void()>& fn, cudaStream_t stream, int warmup, int repeats,
                       const std::function<void()>& before_each) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  fn();
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  MOE_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  Timing t =
      time_launches([&] { MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream)); }, stream, warmup, repeats, before_each);
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
