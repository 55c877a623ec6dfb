// Reading and writing safetensors files (docs/semantics.md, Weight layouts and checkpoints):
// https://github.com/huggingface/safetensors
//
//   [u64 little-endian N][N bytes of JSON header][data section]
//   header: {"__metadata__": {str: str}, "<name>": {"dtype": "F32", "shape": [..], "data_offsets": [b, e]}, ...}
//
// A checkpoint is untrusted input. parse_header() validates everything before any tensor byte is
// touched: the header length against the file, the JSON itself (a real parser, nesting and
// duplicate names rejected), every entry's dtype / shape / offsets, that each tensor's byte count
// equals numel x dtype size, and that the tensors tile the data section exactly -- no tensor out of
// the file, no overlap, no hole, no trailing bytes (the format's own rule, which rules out
// polyglot files). Every problem is a moe::Error naming the file and the tensor; nothing reads
// outside the buffer it was given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "moe/dtype.h"

namespace moe::safetensors {

// Largest header accepted (the reference implementation's limit): a bigger one is an error, not
// an allocation.
constexpr uint64_t kMaxHeaderBytes = 100ull << 20;
// Most dimensions a tensor may have.
constexpr int kMaxRank = 8;

// The format's dtype names: BF16, F16, F32, F64, I32, I64, U8, BOOL, F8_E4M3, F8_E5M2, F8_E8M0, F4.
const char* dtype_to_string(DType t);
// Throws moe::Error naming `what` (e.g. "tensor 'w'") for any other name (I8, U16, C64, ...).
DType dtype_from_string(const std::string& name, const std::string& what);

// __metadata__: string pairs in file order. The order is kept so that a file written back is
// identical to the one read (the safetensors library writes them in hash-map order).
using Metadata = std::vector<std::pair<std::string, std::string>>;
// The value of `key`, or null.
const std::string* find_metadata(const Metadata& metadata, const std::string& key);

struct TensorEntry {
  std::string name;
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;
  uint64_t begin = 0;  // byte range [begin, end) inside the data section
  uint64_t end = 0;

  int64_t numel() const;
  uint64_t nbytes() const { return end - begin; }
};

struct Header {
  std::vector<TensorEntry> tensors;  // in data order (ascending offsets)
  Metadata metadata;
  uint64_t data_start = 0;  // 8 + header length: file offset of the data section
  uint64_t data_size = 0;   // bytes of the data section

  const TensorEntry* find(const std::string& name) const;
};

// Parses and validates the header of a complete safetensors file held in `size` bytes at `data`.
// `source` names the file in error messages.
Header parse_header(const uint8_t* data, size_t size, const std::string& source = "safetensors data");

// A validated, read-only, memory-mapped safetensors file. Tensor bytes are read from the mapping
// (never copied); the mapping lives as long as the File (hold it by shared_ptr to lend out views).
class File {
 public:
  static std::shared_ptr<const File> open(const std::string& path);
  ~File();
  File(const File&) = delete;
  File& operator=(const File&) = delete;

  const std::string& path() const { return path_; }
  const Header& header() const { return header_; }
  const std::vector<TensorEntry>& tensors() const { return header_.tensors; }
  const Metadata& metadata() const { return header_.metadata; }
  // The entry named `name`; throws moe::Error naming the file and the tensor if absent.
  const TensorEntry& at(const std::string& name) const;
  const uint8_t* data(const TensorEntry& t) const { return base_ + header_.data_start + t.begin; }
  size_t file_size() const { return size_; }

 private:
  File() = default;
  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  Header header_;
};

// One tensor to write: contiguous row-major bytes at `data` (nbytes = numel x dtype size).
struct TensorSource {
  std::string name;
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
};

// Called while writing with (bytes written, total bytes); may be empty.
using ProgressFn = std::function<void(uint64_t done, uint64_t total)>;

// The header bytes (length prefix included) for these tensors, in the order the safetensors
// library itself writes them -- larger dtype first (its dtype order), then by name -- compact JSON
// with __metadata__ first (in the given order), padded with spaces to a multiple of 8. A file
// written here from the tensors and metadata of a file the library wrote is therefore
// byte-identical to it. Reorders `tensors` into that order. Throws moe::Error on duplicate or
// empty names and repeated metadata keys.
std::string make_header(std::vector<TensorSource>& tensors, const Metadata& metadata);

// Writes a safetensors file: to a new file beside `path` first (`path`.tmp.<pid>.<n>, created
// exclusively: an existing file, e.g. the input being converted, is never truncated), renamed over
// `path` when complete (a failed or interrupted write never leaves a truncated file under the final
// name). A symbolic link at `path` stays: the file it names is the one replaced. A replaced file
// keeps its permission bits. An existing `path` that is not a regular file (a directory, a device
// such as /dev/null, a FIFO) is refused, as is an empty path.
void write_file(const std::string& path, std::vector<TensorSource> tensors,
                const Metadata& metadata = {}, const ProgressFn& progress = {});

// The whole file in memory (tests, fuzzing).
std::string serialize(std::vector<TensorSource> tensors, const Metadata& metadata = {});

}  // namespace moe::safetensors
