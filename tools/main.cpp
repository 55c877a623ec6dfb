// moe-engine: the command-line tool. Subcommands live one per file (see command.h).
#include <cstdio>
#include <exception>
#include <iostream>

#include "command.h"

namespace moe::tools {
std::vector<CommandSetup>& registered_commands() {
  static std::vector<CommandSetup> commands;  // function-local: safe from static-init order
  return commands;
}
}  // namespace moe::tools

int main(int argc, char** argv) {
  CLI::App app{"moe-engine: tools for the moe-engine expert layer"};
  app.require_subcommand(1);
  for (moe::tools::CommandSetup setup : moe::tools::registered_commands()) setup(app);
  try {
    app.parse(argc, argv);  // runs the chosen subcommand's callback
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::cerr << "moe-engine: error: " << e.what() << "\n";
    return 1;
  }
  // Output that could not be written (a full disk, a closed pipe) is a failure, not a success.
  std::cout.flush();
  if (!std::cout || std::fflush(stdout) != 0 || std::ferror(stdout)) {
    std::cerr << "moe-engine: error: cannot write to standard output\n";
    return 1;
  }
  return 0;
}
