// Host-side state dicts (name -> tensor) and the layout normalisation of expert keys
// (docs/semantics.md, Weight layouts and checkpoints).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "moe/dtype.h"
#include "moe/grouped_mlp_config.h"
#include "moe/safetensors.h"
#include "moe/tensor.h"

namespace moe {

// A contiguous row-major tensor on the host. Its bytes are either owned or borrowed from memory
// kept alive by the tensor (e.g. a memory-mapped checkpoint): loading a file copies nothing, and a
// borrowed tensor is copied only when written to (mutable_data).
class HostTensor {
 public:
  HostTensor() = default;
  // Owned, zero-filled.
  HostTensor(DType dtype, std::vector<int64_t> shape);
  // Borrowed: `data` stays valid as long as `owner` lives.
  static HostTensor borrow(DType dtype, std::vector<int64_t> shape, const uint8_t* data,
                           std::shared_ptr<const void> owner);

  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int dim) const;  // negative dims count from the end
  int64_t numel() const;
  int64_t nbytes() const { return dtype_bytes(dtype_, numel()); }
  std::string shape_string() const;  // "[4, 128]"

  const uint8_t* data() const { return data_; }
  // Writable bytes. Copies of a HostTensor share their bytes; a tensor that is borrowed or shared
  // is first copied into memory of its own (copy on write), so writing never shows through
  // another tensor or into a mapped file.
  uint8_t* mutable_data();
  bool is_borrowed() const { return !owned_; }
  // The same bytes under another shape with the same number of elements (shared, not copied).
  HostTensor reshaped(std::vector<int64_t> shape) const;

  // Same dtype, shape and bytes.
  bool equals(const HostTensor& other) const;
  // A host view (at most TensorView::kMaxDims dimensions). The view writes through when the
  // tensor is owned; do not write through a view of a borrowed tensor.
  TensorView view() const;

 private:
  DType dtype_ = DType::kFP32;
  std::vector<int64_t> shape_;
  std::shared_ptr<const void> owner_;
  const uint8_t* data_ = nullptr;
  bool owned_ = true;
};

// "[4, 128]"
std::string shape_string(const std::vector<int64_t>& shape);

// Sorted by name.
using StateDict = std::map<std::string, HostTensor>;
using Metadata = safetensors::Metadata;

// Every tensor of a safetensors file, borrowed from its memory mapping (nothing is copied; the
// mapping stays open while any tensor of the dict lives). `metadata` receives __metadata__.
StateDict load_safetensors(const std::string& path, Metadata* metadata = nullptr);
// Writes every tensor of `sd` (see safetensors::write_file: atomic rename, progress callback).
void save_safetensors(const std::string& path, const StateDict& sd, const Metadata& metadata = {},
                      const safetensors::ProgressFn& progress = {});

// Key names of one expert parameter: `prefix` + "fc1" / "fc2" + "." + "weight" / "bias",
// followed by the expert index in the per-expert layout ("fc1.weight0", ...).
std::string expert_param_key(const std::string& prefix, Param p);
std::string expert_param_key(const std::string& prefix, Param p, int expert);

// Brings the expert keys under `prefix` to `layout`, for a layer of `num_experts` experts, by the
// rules of docs/semantics.md, independently for each of fc1/fc2 x weight/bias (P.S below):
//   single grouped: if P.S is absent and all of P.S0 .. P.S{E-1} are present, they are stacked
//     into P.S [E, ...] (same dtype and shape required) and removed; if only some are present it
//     is an error naming the missing keys; if none are, nothing happens.
//   per expert: if no P.S{i} is present and P.S is, P.S is split along its first dimension --
//     E slices of shape[1:] when that dimension is E, or E even chunks when it is a multiple of E
//     -- and removed; otherwise (some P.S{i} present, or P.S absent) nothing happens.
// A key already in the target layout is never overwritten, so normalising twice changes nothing.
// Stacking copies; splitting a borrowed tensor copies each slice.
// The companion tensors of a quantized weight (P.S_scale_inv, P.S_columnwise,
// P.S_columnwise_scale_inv, P.S_amax and their per-expert P.S{i}_scale_inv, ..., see
// moe/checkpoint_quant.h) are families of their own under the same rules, so data and scales move
// together bit for bit; a weight with any companion is split only along a first dimension of
// exactly E (chunks of rows would cut its blocks and scale layouts). Every check runs before any
// tensor moves: a call that throws leaves `sd` as it was.
void normalize_expert_keys(StateDict& sd, const std::string& prefix, int num_experts, WeightLayout layout);

}  // namespace moe
