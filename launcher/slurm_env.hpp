// What a task learns about itself from the environment `srun` gives it (docs/slurm.md).
// Everything here is untrusted text: each value is checked, and a bad one raises
// slurm_env_error naming the variable, its value and what is wrong.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace moevement::launcher {

class slurm_env_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Limits on untrusted input, one default each: a node list expands to at most
// max_expanded_nodes names (a typo like n[0-999999999] must not exhaust memory) and no name
// is longer than max_node_name.
inline constexpr std::size_t max_expanded_nodes = 65536;
inline constexpr std::size_t max_node_name = 255;
inline constexpr std::int64_t max_tasks = 1 << 20;

// Expands a Slurm host list: comma-separated names, each with any number of bracket groups
// of comma-separated numbers and ranges, e.g. "n[1-3,5],m7" -> n1 n2 n3 n5 m7 and
// "n[01-10]" -> n01 .. n10 (a lower bound with a leading zero fixes the width; the upper
// bound may not be wider then). "r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2. Order is kept,
// duplicates are rejected. Throws slurm_env_error (without a variable name) on bad input.
std::vector<std::string> expand_node_list(std::string_view list);

// "2(x3),1" -> 2 2 2 1 (SLURM_TASKS_PER_NODE's syntax).
std::vector<int> expand_tasks_per_node(std::string_view text);

struct slurm_env {
  int proc_id = 0;                       // SLURM_PROCID: this task's rank, 0 .. ntasks-1
  int ntasks = 0;                        // SLURM_NTASKS (SLURM_STEP_NUM_TASKS when absent)
  std::vector<std::string> nodes;        // SLURM_STEP_NODELIST, else SLURM_NODELIST, expanded
  std::string node_name;                 // SLURMD_NODENAME: this task's node (hostname is not:
                                         // several node names may share a host)
  std::vector<int> tasks_per_node;       // SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE;
                                         // empty when neither is set
  std::string launch_node_ipaddr;        // SLURM_LAUNCH_NODE_IPADDR (where srun runs); "" if unset
  std::uint64_t job_id = 0;              // SLURM_JOB_ID
  std::optional<std::uint64_t> step_id;  // SLURM_STEP_ID; unset in a batch script

  // Index of node_name in nodes.
  [[nodiscard]] int node_index() const;
  // One line of JSON, keys in a fixed order.
  [[nodiscard]] std::string to_json() const;
};

// Reads the variables through `lookup` (nullptr = unset), so tests need no process env.
slurm_env parse_slurm_env(const std::function<const char*(const char*)>& lookup);
// The same from this process's environment.
slurm_env slurm_env_from_process();

}  // namespace moevement::launcher
