// safetensors reading and writing: valid files round-trip (byte-identical to what the safetensors
// library writes), and every kind of malformed file is a moe::Error that says what is wrong.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "moe/error.h"
#include "moe/safetensors.h"
#include "moe/state_dict.h"
#include "support/expect_error.h"

namespace moe {
namespace {

namespace st = safetensors;

using ::moe::testing::expect_error_naming;

std::string source_dir() {
  // The tests/ folder of the source tree (tests/CMakeLists.txt): __FILE__ may be relative to the
  // build folder (ccache base_dir), and the tests run elsewhere.
  return MOE_TESTS_DIR;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// A file from a literal header and data section: [u64 len][json][data].
std::string raw(const std::string& json, const std::string& data = "") {
  std::string out;
  uint64_t n = json.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + json + data;
}

st::Header parse(const std::string& bytes) {
  return st::parse_header(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), "test.safetensors");
}

// Entries of the temporary folder whose path starts with `prefix`.
int files_starting_with(const std::string& prefix) {
  const size_t slash = prefix.rfind('/');
  const std::string dir = prefix.substr(0, slash), stem = prefix.substr(slash + 1);
  int n = 0;
  if (DIR* d = ::opendir(dir.c_str())) {
    while (const dirent* e = ::readdir(d)) n += std::string(e->d_name).rfind(stem, 0) == 0;
    ::closedir(d);
  }
  return n;
}

void expect_parse_error(const std::string& bytes, const std::string& needle) {
  expect_error_naming([&] { parse(bytes); }, needle);
}

std::string tmp_path(const std::string& name) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir ? dir : "/tmp") + "/moe_test_safetensors_" + std::to_string(::getpid()) + "_" + name;
}

TEST(Safetensors, ParsesAValidHeader) {
  const std::string bytes = raw(
      R"({"__metadata__":{"format":"pt"},"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,12]},)"
      R"("b":{"dtype":"F32","shape":[],"data_offsets":[12,16]},"e":{"dtype":"I64","shape":[0,5],"data_offsets":[16,16]}}  )",
      std::string(16, 'x'));
  const st::Header h = parse(bytes);
  ASSERT_EQ(h.tensors.size(), 3u);
  ASSERT_NE(st::find_metadata(h.metadata, "format"), nullptr);
  EXPECT_EQ(*st::find_metadata(h.metadata, "format"), "pt");
  const st::TensorEntry* w = h.find("w");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, DType::kBF16);
  EXPECT_EQ(w->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(w->numel(), 6);
  EXPECT_EQ(h.find("b")->shape.size(), 0u);  // a scalar
  EXPECT_EQ(h.find("e")->nbytes(), 0u);      // an empty tensor takes no bytes
  EXPECT_EQ(h.data_start, 8u + bytes.size() - 8 - 16);
  EXPECT_EQ(h.data_size, 16u);
  // Metadata keeps the file's order (the library writes hash-map order; a rewrite must match it).
  const st::Header m = parse(raw(R"({"__metadata__":{"zeta":"1","alpha":"2","mid":"3"}})"));
  ASSERT_EQ(m.metadata.size(), 3u);
  EXPECT_EQ(m.metadata[0].first, "zeta");
  EXPECT_EQ(m.metadata[2].first, "mid");
  EXPECT_EQ(st::serialize({}, m.metadata).substr(8, 51), R"({"__metadata__":{"zeta":"1","alpha":"2","mid":"3"}})");
  // Data order, whatever the JSON order.
  EXPECT_EQ(h.tensors[0].name, "w");
  EXPECT_EQ(h.tensors[1].name, "b");
}

TEST(Safetensors, DtypeNames) {
  for (DType t : {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP64, DType::kInt32, DType::kInt64, DType::kUInt8,
                  DType::kBool, DType::kFP8E4M3, DType::kFP8E5M2, DType::kE8M0, DType::kFP4E2M1})
    EXPECT_EQ(st::dtype_from_string(st::dtype_to_string(t), "x"), t);
  EXPECT_STREQ(st::dtype_to_string(DType::kFP8E4M3), "F8_E4M3");
  EXPECT_STREQ(st::dtype_to_string(DType::kFP4E2M1), "F4");
  expect_error_naming([] { st::dtype_from_string("I8", "tensor 'q'"); }, "tensor 'q': unknown dtype 'I8'");
  // Packed FP4: two values per byte.
  const st::Header h = parse(raw(R"({"f":{"dtype":"F4","shape":[3,2],"data_offsets":[0,3]}})", "abc"));
  EXPECT_EQ(h.tensors[0].nbytes(), 3u);
}

