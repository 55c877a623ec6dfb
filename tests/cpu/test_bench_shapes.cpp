// The shape arguments of `moe-engine bench` (bench/support/bench_util.h): named shapes, custom
// T,H,F,E,k shapes and their names, the --list table, and bad input refused naming 'shape'.
#include <gtest/gtest.h>

#include <set>
#include <string>

#include "support/bench_util.h"
#include "support/expect_error.h"

namespace moe::bench {
namespace {

using testing::expect_error_naming;

TEST(BenchShapes, NamedShapesAreUniqueAndFound) {
  std::set<std::string> names;
  for (const Shape& s : named_shapes()) {
    EXPECT_TRUE(names.insert(s.name).second) << s.name;
    const Shape p = parse_shape(s.name);
    EXPECT_EQ(std::string(p.name), s.name);
    EXPECT_EQ(p.T, s.T);
    EXPECT_EQ(p.H, s.H);
    EXPECT_EQ(p.F, s.F);
    EXPECT_EQ(p.E, s.E);
    EXPECT_EQ(p.k, s.k);
  }
  EXPECT_EQ(names.size(), 9u);
  const Shape q = parse_shape("qwen3-30b-a3b-ep8");  // the default shape, as docs/shapes.md lists it
  EXPECT_EQ(q.T, 16384);
  EXPECT_EQ(q.H, 2048);
  EXPECT_EQ(q.F, 768);
  EXPECT_EQ(q.E, 16);
  EXPECT_EQ(q.k, 8);
}

TEST(BenchShapes, CustomShapeIsParsedAndNamed) {
  const Shape s = parse_shape("4096,2048,768,16,8");
  EXPECT_EQ(std::string(s.name), "4096x2048x768x16x8");
  EXPECT_EQ(s.T, 4096);
  EXPECT_EQ(s.H, 2048);
  EXPECT_EQ(s.F, 768);
  EXPECT_EQ(s.E, 16);
  EXPECT_EQ(s.k, 8);
  // Large values do not wrap; k = E is allowed.
  const Shape big = parse_shape("3000000000,7168,2048,8,8");
  EXPECT_EQ(big.T, 3000000000LL);
  EXPECT_EQ(std::string(big.name), "3000000000x7168x2048x8x8");
  // The name stays valid after more shapes are parsed.
  const char* first = s.name;
  for (int i = 1; i < 50; ++i) parse_shape(std::to_string(i) + ",64,64,4,2");
  EXPECT_EQ(std::string(first), "4096x2048x768x16x8");
}

TEST(BenchShapes, BadShapesNameTheArgument) {
  expect_error_naming([] { parse_shape("qwen3"); }, "argument 'shape'");
  expect_error_naming([] { parse_shape("qwen3"); }, "mixtral-8x7b");  // lists the known names
  expect_error_naming([] { parse_shape("1,2,3,4"); }, "argument 'shape'");
  expect_error_naming([] { parse_shape("1,2,3,4,5,6"); }, "argument 'shape'");
  expect_error_naming([] { parse_shape("1,2,3,4,"); }, "k of");
  expect_error_naming([] { parse_shape("0,2048,768,16,8"); }, "T of");
  expect_error_naming([] { parse_shape("-4,2048,768,16,8"); }, "T of");
  expect_error_naming([] { parse_shape("4096,20x8,768,16,8"); }, "H of");
  expect_error_naming([] { parse_shape("4096,2048,768,16,17"); }, "k of");
  expect_error_naming([] { parse_shape("4096, 2048,768,16,8"); }, "H of");
  expect_error_naming([] { parse_shape("99999999999999999999,2048,768,16,8"); }, "T of");
  expect_error_naming([] { parse_shape("4096,2048,768,4194304,8"); }, "E of");
}

TEST(BenchShapes, TableListsEveryNamedShapeWithItsDimensions) {
  const std::string table = shape_table();
  EXPECT_EQ(table.rfind("name", 0), 0u) << table;  // header first
  size_t lines = 0;
  for (char c : table) lines += c == '\n';
  EXPECT_EQ(lines, named_shapes().size() + 1);
  for (const Shape& s : named_shapes()) {
    const size_t at = table.find(std::string(s.name) + " ");
    ASSERT_NE(at, std::string::npos) << s.name;
    const std::string line = table.substr(at, table.find('\n', at) - at);
    for (long long v : {static_cast<long long>(s.T), static_cast<long long>(s.H), static_cast<long long>(s.F),
                        static_cast<long long>(s.E), static_cast<long long>(s.k)})
      EXPECT_NE(line.find(" " + std::to_string(v)), std::string::npos) << line << " lacks " << v;
  }
}

}  // namespace
}  // namespace moe::bench
