#include "moe/dtype.h"

#include "moe/error.h"

namespace moe {

namespace {
struct DTypeInfo {
  DType type;
  int bits;
  const char* name;
};
constexpr DTypeInfo kInfo[] = {
    {DType::kBF16, 16, "bf16"},        {DType::kFP16, 16, "fp16"},         {DType::kFP32, 32, "fp32"},
    {DType::kFP64, 64, "fp64"},        {DType::kInt32, 32, "int32"},       {DType::kInt64, 64, "int64"},
    {DType::kUInt8, 8, "uint8"},       {DType::kBool, 8, "bool"},          {DType::kFP8E4M3, 8, "fp8_e4m3"},
    {DType::kFP8E5M2, 8, "fp8_e5m2"}, {DType::kE8M0, 8, "e8m0"},          {DType::kFP4E2M1, 4, "fp4_e2m1"},
};

const DTypeInfo& info(DType t) {
  for (const auto& i : kInfo)
    if (i.type == t) return i;
  detail::throw_error("dtype: unknown enum value ", static_cast<int>(t));
}
}  // namespace

int dtype_bits(DType t) { return info(t).bits; }

int64_t dtype_bytes(DType t, int64_t numel) { return (numel * dtype_bits(t) + 7) / 8; }

const char* dtype_name(DType t) { return info(t).name; }

DType dtype_from_name(const std::string& name, const char* what) {
  for (const auto& i : kInfo)
    if (name == i.name) return i.type;
  detail::throw_error("argument '", what, "': unknown dtype '", name, "'");
}

}  // namespace moe
