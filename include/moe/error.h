// moe::Error and the argument-checking helpers used at every public entry point.
//
// Every host-checkable problem (shape, dtype, null or misaligned pointer, bad option) raises a
// moe::Error whose message names the argument and the expected value (docs/semantics.md, Errors).
//
// Messages are built with plain string appends and std::to_string, not iostreams: the library is
// also linked into Python extensions, where a process may hold a second C++ runtime whose locale
// facets an inlined ostream insertion can trip over.
#pragma once

#include <cstdio>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace moe {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace detail {

template <typename T>
void append(std::string& out, const T& v) {
  using U = std::decay_t<T>;
  if constexpr (std::is_same_v<U, bool>) {
    out += v ? "true" : "false";
  } else if constexpr (std::is_same_v<U, char>) {
    out += v;
  } else if constexpr (std::is_convertible_v<const T&, std::string_view>) {
    out += std::string_view(v);
  } else if constexpr (std::is_enum_v<U>) {
    out += std::to_string(static_cast<long long>(v));
  } else if constexpr (std::is_integral_v<U>) {
    out += std::to_string(v);
  } else if constexpr (std::is_floating_point_v<U>) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", static_cast<double>(v));
    out += buf;
  } else {
    static_assert(std::is_pointer_v<U>, "moe::detail::append: unsupported message part");
    char buf[32];
    std::snprintf(buf, sizeof buf, "%p", static_cast<const void*>(v));
    out += buf;
  }
}

template <typename... Parts>
std::string concat(const Parts&... parts) {
  std::string out;
  (append(out, parts), ...);
  return out;
}

template <typename... Parts>
[[noreturn]] void throw_error(const Parts&... parts) {
  throw Error(concat(parts...));
}

}  // namespace detail

}  // namespace moe

// MOE_CHECK(cond, "argument 'x': expected ", a, ", got ", b) -- throws moe::Error when cond fails.
#define MOE_CHECK(cond, ...)                                \
  do {                                                      \
    if (!(cond)) ::moe::detail::throw_error(__VA_ARGS__);   \
  } while (0)
