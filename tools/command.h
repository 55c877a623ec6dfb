// Subcommands of the moe-engine tool register themselves, one file each:
//
//   // tools/foo_command.cpp
//   static void setup_foo(CLI::App& app) { auto* sub = app.add_subcommand("foo", "..."); ... }
//   MOE_REGISTER_COMMAND(setup_foo);
//
// main.cpp adds every registered command to the app, so a new subcommand (e.g. `bench`) is one
// more file in tools/ and nothing else. A command's callback reports failures by throwing (a
// moe::Error or any std::exception); main prints the message and exits with status 1.
#pragma once

#include <vector>

#include <CLI/CLI.hpp>

namespace moe::tools {

using CommandSetup = void (*)(CLI::App& app);

// Every command registered so far, in static-initialisation order (the order --help lists them in).
std::vector<CommandSetup>& registered_commands();

struct CommandRegistration {
  explicit CommandRegistration(CommandSetup setup) { registered_commands().push_back(setup); }
};

}  // namespace moe::tools

#define MOE_REGISTER_COMMAND(setup) \
  static const ::moe::tools::CommandRegistration moe_command_registration_##setup{setup}
