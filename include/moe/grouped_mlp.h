// moe::GroupedMlp -- the expert layer: dispatch -> fc1 -> activation x prob -> fc2 -> combine,
// forward and backward, CUDA-graph-safe (SPEC 2-5, 7).
//
// Every device buffer is planned and allocated at construction from the static bounds of the
// config (T_max, k, E, A, H, F); forward / backward / backward_dw make no allocation, no host
// synchronisation and no host read of device data, so a whole training step's expert layer can be
// captured in one CUDA graph and replayed with new routing and data.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "moe/grouped_mlp_config.h"
#include "moe/routing.h"
#include "moe/tensor.h"

namespace moe {

// Device views of the four parameters (or of their gradients), in the config's layout:
//   kSingleGrouped: one view each: fc1 [E, fc1_out, H], fc1_bias [E, fc1_out], fc2 [E, H, F], fc2_bias [E, H]
//   kPerExpert:     E views each:  fc1 [fc1_out, H],    fc1_bias [fc1_out],    fc2 [H, F],    fc2_bias [H]
// Biases are empty when config.bias is false. Gradients: dtype wgrad_dtype (kWrite) or fp32
// main_grad (kAccumulate), each parameter's in either layout (independent of the weights' layout:
// one view with the leading E dimension is single grouped, E views are per expert).
struct ExpertTensors {
  std::vector<TensorView> fc1_weight, fc1_bias, fc2_weight, fc2_bias;
};

class GroupedMlp {
 public:
  using Hook = std::function<void(Param)>;

  explicit GroupedMlp(const GroupedMlpConfig& config);
  ~GroupedMlp();
  GroupedMlp(const GroupedMlp&) = delete;
  GroupedMlp& operator=(const GroupedMlp&) = delete;

  // Binds parameter and gradient memory (pointers only: the data may change between calls, the
  // addresses must not once a graph has been captured).
  void set_weights(const ExpertTensors& weights);
  void set_grads(const ExpertTensors& grads);
  // Called once per backward (or backward_dw) when that parameter's gradient is final, on the
  // host while the work is being enqueued (so a reducer can enqueue its reduce-scatter after it).
  void register_hook(Param param, Hook hook);

  // x bf16 [T, H] (T <= max_tokens), routing per config.routing_form -> y bf16 [T, H].
  void forward(const TensorView& x, const RoutingView& routing, const TensorView& y, cudaStream_t stream);
  // dy bf16 [T, H] -> dx bf16 [T, H], dprobs fp32 [T, k] (top-k) or [T, E] (map);
  // weight gradients too unless config.delay_wgrad.
  void backward(const TensorView& dy, const TensorView& dx, const TensorView& dprobs, cudaStream_t stream);
  // Delayed mode: fc2's weight gradients, then fc1's, each parameter's hooks once it is final.
  void backward_dw(cudaStream_t stream);

  // Device error word of the dispatch (SPEC 9): check_errors syncs -- call outside graphs.
  uint32_t* device_error_word() const;
  void check_errors(cudaStream_t stream);

  // Device memory the layer holds (saved activations, gradients in flight, GEMM workspaces).
  size_t workspace_bytes() const;
  const GroupedMlpConfig& config() const;

  // Device int32 [E + 1] group boundaries of the last forward (rows of expert e in the permuted
  // buffer are [g[e], g[e+1])), and the per-expert token counts int64 [E] (e.g. for load-balancing
  // statistics) -- both live in the layer's workspace.
  const int32_t* group_offsets() const;
  const int64_t* tokens_per_expert() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
