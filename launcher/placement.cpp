#include "launcher/placement.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <limits>
#include <tuple>

namespace moevement::launcher {

const worker_slot& placement::worker(int stage, int replica) const {
  if (stage < 0 || stage >= pp || replica < 0 || replica >= dp) {
    throw placement_error(fmt::format("no worker (stage {}, replica {}) in a pp={} dp={} placement",
                                      stage, replica, pp, dp));
  }
  return workers[static_cast<std::size_t>(stage * dp + replica)];
}

const worker_slot* placement::worker_on_task(int task) const {
  for (const auto& w : workers) {
    if (w.task == task) return &w;
  }
  return nullptr;
}

std::string placement::describe() const {
  std::string out;
  for (const auto& w : workers) {
    out += fmt::format("stage {} replica {}: task {} on node {}\n", w.stage, w.replica, w.task,
                       w.node);
  }
  out += fmt::format("spares: tasks {}\n", fmt::join(spare_tasks, ","));
  return out;
}

placement place_workers(const placement_request& request) {
  const auto& tpn = request.tasks_per_node;
  const int nodes = static_cast<int>(tpn.size());
  const int pp = request.pp, dp = request.dp;
  if (nodes == 0) throw placement_error("placement: no Slurm nodes");
  if (pp < 1 || dp < 1) {
    throw placement_error(fmt::format("placement: pp={} and dp={} must be at least 1", pp, dp));
  }
  if (request.spares < 0) {
    throw placement_error(fmt::format("placement: spares={} must not be negative", request.spares));
  }
  long total = 0;
  for (int n : tpn) {
    if (n < 0) throw placement_error("placement: a node has a negative task count");
    total += n;
  }
  const long workers_needed = static_cast<long>(pp) * dp;
  if (total < workers_needed + request.spares) {
    throw placement_error(fmt::format(
        "too few Slurm tasks: pp={} x dp={} workers + {} spares need {} tasks, the step has {} "
        "(ask srun/sbatch for more with -n, or lower cluster.spares)",
        pp, dp, request.spares, workers_needed + request.spares, total));
  }
  const int nworkers = static_cast<int>(workers_needed);

  placement out;
  out.pp = pp;
  out.dp = dp;
  std::vector<int> first_task(static_cast<std::size_t>(nodes));
  for (int n = 0, t = 0; n < nodes; t += tpn[static_cast<std::size_t>(n)], ++n) {
    first_task[static_cast<std::size_t>(n)] = t;
    for (int i = 0; i < tpn[static_cast<std::size_t>(n)]; ++i) out.node_of_task.push_back(n);
  }

  // Workers, stage-major: the node minimising (replicas of this stage there, -free tasks, not
  // the node of the previous stage of this replica, index). Free tasks before locality: a
  // pipeline kept on one node can fill it and force a later stage's replicas together.
  std::vector<int> used(static_cast<std::size_t>(nodes), 0);
  std::vector<int> stage_count(static_cast<std::size_t>(nodes));
  out.workers.resize(static_cast<std::size_t>(nworkers));
  for (int s = 0; s < pp; ++s) {
    std::fill(stage_count.begin(), stage_count.end(), 0);
    for (int k = 0; k < dp; ++k) {
      const int previous_node =
          s > 0 ? out.workers[static_cast<std::size_t>((s - 1) * dp + k)].node : -1;
      int best = -1;
      std::tuple<int, int, int, int> best_key{};
      for (int n = 0; n < nodes; ++n) {
        const auto un = static_cast<std::size_t>(n);
        const int free = tpn[un] - used[un];
        if (free == 0) continue;
        const std::tuple key{stage_count[un], -free, n == previous_node ? 0 : 1, n};
        if (best < 0 || key < best_key) best = n, best_key = key;
      }
      // total >= workers, so some node always has a free task.
      const auto ub = static_cast<std::size_t>(best);
      auto& w = out.workers[static_cast<std::size_t>(s * dp + k)];
      w.stage = s;
      w.replica = k;
      w.node = best;
      w.task = first_task[ub] + used[ub];
      ++used[ub];
      ++stage_count[ub];
    }
  }
  for (int n = 0; n < nodes; ++n) {
    const auto un = static_cast<std::size_t>(n);
    for (int i = used[un]; i < tpn[un]; ++i) out.spare_tasks.push_back(first_task[un] + i);
  }
  std::sort(out.spare_tasks.begin(), out.spare_tasks.end());

  return out;
}

}  // namespace moevement::launcher
