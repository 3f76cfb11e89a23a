#include "engine/window_budget.hpp"

#include <algorithm>
#include <limits>

namespace moevement::engine {

window_inputs window_budget(const std::vector<host_load>& hosts, double iteration_s, int replicas,
                            bool cpu) {
  window_inputs in;
  double seconds = std::numeric_limits<double>::infinity();
  for (const host_load& h : hosts) {
    if (h.compute_s.empty() || h.copy_bytes_per_s <= 0) continue;
    const double cores = std::max(1.0, h.cores);
    const int processes = std::max<int>(h.processes, int(h.compute_s.size()));
    // Every captured byte is copied 1 + r times.
    double b = h.copy_bytes_per_s / double(1 + std::max(0, replicas));
    double t = iteration_s;
    if (cpu) {
      double computed = 0;
      for (double c : h.compute_s) computed += std::max(0.0, c);
      t = std::max(0.0, cores * iteration_s - computed) / double(processes);
    } else {
      // More processes than cores take turns on the host's side of the copies.
      b /= std::max(1.0, double(processes) / cores);
    }
    if (in.bandwidth == 0 || b < in.bandwidth) in.bandwidth = b;
    seconds = std::min(seconds, t);
  }
  in.seconds = in.bandwidth > 0 ? seconds : 0;
  return in;
}

}  // namespace moevement::engine
