// moe::GroupedMlp -- the expert layer: dispatch -> fc1 -> activation x prob -> fc2 -> combine,
// forward and backward, CUDA-graph-safe (docs/semantics.md). It is the composition of a
// moe::Dispatcher and moe::GroupedExperts (both public, for other dispatchers).
//
// The layer holds configuration, bound parameters and workspaces planned at construction from the
// static bounds (T_max, k, E, A, H, F). What one micro-batch leaves for its backward -- the dispatch
// plan, x_perm (with save_x_perm off: the caller's x, by address) and the expert activations (or, with
// recompute, only the caller's x and the plan) --
// lives in a caller-owned SavedState (new_state(), reusable once consumed), so any number of
// forwards may be in flight and their backwards may run in any order, each bitwise equal to running
// that micro-batch alone. forward / backward / backward_dw make no allocation, no host
// synchronisation and no host read of device data: a whole step can be captured in one CUDA graph
// and replayed with new routing and data. Calls of one layer object must be ordered (one stream, or
// synchronised): its backward workspaces are shared by all states.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "moe/dispatch.h"
#include "moe/grouped_experts.h"
#include "moe/grouped_mlp_config.h"
#include "moe/routing.h"
#include "moe/saved_state.h"
#include "moe/tensor.h"

namespace moe {

class GroupedMlp {
 public:
  using Hook = std::function<void(Param)>;

  explicit GroupedMlp(const GroupedMlpConfig& config);
  ~GroupedMlp();
  GroupedMlp(const GroupedMlp&) = delete;
  GroupedMlp& operator=(const GroupedMlp&) = delete;

  // Binds parameter and gradient memory (see GroupedExperts::set_weights / rebind_weights / set_grads).
  void set_weights(const ExpertTensors& weights);
  void rebind_weights(const ExpertTensors& weights);
  void set_grads(const ExpertTensors& grads);
  // Called once per backward (or backward_dw) when that parameter's gradient is final, on the
  // host while the work is being enqueued (so a reducer can enqueue its reduce-scatter after it).
  void register_hook(Param param, Hook hook);

  // A saved state: device bytes and host headers (the layer's, the dispatch plan's and the
  // experts'); new_state() allocates one.
  size_t state_bytes() const;
  static constexpr int kStateHeaders = 2 + GroupedExperts::kStateHeaders;
  SavedState new_state(DeviceAllocator& allocator = cuda_malloc_allocator()) const;

  // x bf16 [T, H] (T <= max_tokens), routing per config.routing_form -> y bf16 [T, H]. `state`
  // must be empty or consumed; it is filled for the backward. Every argument is checked before
  // anything is enqueued: a rejected call changes nothing.
  void forward(const TensorView& x, const RoutingView& routing, const TensorView& y, const SavedState& state,
               cudaStream_t stream);
  // dy bf16 [T, H] -> dx bf16 [T, H], dprobs fp32 [T, k] (top-k) or [T, E] (map);
  // weight gradients too unless config.delay_wgrad or weight_grads = kSkip (frozen experts, see
  // WeightGrads). Consumes the state (delayed: backward_dw does).
  // Recompute mode and save_x_perm = false read the forward's x again (the latter: the fc1 weight
  // gradient gathers its rows, in delayed mode in backward_dw): by the address recorded at forward,
  // or `x` when given (the same values, e.g. restored to another address after offloading). x must
  // stay unchanged until then.
  void backward(const TensorView& dy, const TensorView& dx, const TensorView& dprobs, const SavedState& state,
                cudaStream_t stream, const TensorView* x = nullptr, WeightGrads weight_grads = WeightGrads::kCompute);
  // Delayed mode: fc2's weight gradients, then fc1's, each parameter's hooks once it is final.
  // save_x_perm = false reads the forward's x again (see backward).
  void backward_dw(const SavedState& state, cudaStream_t stream, const TensorView* x = nullptr);

  // FP8 or emulated experts with config.fp8_weight_refresh = kOnRequest or kFromMaster: see
  // GroupedExperts::refresh_fp8_weights.
  void refresh_fp8_weights(cudaStream_t stream);
  // FP8 or emulated experts: the quantized weight copies (see GroupedExperts::fp8_weights).
  QuantizedTensor fp8_weights(Param param) const;

  // Device error word of the dispatch (docs/semantics.md, errors; check_errors also reports the
  // experts' own word, GroupedExperts::check_errors): check_errors syncs -- call
  // outside graphs.
  uint32_t* device_error_word() const;
  void check_errors(cudaStream_t stream);

  // Device memory the layer holds (workspaces; saved states are the caller's).
  size_t workspace_bytes() const;
  const GroupedMlpConfig& config() const;

  // Of a filled state's dispatch plan: device int32 [E + 1] group boundaries (rows of expert e in
  // the permuted buffer are [g[e], g[e+1])) and the per-expert token counts int64 [E] (e.g. for
  // load-balancing statistics).
  TensorView group_offsets(const SavedState& state) const;
  TensorView tokens_per_expert(const SavedState& state) const;

  const Dispatcher& dispatcher() const;
  // The layer's experts op (its weights and FP8 copies; e.g. for save_fp8_expert_weights /
  // load_fp8_expert_weights in moe/checkpoint_fp8.h).
  GroupedExperts& experts();
  const GroupedExperts& experts() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace moe
