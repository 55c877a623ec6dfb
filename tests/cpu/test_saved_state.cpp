// SavedState bookkeeping on the host (no GPU needed: the checks never touch device memory): borrowed
// blocks and headers, slices, reset, the lifecycle checks every op runs before it uses a state, and
// the messages that name the argument.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "device/state_check.h"
#include "moe/saved_state.h"
#include "support/expect_error.h"

namespace moe {
namespace {

using ::moe::testing::expect_error_naming;

// 256-byte aligned stand-in for a device block (never dereferenced by the code under test).
struct Block {
  std::vector<uint8_t> bytes = std::vector<uint8_t>(4096 + 256);
  void* aligned() {
    auto p = reinterpret_cast<uintptr_t>(bytes.data());
    return reinterpret_cast<void*>((p + 255) / 256 * 256);
  }
};

TEST(SavedState, BorrowedStateStartsEmptyAndSlicesShareHeaders) {
  Block b;
  StateHeader headers[3];
  SavedState s = SavedState::borrow(b.aligned(), 4096, headers, 3);
  EXPECT_TRUE(s.defined());
  EXPECT_EQ(s.status(), StateStatus::kEmpty);
  SavedState part = s.slice(1024, 512, 1, 2);
  EXPECT_EQ(part.device(), static_cast<char*>(b.aligned()) + 1024);
  EXPECT_EQ(part.device_bytes(), 512u);
  EXPECT_EQ(part.header_count(), 2);
  mark_filled(part, 7, StateKind::kDispatchPlan, 33);
  EXPECT_EQ(headers[1].owner, 7u);
  EXPECT_EQ(headers[1].tokens, 33);
  EXPECT_EQ(s.status(), StateStatus::kEmpty);  // header 0 is the outer op's
  expect_error_naming([&] { s.slice(4000, 512, 0, 1); }, "slice");
  expect_error_naming([&] { s.slice(0, 512, 2, 2); }, "slice");
  // Bounds whose sums wrap around (a huge offset plus a small size, a huge header count) and
  // empty or negative header counts are refused, not taken for a slice inside the state.
  expect_error_naming([&] { s.slice(SIZE_MAX - 100, 200, 0, 1); }, "slice");
  expect_error_naming([&] { s.slice(0, 16, 2, INT32_MAX); }, "slice");
  expect_error_naming([&] { s.slice(0, 16, 1, -1); }, "slice");
  expect_error_naming([&] { s.slice(0, 16, 3, 0); }, "slice");
  s.reset();
  EXPECT_EQ(headers[1].owner, 0u);
}

TEST(SavedState, BorrowRejectsBadMemoryByName) {
  Block b;
  StateHeader h;
  expect_error_naming([&] { SavedState::borrow(b.aligned(), 64, nullptr, 1); }, "'headers'");
  expect_error_naming([&] { SavedState::borrow(nullptr, 64, &h, 1); }, "'device'");
  expect_error_naming([&] { SavedState::borrow(static_cast<char*>(b.aligned()) + 16, 64, &h, 1); }, "256-byte");
  EXPECT_NO_THROW(SavedState::borrow(nullptr, 0, &h, 1));  // an op with nothing to save
}

TEST(SavedState, LifecycleChecksNameWhatIsWrong) {
  Block b;
  StateHeader headers[1];
  const SavedState s = SavedState::borrow(b.aligned(), 1024, headers, 1);
  const uint64_t me = next_op_serial(), other = next_op_serial();
  EXPECT_NE(me, other);
  const char* call = "Op::backward";
  // Capacity: too small a block, too few headers, undefined.
  expect_error_naming([&] { check_state_capacity(s, "state", 2048, 1); }, "2048 device bytes");
  expect_error_naming([&] { check_state_capacity(s, "state", 512, 3); }, "3 headers");
  expect_error_naming([&] { check_state_capacity(SavedState(), "state", 1, 1); }, "undefined");
  // Fillable: empty (or consumed, below) and large enough; the capacity checks come first.
  EXPECT_NO_THROW(check_state_fillable(s, "state", 1024, 1, "Op::forward"));
  expect_error_naming([&] { check_state_fillable(s, "state", 2048, 1, "Op::forward"); }, "2048 device bytes");
  // Empty, then filled by this op: accepted once; a foreign op, another kind or another status is not.
  expect_error_naming([&] { check_state(s, "state", me, StateKind::kExperts, {StateStatus::kFilled}, call); },
                      "empty");
  mark_filled(s, me, StateKind::kExperts, 12);
  EXPECT_NO_THROW(check_state(s, "state", me, StateKind::kExperts, {StateStatus::kFilled}, call));
  expect_error_naming([&] { check_state_fillable(s, "state", 1024, 1, "Op::forward"); },
                      "'state' of Op::forward: expected an empty or consumed saved state, got one filled");
  expect_error_naming([&] { check_state(s, "state", other, StateKind::kExperts, {StateStatus::kFilled}, call); },
                      "another op");
  expect_error_naming([&] { check_state(s, "state", me, StateKind::kLayer, {StateStatus::kFilled}, call); },
                      "a layer state");
  expect_error_naming(
      [&] { check_state(s, "state", me, StateKind::kExperts, {StateStatus::kAwaitingWgrad}, call); },
      "awaiting backward_dw");
  headers[0].status = static_cast<int32_t>(StateStatus::kConsumed);
  expect_error_naming([&] { check_state(s, "state", me, StateKind::kExperts, {StateStatus::kFilled}, call); },
                      "exactly one backward");
  EXPECT_NO_THROW(check_state_fillable(s, "state", 1024, 1, "Op::forward"));
  // Refilling a consumed state starts a new lifecycle.
  mark_filled(s, me, StateKind::kExperts, 5);
  EXPECT_EQ(s.status(), StateStatus::kFilled);
  EXPECT_EQ(headers[0].tokens, 5);
}

TEST(SavedState, HeaderIsSixtyFourBytesOfPlainData) {
  // The PyTorch binding keeps headers in a CPU uint8 tensor of 64 bytes each.
  EXPECT_EQ(sizeof(StateHeader), 64u);
  StateHeader h;
  EXPECT_EQ(h.owner, 0u);
  EXPECT_EQ(h.status, static_cast<int32_t>(StateStatus::kEmpty));
}

}  // namespace
}  // namespace moe
