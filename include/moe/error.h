// moe::Error and the argument-checking helpers used at every public entry point.
//
// Every host-checkable problem (shape, dtype, null or misaligned pointer, bad option) raises a
// moe::Error whose message names the argument and the expected value (SPEC section 9).
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace moe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {
template <typename... Parts>
[[noreturn]] void throw_error(const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw Error(os.str());
}
}  // namespace detail

}  // namespace moe

// MOE_CHECK(cond, "argument 'x': expected ", a, ", got ", b) -- throws moe::Error when cond fails.
#define MOE_CHECK(cond, ...)                        \
  do {                                              \
    if (!(cond)) ::moe::detail::throw_error(__VA_ARGS__); \
  } while (0)