TEST(Safetensors, RejectsMalformedFraming) {
  expect_parse_error("", "too short");
  expect_parse_error(std::string("\x02\0\0\0", 4), "too short");
  // Header length past the end of the file, and over the limit (never allocated).
  expect_parse_error(raw("{}").substr(0, 9), "runs past the end");
  std::string huge = raw("{}");
  huge[7] = 0x7f;
  expect_parse_error(huge, "exceeds the limit");
  std::string big = raw("{}");
  big[3] = 0x10;  // 256 MiB > 100 MiB
  expect_parse_error(big, "exceeds the limit");
  expect_parse_error(raw("[1,2]"), "not a JSON object");
  expect_parse_error(raw(""), "not a JSON object");
  expect_parse_error(raw("{\"a\":"), "not valid JSON");
  expect_parse_error(raw("{}garbage"), "not valid JSON");
  expect_parse_error(raw(std::string("{\"a\0\":1}", 8)), "NUL byte");
  // A NUL after a complete object would end the JSON reader's input: the bytes after it must not
  // ride along unread (a file that is also something else).
  expect_parse_error(raw(std::string("{\"__metadata__\":{\"a\":\"b\"}}\0<script>{\"evil\":1}", 45)), "NUL byte");
  expect_parse_error(raw("{\"\xff\":1}"), "not valid JSON");  // not UTF-8
}

TEST(Safetensors, RejectsBadStructure) {
  expect_parse_error(raw(R"({"a":{"dtype":"F32","shape":[[[1]]],"data_offsets":[0,4]}})"), "nested deeper");
  expect_parse_error(raw(std::string(10000, '[') + std::string(10000, ']')), "not a JSON object");
  expect_parse_error(raw("{\"a\":" + std::string(5000, '[') + std::string(5000, ']') + "}"), "nested deeper");
  expect_parse_error(raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                         std::string(8, 'x')),
                     "repeats the key 'a'");
  expect_parse_error(raw(R"({"a":{"dtype":"F32","dtype":"F16","shape":[1],"data_offsets":[0,4]}})", "xxxx"),
                     "repeats the key 'dtype'");
  expect_parse_error(raw(R"({"a":[1,2]})"), "tensor 'a': expected an object");
  expect_parse_error(raw(R"({"a":{"dtype":"F32","shape":[1]}})"), "missing field 'data_offsets'");
  expect_parse_error(raw(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4],"x":1}})", "xxxx"),
                     "unexpected field 'x'");
  expect_parse_error(raw(R"({"":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", "xxxx"), "empty name");
  expect_parse_error(raw(R"({"__metadata__":{"k":1}})"), "__metadata__ 'k' must be a string");
  expect_parse_error(raw(R"({"__metadata__":[1]})"), "__metadata__ must be an object");
}

