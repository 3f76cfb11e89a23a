// Algorithm 1's inputs for a job, from its profiled first iteration (the coordinator calls
// this once, before it chooses W_sparse).
//
// The paper's Algorithm 1 takes the snapshot copy as free while it fits in the iteration: true
// where a GPU's copy engine moves the bytes and the NIC replicates them. Where the stages
// compute on the CPU, the capture and its r replications are copies by the same cores, so the
// time they may take without slowing training is the host's idle core time in the iteration
// (its cores x the iteration, less what its stages computed), shared by its processes.
#pragma once

#include <vector>

namespace moevement::engine {

// One host of the job in the profiled iteration.
struct host_load {
  double cores = 1;               // cores of the host
  int processes = 0;              // worker processes on it (stages, spares)
  std::vector<double> compute_s;  // what each stage on it computed (forward + backward)
  double copy_bytes_per_s = 0;    // the slowest plain snapshot copy one of them measured
};

struct window_inputs {
  double seconds = 0;    // Algorithm 1's T_iter: time a stage's snapshot may take
  double bandwidth = 0;  // its snapshot bandwidth (bytes/s), after the r replications
};

// iteration_s: the profiled iteration's wall time; replicas: the copies of each captured byte
// the host's cores make besides the capture (r, or 0 where replicas map the slots:
// checkpoint.share_memory). cpu: the stages compute on
// the CPU (else: the iteration is the budget, the paper's model). Hosts with no stage are
// ignored. A host with no idle core time gives a budget of 0 seconds: Algorithm 1 then
// stops at its own limit (two operators active per slot). bandwidth 0: nothing measured.
window_inputs window_budget(const std::vector<host_load>& hosts, double iteration_s, int replicas,
                            bool cpu);

}  // namespace moevement::engine
