// Simulator configuration: one TOML file (examples/configs/simulate_*.toml), every key
// overridable with `--set key=value`, unknown keys and wrong types rejected with the key's name.
// Also reads the profile file our engine will write (`moevement bench policies --profile-out`),
// whose measured values replace the analytical ones. Formats: docs/simulator.md.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sim/cost_model.hpp"
#include "sim/ettr.hpp"

namespace moevement::sim {

struct profile_data {
  int format_version = 1;
  std::string producer;
  double iteration_s = -1;                   // measured fault-free iteration time
  double update_s = -1;                      // optimizer step
  double sync_s = -1;                        // gradient synchronization
  std::vector<double> stage_microbatch_s;    // forward + backward of one micro-batch, per stage
  double snapshot_bytes_per_s_per_gpu = -1;  // sustained snapshot + replication bandwidth
  double restart_s = -1;                     // detection to replacement ready
  // Wall time per iteration outside the iteration's own time (the coordinator's messaging
  // between iterations): counts as overhead; < 0: not measured (0).
  double dispatch_s = -1;
  // End of a checkpointed iteration (a window's last) until its checkpoint can be recovered
  // from, as the engine measured it (replication and its acknowledgement); < 0: modelled.
  double persist_lag_s = -1;
  std::map<std::string, double> snapshot_s;  // measured full-checkpoint time per policy name
  // Measured time to load a policy's checkpoint back on recovery (a rollback's every stage, or
  // moevement's pull of the persisted window), per policy name; replaces the modelled load.
  std::map<std::string, double> load_s;
  // Measured persist lag per policy name; replaces persist_lag_s for that policy.
  std::map<std::string, double> policy_persist_lag_s;
  // Measured restart per policy name; replaces restart_s for that policy (our engine's rollback
  // rewires every stage, moevement's recovery only the replacement).
  std::map<std::string, double> policy_restart_s;
  // Every measured persist lag per policy name (one per checkpoint): the lag's distribution,
  // whose tail decides how often a rollback goes one interval further back. Optional (format 1
  // files without it read as before); the single values above stay the median.
  std::map<std::string, std::vector<double>> persist_lag_samples_s;
  // The expert-parallel degree the profile was measured at when above 1 (0: not said; a config
  // whose plan.ep differs from a said one is refused), and the expert all-to-all's share of one
  // micro-batch's forward + backward (the engine's expert wait per micro-batch); < 0: modelled.
  int ep = 0;
  double alltoall_s = -1;
  // moevement: a lost stage's replay per replayed iteration, as the engine measured it
  // (recovery_end's replay_s / iterations_replayed); < 0: modelled from the stage times.
  double replay_iteration_s = -1;
};

struct sweep_settings {
  std::vector<std::string> models{"deepseek-32b", "deepseek-67b", "deepseek-145b", "deepseek-671b"};
  std::vector<int> gpus{512, 1536, 4096, 16384};
  std::vector<int> stages{16, 24, 32, 64};
  std::vector<int> pipelines{4, 8, 16, 32};
  std::vector<double> mtbf_minutes{60, 30, 10};
  std::vector<std::string> policies{"dense-memory", "moevement"};
  int microbatches_per_stage = 2;  // M = this x PP (the paper does not give Figure 11's batch)
};

struct sim_config {
  std::string name;
  model_inputs inputs;
  std::vector<policy_settings> policies;
  failure_settings failures;
  std::vector<double> mtbf_s;
  std::vector<failure_event> trace;  // empty: Poisson failures
  std::optional<profile_data> profile;
  sweep_settings sweep;
  std::vector<std::filesystem::path> files;  // what it read: the config, a trace, a profile
};

// `base_dir` resolves relative paths (failures.trace, profile.file). Overrides are "key=value"
// with TOML values (strings may be bare). Throws std::invalid_argument naming the key.
sim_config parse_config(std::string_view toml_text, const std::vector<std::string>& overrides,
                        const std::filesystem::path& base_dir);
sim_config load_config(const std::filesystem::path& file,
                       const std::vector<std::string>& overrides);

profile_data parse_profile(std::string_view toml_text);
// Replaces modelled costs by measured ones and returns the adjusted costs.
iteration_costs apply_profile(iteration_costs costs, const profile_data& p);

}  // namespace moevement::sim