TEST(Safetensors, RejectsBadEntries) {
  auto entry = [](const std::string& dtype, const std::string& shape, const std::string& off) {
    return raw("{\"t\":{\"dtype\":" + dtype + ",\"shape\":" + shape + ",\"data_offsets\":" + off + "}}",
               std::string(64, 'x'));
  };
  expect_parse_error(entry("\"Q7\"", "[1]", "[0,64]"), "tensor 't': unknown dtype 'Q7'");
  expect_parse_error(entry("3", "[1]", "[0,64]"), "'dtype' must be a string");
  expect_parse_error(entry("\"F32\"", "[-1]", "[0,64]"), "non-negative integer");
  expect_parse_error(entry("\"F32\"", "[1.5]", "[0,64]"), "non-negative integer");
  expect_parse_error(entry("\"F32\"", "[\"4\"]", "[0,64]"), "non-negative integer");
  expect_parse_error(entry("\"F32\"", "4", "[0,64]"), "'shape' must be an array");
  expect_parse_error(entry("\"F32\"", "[1,1,1,1,1,1,1,1,1]", "[0,64]"), "at most 8 supported");
  expect_parse_error(entry("\"F32\"", "[4294967296,4294967296]", "[0,64]"), "too many elements");
  expect_parse_error(entry("\"F32\"", "[18446744073709551615]", "[0,64]"), "too large");
  expect_parse_error(entry("\"F32\"", "[99999999999999999999]", "[0,64]"), "non-negative integer");
  expect_parse_error(entry("\"F32\"", "[16]", "[0]"), "must be [begin, end]");
  expect_parse_error(entry("\"F32\"", "[16]", "[64,0]"), "end before they begin");
  expect_parse_error(entry("\"F32\"", "[16]", "[0,-64]"), "non-negative integer");
  expect_parse_error(entry("\"F32\"", "[15]", "[0,64]"), "needs 60 bytes");
  expect_parse_error(entry("\"F4\"", "[3]", "[0,64]"), "not whole bytes");
  // A dtype size x count that overflows 64 bits.
  expect_parse_error(entry("\"F64\"", "[4611686018427387904]", "[0,64]"), "too many elements");
}

TEST(Safetensors, RejectsBadOffsets) {
  auto two = [](const std::string& a_off, const std::string& b_off, size_t data) {
    return raw("{\"a\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":" + a_off +
                   "},\"b\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":" + b_off + "}}",
               std::string(data, 'x'));
  };
  EXPECT_NO_THROW(parse(two("[0,4]", "[4,8]", 8)));
  EXPECT_NO_THROW(parse(two("[4,8]", "[0,4]", 8)));
  expect_parse_error(two("[0,4]", "[4,8]", 6), "tensor 'b' data_offsets [4, 8] run past the end");
  expect_parse_error(two("[0,4]", "[18446744073709551612,18446744073709551616]", 8), "non-negative integer");
  expect_parse_error(two("[0,4]", "[18446744073709551611,18446744073709551615]", 8), "run past the end");
  expect_parse_error(two("[0,4]", "[2,6]", 8), "tensor 'b' [2, 6) overlaps tensor 'a'");
  expect_parse_error(two("[0,4]", "[0,4]", 8), "overlaps");
  expect_parse_error(two("[0,4]", "[6,10]", 10), "2 bytes at [4, 6) of the data section belong to no tensor");
  expect_parse_error(two("[0,4]", "[4,8]", 9), "1 bytes after the last tensor");
  expect_parse_error(two("[2,6]", "[6,10]", 10), "belong to no tensor");
  // Zero-size tensors anywhere in the tiling are fine.
  EXPECT_NO_THROW(parse(raw(R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[0,0]},"b":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"c":{"dtype":"U8","shape":[0],"data_offsets":[2,2]}})",
                            "xy")));
}

