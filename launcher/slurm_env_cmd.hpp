// `moevement slurm-env`: prints what this task learned from Slurm, as one line of JSON.
// A diagnostic for cluster setups (run it under srun) and the Slurm tests' probe.
#pragma once

#include <ostream>

namespace moevement::launcher {

// Returns 0; throws slurm_env_error (with the variable named) outside a valid Slurm step.
int run_slurm_env(std::ostream& out);

}  // namespace moevement::launcher
