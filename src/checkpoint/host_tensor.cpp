// HostTensor and the safetensors <-> state dict glue.
#include <cstring>

#include "moe/error.h"
#include "moe/state_dict.h"

namespace moe {

namespace {
int64_t checked_numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) {
    MOE_CHECK(s >= 0, "HostTensor: negative dimension ", s);
    MOE_CHECK(!__builtin_mul_overflow(n, s, &n), "HostTensor: too many elements");
  }
  return n;
}
}  // namespace

HostTensor::HostTensor(DType dtype, std::vector<int64_t> shape) : dtype_(dtype), shape_(std::move(shape)) {
  const int64_t bytes = dtype_bytes(dtype_, checked_numel(shape_));
  // At least one byte so that data() is never null, even for an empty tensor.
  std::shared_ptr<uint8_t[]> buf(new uint8_t[bytes > 0 ? bytes : 1]());
  data_ = buf.get();
  owner_ = std::move(buf);
  owned_ = true;
}

HostTensor HostTensor::borrow(DType dtype, std::vector<int64_t> shape, const uint8_t* data,
                              std::shared_ptr<const void> owner) {
  checked_numel(shape);
  HostTensor t;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  t.data_ = data;
  t.owner_ = std::move(owner);
  t.owned_ = false;
  return t;
}

int64_t HostTensor::size(int dim) const {
  const int d = dim < 0 ? dim + ndim() : dim;
  MOE_CHECK(d >= 0 && d < ndim(), "HostTensor::size: dimension ", dim, " out of range for ", ndim(), " dims");
  return shape_[d];
}

int64_t HostTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape_) n *= s;
  return n;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string HostTensor::shape_string() const { return moe::shape_string(shape_); }

uint8_t* HostTensor::mutable_data() {
  if (!owned_ || owner_.use_count() > 1) {
    HostTensor copy(dtype_, shape_);
    if (nbytes() > 0) std::memcpy(const_cast<uint8_t*>(copy.data_), data_, nbytes());
    *this = std::move(copy);
  }
  // Owned memory was allocated non-const by this class.
  return const_cast<uint8_t*>(data_);
}

HostTensor HostTensor::reshaped(std::vector<int64_t> shape) const {
  const int64_t n = checked_numel(shape);
  MOE_CHECK(n == numel(), "HostTensor::reshaped: ", shape_string(), " has ", numel(), " elements, the new shape ", n);
  HostTensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

bool HostTensor::equals(const HostTensor& o) const {
  return dtype_ == o.dtype_ && shape_ == o.shape_ && (nbytes() == 0 || std::memcmp(data_, o.data_, nbytes()) == 0);
}

TensorView HostTensor::view() const {
  MOE_CHECK(ndim() <= TensorView::kMaxDims, "HostTensor::view: ", ndim(), " dimensions, at most ",
            TensorView::kMaxDims);
  TensorView v;
  v.data = const_cast<uint8_t*>(data_);
  v.dtype = dtype_;
  v.device = Device::kCPU;
  v.ndim = ndim();
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape_[d];
    v.strides[d] = stride;
    stride *= shape_[d];
  }
  return v;
}

StateDict load_safetensors(const std::string& path, Metadata* metadata) {
  std::shared_ptr<const safetensors::File> file = safetensors::File::open(path);
  StateDict sd;
  for (const safetensors::TensorEntry& t : file->tensors())
    sd.emplace(t.name, HostTensor::borrow(t.dtype, t.shape, file->data(t), file));
  if (metadata) *metadata = file->metadata();
  return sd;
}

void save_safetensors(const std::string& path, const StateDict& sd, const Metadata& metadata,
                      const safetensors::ProgressFn& progress) {
  std::vector<safetensors::TensorSource> src;
  src.reserve(sd.size());
  for (const auto& [name, t] : sd) src.push_back({name, t.dtype(), t.shape(), t.data()});
  safetensors::write_file(path, std::move(src), metadata, progress);
}

}  // namespace moe