TEST(Safetensors, WritesWhatTheLibraryWrites) {
  // Written by safetensors 0.8 (safetensors.torch.save_file) for these tensors: larger dtypes first
  // in the library's dtype order, then by name. (The library writes metadata in hash-map order;
  // we keep the order given, which is the file's order when rewriting a file.)
  std::vector<uint8_t> i64(16, 1), f32(8, 2), bf16(6, 3), u8(3, 4), b(2, 1), e4m3(4, 5);
  std::vector<st::TensorSource> src = {
      {"z_bool", DType::kBool, {2}, b.data()},      {"a_u8", DType::kUInt8, {3}, u8.data()},
      {"m_bf16", DType::kBF16, {3}, bf16.data()},   {"k_f32", DType::kFP32, {2}, f32.data()},
      {"c_i64", DType::kInt64, {2}, i64.data()},    {"b_f32", DType::kFP32, {0, 4}, nullptr},
      {"f_e4m3", DType::kFP8E4M3, {2, 2}, e4m3.data()},
  };
  const std::string bytes = st::serialize(src, {{"z", "1"}, {"a", "2"}});
  const std::string expected_json =
      R"({"__metadata__":{"z":"1","a":"2"},"c_i64":{"dtype":"I64","shape":[2],"data_offsets":[0,16]},)"
      R"("b_f32":{"dtype":"F32","shape":[0,4],"data_offsets":[16,16]},"k_f32":{"dtype":"F32","shape":[2],"data_offsets":[16,24]},)"
      R"("m_bf16":{"dtype":"BF16","shape":[3],"data_offsets":[24,30]},"f_e4m3":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[30,34]},)"
      R"("a_u8":{"dtype":"U8","shape":[3],"data_offsets":[34,37]},"z_bool":{"dtype":"BOOL","shape":[2],"data_offsets":[37,39]}})";
  const uint64_t n = bytes.size() - 39 - 8;
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes.substr(8, expected_json.size()), expected_json);
  EXPECT_EQ(bytes.substr(8 + expected_json.size(), n - expected_json.size()),
            std::string(n - expected_json.size(), ' '));
  const st::Header h = parse(bytes);
  EXPECT_EQ(h.tensors.size(), 7u);
  EXPECT_EQ(std::memcmp(bytes.data() + h.data_start + h.find("m_bf16")->begin, bf16.data(), 6), 0);

  std::vector<st::TensorSource> dup = {{"a", DType::kUInt8, {1}, u8.data()}, {"a", DType::kUInt8, {1}, u8.data()}};
  expect_error_naming([&] { st::serialize(dup); }, "tensor 'a' given twice");
  expect_error_naming([&] { st::serialize({}, {{"k", "1"}, {"k", "2"}}); }, "metadata key 'k' given twice");
  std::vector<st::TensorSource> bad = {{"bad\xff", DType::kUInt8, {1}, u8.data()}};
  expect_error_naming([&] { st::serialize(bad); }, "cannot encode the header");
}

TEST(Safetensors, FilesOfTheLibraryRoundTripByteForByte) {
  const std::string dir = source_dir() + "/fixtures/hf/";
  for (const char* family : {"mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v3", "gpt_oss"}) {
    for (const char* file : {"model.safetensors", "io.safetensors"}) {
      const std::string path = dir + family + "/" + file;
      SCOPED_TRACE(path);
      Metadata meta;
      const StateDict sd = load_safetensors(path, &meta);
      ASSERT_FALSE(sd.empty());
      const std::string out = tmp_path("roundtrip.safetensors");
      save_safetensors(out, sd, meta);
      EXPECT_TRUE(read_file(out) == read_file(path)) << "rewritten file differs from the one transformers wrote";
      std::remove(out.c_str());
    }
  }
}

