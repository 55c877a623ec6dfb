// Uses the installed headers and libraries without a GPU: a valid configuration validates, and a
// bad one throws moe::Error naming the field.
#include <cstdio>
#include <string>

#include "moe/error.h"
#include "moe/grouped_mlp_config.h"

int main() {
  moe::GroupedMlpConfig cfg;
  cfg.hidden = 256;
  cfg.ffn = 128;
  cfg.experts = 4;
  cfg.topk = 2;
  cfg.max_tokens = 64;
  cfg.validate();
  std::printf("consumer: valid config, fc1_out %lld, row bound %lld\n", static_cast<long long>(cfg.fc1_out()),
              static_cast<long long>(cfg.row_bound()));

  cfg.topk = 0;
  try {
    cfg.validate();
  } catch (const moe::Error& e) {
    std::printf("consumer: bad config rejected: %s\n", e.what());
    return std::string(e.what()).find("topk") != std::string::npos ? 0 : 1;
  }
  std::printf("consumer: a config with topk = 0 was accepted\n");
  return 1;
}
