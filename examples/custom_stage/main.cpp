// A program with its own stage type: the moevement CLI (launch, worker) with "residual_mlp"
// added to the registry. The launcher starts this same binary as its workers, so they know
// the type too.
//   build/examples/custom_stage/custom_stage launch examples/custom_stage/residual_mlp.toml
#include <iostream>
#include <string_view>

#include "engine/stage_registry.hpp"
#include "examples/custom_stage/residual_mlp.hpp"
#include "launcher/launch.hpp"

int main(int argc, char** argv) {
  try {
    auto registry = moevement::engine::stage_registry::with_builtins();
    registry.add("residual_mlp", custom_stage::make_residual_mlp);
    const std::string_view command = argc > 1 ? argv[1] : "";
    if (command == "launch") return moevement::launcher::run_launch(argc, argv, registry);
    if (command == "worker") return moevement::launcher::run_worker(argc, argv, registry);
    std::cerr << "usage: custom_stage launch CONFIG [--set key=value ...]\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "custom_stage: " << e.what() << "\n";
    return 1;
  }
}
