// The `moevement` command. Each subcommand lives in its own file of launcher/.
#include <fmt/format.h>

#include <iostream>
#include <string_view>

#include "build_config.hpp"
#include "launcher/check.hpp"

namespace {

constexpr std::string_view usage = R"(usage: moevement <command> [args]

commands:
  check      verify this machine: UCX, wire format, BLIS determinism, CUDA
  version    print the version
  help       print this text
)";

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string_view command = argc > 1 ? argv[1] : "help";
    if (command == "check") return moevement::launcher::run_check(std::cout);
    if (command == "version") {
      std::cout << "moevement " << MOEVEMENT_VERSION << "\n";
      return 0;
    }
    if (command == "help" || command == "--help" || command == "-h") {
      std::cout << usage;
      return 0;
    }
    std::cerr << fmt::format("moevement: unknown command '{}'\n\n{}", command, usage);
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moevement: " << e.what() << "\n";
    return 1;
  }
}
