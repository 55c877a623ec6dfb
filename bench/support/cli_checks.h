// Option checks the command-line programs share (the moe-engine tool, the benchmark programs),
// beyond CLI11's own.
#pragma once

#include <cctype>
#include <cmath>
#include <string>

#include <CLI/CLI.hpp>

namespace moe::cli {

// Integer options in decimal only. CLI11 converts integers with strtoll(..., base 0), so "010" would
// be read as 8 and "0x20" as 32: this transform (add it before any range check) refuses anything
// but an optional sign and decimal digits, and drops the leading zeros.
inline CLI::Validator decimal_integer() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
        if (i == s.size()) return "expected a decimal integer, got '" + s + "'";
        for (size_t j = i; j < s.size(); ++j)
          if (!std::isdigit(static_cast<unsigned char>(s[j]))) return "expected a decimal integer, got '" + s + "'";
        const size_t first = s.find_first_not_of('0', i);
        s = s.substr(0, i) + (first == std::string::npos ? "0" : s.substr(first));
        return "";
      },
      "DECIMAL", "decimal integer");
}

// Floating-point options that must be finite (CLI11's number checks let "nan" and "inf" through).
inline CLI::Validator finite_number() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        char* end = nullptr;
        const double v = std::strtod(s.c_str(), &end);
        if (end == s.c_str() || *end != '\0' || !std::isfinite(v)) return "expected a finite number, got '" + s + "'";
        return "";
      },
      "FINITE", "finite number");
}

}  // namespace moe::cli
