// `moevement launch` (the head: starts the workers, runs the coordinator, shows progress) and
// `moevement worker` (what the launcher starts, once per stage replica and spare). A program
// with custom stage types calls these with its own registry (examples/custom_stage).
#pragma once

#include "engine/stage_registry.hpp"

namespace moevement::launcher {

// `moevement launch`'s exit status when SIGUSR1 stopped it with a window on disk to resume from
// (EX_TEMPFAIL: run it again with --resume).
inline constexpr int launch_stopped_status = 75;

int run_launch(int argc, char** argv, const engine::stage_registry& registry);
int run_worker(int argc, char** argv, const engine::stage_registry& registry);

}  // namespace moevement::launcher
