// Which Slurm task runs which (stage, replica) worker, and which tasks are spares.
// Deterministic: the same request always gives the same placement, so every task can compute
// it on its own. Where the copies of each worker's snapshots go is the coordinator's
// (engine/snapshot_placement.hpp, with the Slurm node as the failure domain).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

namespace moevement::launcher {

class placement_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct placement_request {
  // Tasks on each Slurm node, in node order (SLURM_TASKS_PER_NODE). srun's default block
  // distribution numbers them in that order: node 0 has tasks 0 .. tasks_per_node[0]-1, ...
  std::vector<int> tasks_per_node;
  int pp = 1;      // pipeline stages
  int dp = 1;      // data-parallel replicas of each stage
  int spares = 0;  // at least this many spare tasks; tasks beyond pp*dp + spares are spares too
};

struct worker_slot {
  int stage = 0;
  int replica = 0;
  int task = 0;  // the Slurm task (SLURM_PROCID)
  int node = 0;  // index of its node
};

struct placement {
  int pp = 0, dp = 0;
  std::vector<worker_slot> workers;  // index stage * dp + replica
  std::vector<int> spare_tasks;      // ascending
  std::vector<int> node_of_task;     // task -> node index

  [[nodiscard]] const worker_slot& worker(int stage, int replica) const;
  // The worker a task runs, or nullptr for a spare.
  [[nodiscard]] const worker_slot* worker_on_task(int task) const;
  // One line per worker and per spare node, for logs and `moevement launch`.
  [[nodiscard]] std::string describe() const;
};

// Rules, in order of priority (docs/slurm.md): replicas of a stage go to different nodes as
// far as the nodes allow (each node holds at most ceil(dp / nodes) replicas of a stage); then
// the node with the most free tasks (filling one node early would force a later stage's
// replicas together); then the node of the replica's previous stage (pipeline traffic stays
// on the node); then the lowest node index.
// Throws placement_error when the tasks are too few or the request is malformed.
placement place_workers(const placement_request& request);

}  // namespace moevement::launcher
