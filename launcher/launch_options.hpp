// The command line of `moevement launch CONFIG [...]`, parsed, and the job it names checked
// before anything starts: the config with its --set overrides, the injections (the config's
// [[inject]] tables first, then --inject), and the flags.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "engine/job_config.hpp"
#include "launcher/inject.hpp"
#include "models/config.hpp"

namespace moevement::launcher {

extern const char* const launch_usage;

struct launch_options {
  std::string config_path;
  models::config_map raw;  // the config file with the overrides applied
  std::vector<injection> injections;
  std::vector<std::string> overrides, sbatch_args;
  std::string report;  // --report FILE: `moevement report` of the run log when the job ends
  bool sbatch = false, dry_run = false, resume = false;
  // --requeue: on SIGUSR1, once a window is on disk, requeue this Slurm batch job, which then
  // resumes on its own; requeued: this is such a job starting again (SLURM_RESTART_COUNT > 0).
  bool requeue = false, requeued = false;
  // --standby-of HOST:PORT --node N: this process is the job's standby head (cluster.
  // standby_head; `launch` starts it): it joins the head at HOST:PORT as node N and takes the
  // head's place when the head is lost.
  std::string standby_of;
  std::uint32_t standby_node = 0;
  // --locks N: the standby was started holding the head's N job locks as descriptors 3, ...
  int standby_locks = 0;
};

// Parses argv (argv[2] is CONFIG). nullopt: a usage error, already printed with the usage.
// Throws std::invalid_argument for flags that do not go together, and for a bad config or
// injection spec.
std::optional<launch_options> parse_launch_options(int argc, char** argv);

// The job resolved from the options and checked as the workers will (host memory, the wire's
// limits, the stage type is registered by the caller). Throws with what to change.
engine::job_config checked_job(const launch_options& o);

}  // namespace moevement::launcher
