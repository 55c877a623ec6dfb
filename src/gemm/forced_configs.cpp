#include "gemm/forced_configs.h"

#include "moe/error.h"

namespace moe::gemm {
namespace {

std::string trimmed(const std::string& s) {
  const size_t b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

}  // namespace

std::vector<ForcedConfig> parse_forced_configs(const std::string& text, const char* source) {
  std::vector<ForcedConfig> out;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    const std::string item = trimmed(text.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    start = comma == std::string::npos ? text.size() + 1 : comma + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    MOE_CHECK(eq != std::string::npos, source, ": expected items op=name (op: fprop, dgrad, wgrad), got '", item, "'");
    const std::string op = trimmed(item.substr(0, eq)), name = trimmed(item.substr(eq + 1));
    MOE_CHECK(op == "fprop" || op == "dgrad" || op == "wgrad", source, ": unknown op '", op,
              "' (expected fprop, dgrad or wgrad)");
    MOE_CHECK(!name.empty(), source, ": no configuration name after '", op, "='");
    out.push_back({op == "fprop" ? Op::kFprop : op == "dgrad" ? Op::kDgrad : Op::kWgrad, name});
  }
  return out;
}

}  // namespace moe::gemm
