#include "launcher/slurm_env_cmd.hpp"

#include "launcher/slurm_env.hpp"

namespace moevement::launcher {

int run_slurm_env(std::ostream& out) {
  out << slurm_env_from_process().to_json() << "\n";
  return 0;
}

}  // namespace moevement::launcher
