// Tile configurations forced from outside the program, for experiments and benchmarks: the
// environment variable MOE_ENGINE_GEMM_CONFIGS = "op=name[,op=name...]" (op: fprop, dgrad, wgrad;
// name: a compiled configuration, GroupedGemm::configs, optionally followed by "/N" or "/M" -- the
// tile order -- and "/runR" -- the tile run -- as chosen_config reports them) is read by every
// GroupedGemm at construction, as if force_config(op, name, along_n, run) had been called -- so a layer built by a framework
// can run another configuration without a rebuild (e.g. the rows GEMM beside the heuristic's
// choice in one process, the variable set before each layer is made).
#pragma once

#include <string>
#include <vector>

#include "gemm/grouped_kernel.h"

namespace moe::gemm {

constexpr const char* kGemmConfigsEnv = "MOE_ENGINE_GEMM_CONFIGS";

struct ForcedConfig {
  Op op;
  std::string name;
  bool raster_along_n = false;
  int tile_run = 1;
};

// Parses `text` ("fprop=a,dgrad=b/N/run4"; spaces around the items are ignored; an empty text is
// no entry). Throws moe::Error naming `source` on an unknown op, an item without '=' or a name, or
// a suffix other than /N, /M, /runR (R >= 1); the names themselves are checked by GroupedGemm.
std::vector<ForcedConfig> parse_forced_configs(const std::string& text, const char* source);

}  // namespace moe::gemm
