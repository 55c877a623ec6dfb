// Saved state: what one call of an op leaves for its backward (or for later calls), owned by the
// caller (see docs/semantics.md, "State and graph safety").
//
// An op object (Dispatcher, GroupedExperts, GroupedMlp) holds only its configuration and
// workspaces sized at construction. Everything that belongs to one micro-batch -- the dispatch
// plan, saved activations, the bookkeeping of which op filled it and whether its backward already
// ran -- lives in a SavedState the caller owns, so any number of micro-batches may be in flight and
// their backwards may run in any order.
//
// A state is two blocks whose sizes the op states (`state_bytes()`, `kStateHeaders`):
//  - device memory for the saved tensors, from a DeviceAllocator or the caller's own memory (the
//    PyTorch binding uses a tensor of PyTorch's caching allocator, which works in graph pools);
//  - host-side headers (plain data: the binding keeps them in a CPU tensor) recording the owner,
//    the lifecycle, the token count and the device addresses of inputs a backward reads again;
//    checking them needs no device synchronisation. When those inputs (or the state itself) move,
//    e.g. offloaded to the host and restored, the op's relocate() points the state at them again.
// States are made before the work that uses them (never inside forward/backward) and may be
// reused: a consumed state can be filled by a new forward.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace moe {

// Device memory handed out by an allocator; freed when the last reference goes.
using DeviceBuffer = std::shared_ptr<void>;

class DeviceAllocator {
 public:
  virtual ~DeviceAllocator() = default;
  // At least `bytes` of device memory on the current device, 256-byte aligned.
  virtual DeviceBuffer allocate(size_t bytes) = 0;
};

// cudaMalloc / cudaFree. Freeing synchronises the device (cudaFree): make states once and reuse them.
DeviceAllocator& cuda_malloc_allocator();

enum class StateStatus : int32_t {
  kEmpty = 0,        // never filled, or reset()
  kFilled = 1,       // a forward (or a dispatch plan) wrote it; its backward has not run
  kAwaitingWgrad = 2,  // backward ran with delayed weight gradients; backward_dw has not
  kConsumed = 3,     // its backward is complete; a new forward may fill it again
};
const char* state_status_name(StateStatus s);

// One header per op that keeps state in the block (a layer's state holds its own header, the
// dispatch plan's and the experts'). Plain data so it can live in caller memory.
struct StateHeader {
  uint64_t owner = 0;       // serial id of the op object that filled the state (0: none)
  int32_t kind = 0;         // which kind of op (a StateKind value)
  int32_t status = 0;       // a StateStatus value
  int64_t tokens = 0;       // T of the call that filled it
  uint64_t binding = 0;     // weight-binding generation at forward (ops with weights)
  uint64_t pointer = 0;     // an input the backward reads again (e.g. the caller's x in recompute mode)
  uint64_t reserved[3] = {0, 0, 0};
};
static_assert(sizeof(StateHeader) == 64, "StateHeader is stored in caller memory as 64 bytes");

enum class StateKind : int32_t { kDispatchPlan = 1, kExperts = 2, kLayer = 3 };

class SavedState {
 public:
  SavedState() = default;

  // A state that owns its memory: `device_bytes` from `allocator`, `headers` host headers.
  static SavedState allocate(size_t device_bytes, int headers, DeviceAllocator& allocator = cuda_malloc_allocator());
  // A state over caller-owned memory (kept alive by the caller for as long as the state is used):
  // `device` 256-byte aligned, `headers` an array of `header_count` StateHeader in host memory.
  static SavedState borrow(void* device, size_t device_bytes, StateHeader* headers, int header_count);

  bool defined() const { return headers_ != nullptr; }
  void* device() const { return device_; }
  size_t device_bytes() const { return device_bytes_; }
  int header_count() const { return header_count_; }
  StateHeader& header(int i = 0) const;
  StateStatus status() const;

  // Discards whatever the state holds (an in-flight forward whose backward will never run).
  void reset();

  // A view of part of this state (sub-block of device memory and of headers), sharing ownership.
  SavedState slice(size_t device_offset, size_t device_bytes, int first_header, int header_count) const;

 private:
  void* device_ = nullptr;
  size_t device_bytes_ = 0;
  StateHeader* headers_ = nullptr;
  int header_count_ = 0;
  std::shared_ptr<void> device_owner_;
  std::shared_ptr<StateHeader> host_owner_;
};

// A process-unique serial id for an op object (never reused, unlike addresses).
uint64_t next_op_serial();

}  // namespace moe
