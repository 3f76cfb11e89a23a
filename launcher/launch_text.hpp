// What `moevement launch` prints about the job as a whole: the line it starts with, the
// progress line's ETA, and the final line.
#pragma once

#include <string>

#include "engine/coordinator.hpp"
#include "engine/job_config.hpp"

namespace moevement::launcher {

// "moevement launch: model tiny (4 layers, 0.101 M parameters), pp=2 dp=1, ... checkpoint
// policy moevement".
std::string launch_line(const engine::job_config& job);

// Seconds as M:SS (the progress line's ETA).
std::string duration_text(double s);

// "final: loss L  val_loss V  tokens/s T  (N iterations, S s in iterations, W s wall)  ETTR E",
// a run that began past iteration 0 (a resume, a standby head's takeover) saying which of it is
// this run's; "-" for what nothing measured (no iteration in this run, no validation).
std::string final_line(const engine::job_outcome& o);

}  // namespace moevement::launcher
