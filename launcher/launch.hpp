// `moevement launch` (the head: starts the workers, runs the coordinator, shows progress) and
// `moevement worker` (what the launcher starts, once per stage replica and spare). A program
// with custom stage types calls these with its own registry (examples/custom_stage).
#pragma once

#include <asio/awaitable.hpp>

#include <cstdint>
#include <functional>
#include <vector>

#include "actors/actor_ref.hpp"
#include "engine/stage_registry.hpp"

namespace moevement::actors {
class actor_system;
}

namespace moevement::launcher {

// What a program adds to the head of its jobs (examples/custom_stage).
struct head_extension {
  // Every train.log_every iterations (and after the last), on the head's actor thread, beside
  // training (nothing waits for it): the head's actor system and the stage actors as they are
  // now, index d * pp + s (invalid while a stage is being rebuilt). For asks of a custom stage
  // actor's own messages; what it prints goes to the console as it is.
  std::function<asio::awaitable<void>(actors::actor_system& system, std::int64_t iteration,
                                      std::vector<actors::actor_ref> stages)>
      after_iteration;
};

// `moevement launch`'s exit status when SIGUSR1 stopped it with a window on disk to resume from
// (EX_TEMPFAIL: run it again with --resume).
inline constexpr int launch_stopped_status = 75;

int run_launch(int argc, char** argv, const engine::stage_registry& registry,
               head_extension extension = {});
int run_worker(int argc, char** argv, const engine::stage_registry& registry);

}  // namespace moevement::launcher
