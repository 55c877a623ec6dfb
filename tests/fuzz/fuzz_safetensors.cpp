// libFuzzer target: arbitrary bytes as a safetensors file, and as a sharded checkpoint's index (run by
// tests/fuzz/run_fuzz.sh under AddressSanitizer + UBSan).
//
// The only acceptable outcomes are a parsed header or a moe::Error. For a parsed header the target
// also checks what parsing promises: every tensor's bytes lie inside the buffer (each byte is read,
// so ASan catches an over-read), the tensors tile the data section exactly, and writing the
// tensors back and parsing again gives the same tensors. Parsed files are then run through the
// layer discovery and conversions of every format, which read names and shapes from the file
// (and the quantization formats from its __metadata__).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "moe/checkpoint_convert.h"
#include "moe/error.h"
#include "moe/safetensors.h"
#include "moe/safetensors_index.h"

namespace {

void check(bool ok, const char* what) {
  if (!ok) {
    std::fprintf(stderr, "fuzz_safetensors: invariant violated: %s\n", what);
    std::abort();
  }
}

void convert_all_ways(const moe::safetensors::Header& h, const uint8_t* data) {
  using moe::CheckpointFormat;
  moe::StateDict sd;
  for (const auto& t : h.tensors)
    sd.emplace(t.name, moe::HostTensor::borrow(t.dtype, t.shape, data + h.data_start + t.begin, nullptr));
  const char* formats[] = {"per-expert", "grouped",     "hf:mixtral",    "hf:qwen3_moe", "hf:deepseek",
                           "hf:gpt_oss", "hf:nemotron_h", "hf:mistral4", "hf:gemma4",   "hf:granitemoe",
                           "hf:qwen3_vl_moe", "hf:deepseek_v4", "hf:hy_v4",
                           "hf:minimax_m3_vl", "hf:minimax_m3_vl_text", "hf:inkling_mm_model",
                           "hf:openai_privacy_filter"};
  for (const char* from : formats) {
    for (const char* to : {"grouped", "per-expert", "hf:mixtral", "hf:gpt_oss"}) {
      moe::ConvertOptions o;
      o.from = CheckpointFormat::parse(from);
      o.to = CheckpointFormat::parse(to);
      for (bool dequantize : {false, true}) {  // and written as the values they decode to
        if (dequantize) o.dequantize = moe::DType::kBF16;
        moe::StateDict copy = sd;
        try {
          moe::Metadata metadata = h.metadata;
          moe::convert_state_dict(copy, o, metadata);  // quantized layers as the metadata declares
        } catch (const moe::Error&) {
        }
      }
    }
  }
}

// The same bytes as a sharded checkpoint's index: a parsed index is written back and read again
// to the same weight_map and other members.
void parse_as_index(const uint8_t* data, size_t size) {
  namespace st = moe::safetensors;
  st::ShardIndex index;
  try {
    index = st::parse_index(std::string(reinterpret_cast<const char*>(data), size), "fuzz input");
  } catch (const moe::Error&) {
    return;
  }
  const st::ShardIndex again = st::parse_index(st::format_index(index), "rewritten index");
  check(again.weight_map == index.weight_map && again.other_json == index.other_json, "index rewrite keeps it");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  namespace st = moe::safetensors;
  parse_as_index(data, size);
  st::Header h;
  try {
    h = st::parse_header(data, size, "fuzz input");
  } catch (const moe::Error&) {
    return 0;
  }
  check(h.data_start + h.data_size == size, "data section ends at the end of the buffer");
  uint64_t pos = 0;
  unsigned sum = 0;
  std::vector<st::TensorSource> src;
  for (const st::TensorEntry& t : h.tensors) {
    check(t.begin == pos && t.end >= t.begin && t.end <= h.data_size, "tensors tile the data section");
    pos = t.end;
    const uint8_t* p = data + h.data_start + t.begin;
    for (uint64_t i = 0; i < t.nbytes(); ++i) sum += p[i];
    src.push_back({t.name, t.dtype, t.shape, p});
  }
  check(pos == h.data_size, "no trailing bytes");

  const std::string again = st::serialize(src, h.metadata);  // must not throw for a parsed file
  const st::Header h2 = st::parse_header(reinterpret_cast<const uint8_t*>(again.data()), again.size(), "rewritten");
  check(h2.tensors.size() == h.tensors.size() && h2.metadata == h.metadata, "rewrite keeps tensors and metadata");
  for (const st::TensorEntry& t : h.tensors) {
    const st::TensorEntry* u = h2.find(t.name);
    check(u && u->dtype == t.dtype && u->shape == t.shape && u->nbytes() == t.nbytes(), "rewrite keeps entries");
    check(std::memcmp(again.data() + h2.data_start + u->begin, data + h.data_start + t.begin, t.nbytes()) == 0,
          "rewrite keeps bytes");
  }
  convert_all_ways(h, data);
  return static_cast<int>(sum & 0);
}
