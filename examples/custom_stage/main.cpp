// A program with its own stage types: the moevement CLI (launch, worker) with "residual_mlp"
// added to the registry, with a stage actor of its own (residual_mlp_actor: the engine's
// protocol plus a StatsQuery message), and "residual_moe", a mixture-of-experts stage that
// takes parallel.ep (stage_traits::expert_parallel). The launcher starts this same binary as its
// workers, so they know the type too; the head asks every stage for its weights' statistics every
// train.log_every iterations and prints a `stats` line.
//   build/examples/custom_stage/custom_stage launch examples/custom_stage/residual_mlp.toml
#include <fmt/format.h>

#include <chrono>
#include <iostream>
#include <string_view>

#include "actors/gather.hpp"
#include "engine/stage_registry.hpp"
#include "examples/custom_stage/residual_mlp.hpp"
#include "examples/custom_stage/residual_mlp_actor.hpp"
#include "examples/custom_stage/residual_moe.hpp"
#include "launcher/launch.hpp"

namespace {

namespace actors = moevement::actors;
namespace wire = custom_stage::wire;

// The head's part (launcher::head_extension): ask every stage actor at once, one line.
asio::awaitable<void> print_stats(actors::actor_system& system, std::int64_t iteration,
                                  std::vector<actors::actor_ref> stages) {
  auto replies = co_await actors::ask_all<wire::StatsQuery, wire::Stats>(
      system, stages, std::chrono::seconds(10), [](std::size_t, wire::StatsQuery::Builder) {});
  std::string line = fmt::format("stats  iter {:>5}:", iteration);
  for (auto& r : replies) {
    if (!r.ok()) {
      line += "  (no answer: " + r.err().message + ")";
      continue;
    }
    const auto s = r->get();
    line += fmt::format("  stage {} replica {} weight_rms {:.6f} ({} parameters)", s.getStage(),
                        s.getReplica(), s.getWeightRms(), s.getParameters());
  }
  std::cout << line << "\n" << std::flush;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    auto registry = moevement::engine::stage_registry::with_builtins();
    registry.add_actor<custom_stage::residual_mlp_actor>("residual_mlp",
                                                         custom_stage::make_residual_mlp);
    // Its stages hold experts that parallel.ep shards over the replicas (the stats actor
    // answers for it too: it reads any stage's operators).
    registry.add_actor<custom_stage::residual_mlp_actor>(
        "residual_moe", custom_stage::make_residual_moe,
        moevement::engine::stage_traits{.expert_parallel = true});
    const std::string_view command = argc > 1 ? argv[1] : "";
    if (command == "launch") {
      moevement::launcher::head_extension extension;
      extension.after_iteration = print_stats;
      return moevement::launcher::run_launch(argc, argv, registry, std::move(extension));
    }
    if (command == "worker") return moevement::launcher::run_worker(argc, argv, registry);
    std::cerr << "usage: custom_stage launch CONFIG [--set key=value ...]\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "custom_stage: " << e.what() << "\n";
    return 1;
  }
}
