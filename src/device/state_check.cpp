#include "device/state_check.h"

#include <string>

#include "moe/error.h"

namespace moe {

namespace {
const char* kind_name(int32_t k) {
  switch (static_cast<StateKind>(k)) {
    case StateKind::kDispatchPlan: return "a dispatch plan";
    case StateKind::kExperts: return "an experts state";
    case StateKind::kLayer: return "a layer state";
  }
  return "nothing";
}
}  // namespace

void check_state_capacity(const SavedState& s, const char* name, size_t device_bytes, int headers) {
  MOE_CHECK(s.defined(), "argument '", name, "': the saved state is undefined (make it with the op's new_state())");
  MOE_CHECK(s.device_bytes() >= device_bytes && s.header_count() >= headers, "argument '", name,
            "': expected a saved state of at least ", device_bytes, " device bytes and ", headers,
            " headers (this op's state_bytes() / kStateHeaders), got ", s.device_bytes(), " bytes and ",
            s.header_count(), " headers");
}

void check_state_fillable(const SavedState& s, const char* name, size_t device_bytes, int headers, const char* call) {
  check_state_capacity(s, name, device_bytes, headers);
  MOE_CHECK(s.status() == StateStatus::kEmpty || s.status() == StateStatus::kConsumed, "argument '", name, "' of ",
            call, ": expected an empty or consumed saved state, got one ", state_status_name(s.status()),
            " (its backward is not complete; reset() it to discard that forward)");
}

void check_state(const SavedState& s, const char* name, uint64_t owner, StateKind kind,
                 std::initializer_list<StateStatus> accepted, const char* call) {
  MOE_CHECK(s.defined(), "argument '", name, "' of ", call, ": the saved state is undefined");
  const StateHeader& h = s.header(0);
  MOE_CHECK(h.status != static_cast<int32_t>(StateStatus::kEmpty), "argument '", name, "' of ", call,
            ": the saved state is empty (no forward filled it, or it was reset)");
  MOE_CHECK(h.kind == static_cast<int32_t>(kind), "argument '", name, "' of ", call, ": expected ",
            kind_name(static_cast<int32_t>(kind)), ", got ", kind_name(h.kind));
  MOE_CHECK(h.owner == owner, "argument '", name, "' of ", call,
            ": the saved state belongs to another op object (filled by op #", h.owner, ", this is op #", owner, ")");
  bool ok = false;
  std::string want;
  for (StateStatus a : accepted) {
    ok = ok || h.status == static_cast<int32_t>(a);
    want += (want.empty() ? "" : " or ") + std::string(state_status_name(a));
  }
  MOE_CHECK(ok, "argument '", name, "' of ", call, ": expected a saved state ", want, ", got one ",
            state_status_name(static_cast<StateStatus>(h.status)),
            h.status == static_cast<int32_t>(StateStatus::kConsumed) ? " (each forward has exactly one backward)" : "");
}

void mark_filled(const SavedState& s, uint64_t owner, StateKind kind, int64_t tokens) {
  StateHeader& h = s.header(0);
  h = StateHeader{};
  h.owner = owner;
  h.kind = static_cast<int32_t>(kind);
  h.status = static_cast<int32_t>(StateStatus::kFilled);
  h.tokens = tokens;
}

}  // namespace moe