TEST(Safetensors, FileErrors) {
  expect_error_naming([] { st::File::open("/nonexistent/x.safetensors"); }, "cannot open");
  expect_error_naming([] { st::File::open("/tmp"); }, "not a regular file");
  const std::string empty = tmp_path("empty.safetensors");
  { std::ofstream(empty, std::ios::binary); }
  expect_error_naming([&] { st::File::open(empty); }, "too short");
  const std::string bad = tmp_path("bad.safetensors");
  {
    std::ofstream out(bad, std::ios::binary);
    out << raw(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", "short");
  }
  expect_error_naming([&] { st::File::open(bad); }, bad + ": tensor 'a' data_offsets [0, 16] run past the end");
  std::remove(empty.c_str());
  std::remove(bad.c_str());
}

TEST(Safetensors, WriteIsAtomicAndReportsProgress) {
  const std::string path = tmp_path("progress.safetensors");
  std::vector<float> a(1000, 1.5f);
  uint64_t last = 0, total = 0;
  int calls = 0;
  st::write_file(path, {{"a", DType::kFP32, {1000}, a.data()}}, {}, [&](uint64_t done, uint64_t t) {
    EXPECT_GE(done, last);
    last = done;
    total = t;
    ++calls;
  });
  EXPECT_EQ(total, 4000u);
  EXPECT_EQ(last, 4000u);
  EXPECT_GE(calls, 2);
  EXPECT_EQ(files_starting_with(path + ".tmp"), 0);  // renamed into place
  auto f = st::File::open(path);
  float v;
  std::memcpy(&v, f->data(f->at("a")) + 4 * 999, 4);
  EXPECT_EQ(v, 1.5f);
  expect_error_naming([&] { f->at("b"); }, "no tensor named 'b'");
  // A failed write leaves no file behind.
  expect_error_naming([&] { st::write_file("/nonexistent/dir/x.safetensors", {}); }, "cannot create");
  std::remove(path.c_str());
}

// The temporary file a write goes through is created afresh, never opened over an existing one: a
// converted input named like a temporary (`<out>.tmp`, the name writes used to take), read through
// its mapping while the output is written, stays intact, and so does a file standing at the first
// name a write tries now.
TEST(Safetensors, WritingNeverTruncatesAnExistingFile) {
  const std::string path = tmp_path("inplace.safetensors");
  const std::string input = path + ".tmp";
  const std::string squatter = path + ".tmp." + std::to_string(::getpid()) + ".0";
  std::vector<float> a(4096);
  for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i);
  st::write_file(input, {{"a", DType::kFP32, {4096}, a.data()}});
  { std::ofstream(squatter, std::ios::binary) << "not mine"; }
  const std::string before = read_file(input);
  {
    auto f = st::File::open(input);
    st::write_file(path, {{"a", DType::kFP32, {4096}, f->data(f->at("a"))}});
  }
  EXPECT_EQ(read_file(input), before);
  EXPECT_EQ(read_file(squatter), "not mine");
  std::remove(squatter.c_str());
  auto out = st::File::open(path);
  EXPECT_EQ(std::memcmp(out->data(out->at("a")), a.data(), a.size() * 4), 0);
  std::remove(input.c_str());
  std::remove(path.c_str());
}

// The output path: a FIFO or a directory there is refused, not renamed over (a device such as
// /dev/null would have become a regular file); a replaced file keeps its permission bits; a link
// stays a link and the file it names gets the data; an empty name or a dangling link is refused.
TEST(Safetensors, WriteTargetsOnlyRegularFiles) {
  std::vector<float> a(16, 1.5f);
  const std::vector<st::TensorSource> tensors = {{"a", DType::kFP32, {16}, a.data()}};
  const std::string fifo = tmp_path("out_fifo.safetensors");
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error_naming([&] { st::write_file(fifo, tensors); }, "not a regular file");
  struct stat sb {};
  ASSERT_EQ(::stat(fifo.c_str(), &sb), 0);
  EXPECT_TRUE(S_ISFIFO(sb.st_mode));
  std::remove(fifo.c_str());
  const std::string dir = tmp_path("out_dir.safetensors");
  ::rmdir(dir.c_str());
  ASSERT_EQ(::mkdir(dir.c_str(), 0700), 0);
  expect_error_naming([&] { st::write_file(dir, tensors); }, "not a regular file");
  ::rmdir(dir.c_str());
  expect_error_naming([&] { st::write_file("", tensors); }, "'path'");

  const std::string file = tmp_path("private.safetensors");
  { std::ofstream(file, std::ios::binary) << "old"; }
  ASSERT_EQ(::chmod(file.c_str(), 0600), 0);
  st::write_file(file, tensors);
  ASSERT_EQ(::stat(file.c_str(), &sb), 0);
  EXPECT_EQ(sb.st_mode & 07777, 0600u);

  const std::string link = tmp_path("link.safetensors");
  std::remove(link.c_str());
  ASSERT_EQ(::symlink(file.c_str(), link.c_str()), 0);
  a[0] = 2.5f;
  st::write_file(link, tensors);
  ASSERT_EQ(::lstat(link.c_str(), &sb), 0);
  EXPECT_TRUE(S_ISLNK(sb.st_mode));
  auto out = st::File::open(file);
  EXPECT_EQ(reinterpret_cast<const float*>(out->data(out->at("a")))[0], 2.5f);
  std::remove(link.c_str());
  std::remove(file.c_str());
  ASSERT_EQ(::symlink(tmp_path("nowhere/x.safetensors").c_str(), link.c_str()), 0);
  expect_error_naming([&] { st::write_file(link, tensors); }, "symbolic link");
  std::remove(link.c_str());
}

