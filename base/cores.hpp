// The cores this process may run on.
#pragma once

namespace moevement::base {

// The CPUs in this thread's affinity mask (a Slurm --cpus-per-task, taskset, a cgroup's
// cpuset), at least 1: what a pool of compute threads should be sized by. (The machine's
// count, std::thread::hardware_concurrency(), ignores the mask: a replay sized by it ran a
// whole node's threads on the few cores its job step was given.)
int usable_cores();

}  // namespace moevement::base
