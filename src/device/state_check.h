// Checks of a caller-owned SavedState against the op it is handed to: defined, large enough,
// filled by this very op object (serial id, not address), of the right kind, in an accepted
// lifecycle status. Each failure is a moe::Error naming the argument and what was found.
#pragma once

#include <cstddef>
#include <initializer_list>

#include "moe/saved_state.h"

namespace moe {

// Size and header count only (a state about to be filled by a forward).
void check_state_capacity(const SavedState& s, const char* name, size_t device_bytes, int headers);

// A state about to be filled by a forward (`call`): large enough, and empty or consumed -- a state
// whose backward has not run yet is refused (reset() discards that forward).
void check_state_fillable(const SavedState& s, const char* name, size_t device_bytes, int headers, const char* call);

// Header 0 of `s` belongs to op `owner` of `kind` and has one of `accepted` statuses; `call` names
// the method for the message ("GroupedMlp::backward").
void check_state(const SavedState& s, const char* name, uint64_t owner, StateKind kind,
                 std::initializer_list<StateStatus> accepted, const char* call);

// Header 0 after a successful fill by op `owner`.
void mark_filled(const SavedState& s, uint64_t owner, StateKind kind, int64_t tokens);

}  // namespace moe
