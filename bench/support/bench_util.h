// Benchmark support: the named shapes (docs/shapes.md) and the parser of shape arguments,
// CUDA-event timing (median/min/max over repeats after warm-up), and the device-to-device copy
// bandwidth measured in the same run.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

namespace moe::bench {

// (T, H, F, E, k) of docs/semantics.md. The name is a C string so that a Shape stays a plain
// aggregate that the benchmarks print with printf; it points to static storage.
struct Shape {
  const char* name;
  int64_t T, H, F;
  int E, k;
};

// Every named shape, in the order of docs/shapes.md.
const std::vector<Shape>& named_shapes();
// Throws moe::Error listing the known names when `name` is unknown.
const Shape& shape_by_name(const std::string& name);
// A shape argument: a name of named_shapes(), or "T,H,F,E,k" (five positive integers, k <= E),
// which is named "TxHxFxExk". Throws moe::Error naming argument 'shape' otherwise.
Shape parse_shape(const std::string& spec);
// The named shapes as an aligned text table, one per line, with a header.
std::string shape_table();
// A benchmark's --shape arguments, or every named shape's name when none was given.
std::vector<std::string> shape_args_or_all(std::vector<std::string> args);

struct Timing {
  double median_ms = 0, min_ms = 0, max_ms = 0;
};

// Times fn() (which enqueues work on `stream`) with CUDA events: `warmup` untimed runs, then
// `repeats` timed runs, each bracketed by its own events. `before_each` (when given) enqueues work
// before each timed run, outside its events (e.g. a write that evicts the inputs from L2).
Timing time_cuda(const std::function<void()>& fn, cudaStream_t stream, int warmup = 5, int repeats = 20,
                 const std::function<void()>& before_each = nullptr);

// Captures fn() into a CUDA graph once and times its replays the same way.
Timing time_cuda_graph(const std::function<void()>& fn, cudaStream_t stream, int warmup = 5, int repeats = 20,
                       const std::function<void()>& before_each = nullptr);

// Device-to-device copy bandwidth (bytes read + written per second, GB/s) of a `bytes` buffer.
double copy_bandwidth_gbs(cudaStream_t stream, size_t bytes = size_t(2) << 30);

// "NVIDIA H100 80GB HBM3 (132 SMs)".
std::string device_description();

}  // namespace moe::bench
