// expect_error_naming(f, needle): f must throw a moe::Error whose message contains `needle` (the
// argument's name, docs/semantics.md, Errors). A test helper shared by every suite.
#pragma once

#include <string>

#include <gtest/gtest.h>

#include "moe/error.h"

namespace moe::testing {

template <typename F>
void expect_error_naming(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "expected moe::Error mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace moe::testing