// Opening a FIFO (a name an untrusted path may carry) returns an error at once: it is not a
// regular file, and opening it must not wait for a writer.
TEST(Safetensors, OpeningAFifoFailsWithoutBlocking) {
  const std::string fifo = tmp_path("fifo.safetensors");
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  expect_error_naming([&] { st::File::open(fifo); }, "not a regular file");
  std::remove(fifo.c_str());
}

// A header of many tensors parses (the DOM is built without a per-token callback, whose cost grew
// with the square of the entries: minutes at tens of thousands).
TEST(Safetensors, ParsesAHeaderOfManyTensors) {
  constexpr int kTensors = 100000;
  std::string json = "{";
  for (int i = 0; i < kTensors; ++i)
    json += (i ? ",\"t" : "\"t") + std::to_string(i) + "\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}";
  json += "}";
  const st::Header h = parse(raw(json));
  ASSERT_EQ(h.tensors.size(), static_cast<size_t>(kTensors));
}

// The writer refuses what the reader would refuse (more than eight dimensions, a byte count that
// overflows), and writes a header of many tensors in time linear in their number.
TEST(Safetensors, WriterKeepsToWhatTheReaderAccepts) {
  const std::vector<int64_t> nine(9, 1);
  expect_error_naming([&] { st::serialize({{"a", DType::kFP32, nine, nullptr}}); }, "9 dimensions, at most 8");
  const int64_t big = int64_t{1} << 40;
  expect_error_naming([&] { st::serialize({{"a", DType::kFP32, {big, big}, nullptr}}); }, "too many elements");
  std::vector<st::TensorSource> many;
  for (int i = 0; i < 100000; ++i) many.push_back({"t" + std::to_string(i), DType::kFP32, {0}, nullptr});
  const std::string bytes = st::serialize(many);
  EXPECT_EQ(parse(bytes).tensors.size(), 100000u);
}

TEST(Safetensors, LoadedTensorsBorrowTheMappingAndCopyOnWrite) {
  const std::string path = tmp_path("borrow.safetensors");
  std::vector<float> a = {1, 2, 3, 4};
  st::write_file(path, {{"a", DType::kFP32, {2, 2}, a.data()}});
  StateDict sd = load_safetensors(path);
  std::remove(path.c_str());  // the mapping keeps the data
  HostTensor t = sd.at("a");
  EXPECT_TRUE(t.is_borrowed());
  const uint8_t* mapped = t.data();
  reinterpret_cast<float*>(t.mutable_data())[0] = 9;  // copies first: the mapping is read-only
  EXPECT_NE(t.data(), mapped);
  EXPECT_EQ(reinterpret_cast<const float*>(sd.at("a").data())[0], 1.0f);
  // Owned copies share bytes until one is written.
  HostTensor u = t;
  reinterpret_cast<float*>(u.mutable_data())[1] = 7;
  EXPECT_EQ(reinterpret_cast<const float*>(t.data())[1], 2.0f);
  EXPECT_EQ(reinterpret_cast<const float*>(u.data())[0], 9.0f);
  EXPECT_EQ(t.reshaped({4}).shape_string(), "[4]");
  expect_error_naming([&] { t.reshaped({3}); }, "new shape 3");
}

// Every seed of the fuzz corpus either parses or is rejected with a moe::Error (the fuzz target
// itself runs under ASan in tests/fuzz/run_fuzz.sh; this keeps the corpus meaningful in ctest).
TEST(Safetensors, FuzzCorpusParsesOrFailsCleanly) {
  const std::string dir = source_dir() + "/fuzz/corpus";
  DIR* d = opendir(dir.c_str());
  ASSERT_NE(d, nullptr) << dir;
  int files = 0, valid = 0;
  while (dirent* e = readdir(d)) {
    if (e->d_name[0] == '.') continue;
    const std::string bytes = read_file(dir + "/" + e->d_name);
    ++files;
    try {
      parse(bytes);
      ++valid;
    } catch (const Error&) {
    }
  }
  closedir(d);
  EXPECT_GE(files, 10);
  EXPECT_GE(valid, 3);
  EXPECT_LT(valid, files);
}

}  // namespace
}  // namespace moe
