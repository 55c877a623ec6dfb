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
    MOE_CHECK(!name.empty() && name[0] != '/', source, ": no configuration name after '", op, "='");
    ForcedConfig f{op == "fprop" ? Op::kFprop : op == "dgrad" ? Op::kDgrad : Op::kWgrad, name.substr(0, name.find('/'))};
    // Suffixes as chosen_config writes them: /N or /M, /runR.
    for (size_t at = name.find('/'); at != std::string::npos;) {
      const size_t next = name.find('/', at + 1);
      const std::string part = name.substr(at + 1, next == std::string::npos ? std::string::npos : next - at - 1);
      if (part == "N" || part == "M") {
        f.raster_along_n = part == "N";
      } else {
        const bool digits = part.size() > 3 && part.compare(0, 3, "run") == 0 &&
                            part.find_first_not_of("0123456789", 3) == std::string::npos && part.size() < 9;
        MOE_CHECK(digits && std::stoi(part.substr(3)) >= 1, source, ": unknown suffix '/", part, "' in '", item,
                  "' (expected /N, /M or /runR)");
        f.tile_run = std::stoi(part.substr(3));
      }
      at = next;
    }
    out.push_back(f);
  }
  return out;
}

}  // namespace moe::gemm
