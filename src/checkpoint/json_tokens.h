// The base of the SAX passes that check a JSON document's shape (nesting, repeated keys) before its
// DOM is built: scalar values are accepted as they come; the containers and keys are the checks'.
#pragma once

#include <cstddef>
#include <string>

#include <nlohmann/json.hpp>

namespace moe::detail {

struct JsonShapeTokens : nlohmann::json_sax<nlohmann::json> {
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
};

}  // namespace moe::detail
