// `--load N` of the benchmarks: N busy processes beside the job for as long as the benchmark
// runs, to show what a shared host does to the figures (issue: a neighbour's load multiplied
// the capture's cost). Each spins on one core at the default priority; all are killed and
// reaped when the object goes.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <stdexcept>
#include <vector>

namespace moevement::bench {

class busy_load {
 public:
  explicit busy_load(int processes) {
    for (int i = 0; i < processes; ++i) {
      const pid_t pid = ::fork();
      if (pid < 0) throw std::runtime_error("--load: fork failed");
      if (pid == 0) {
        volatile unsigned long spin = 0;
        for (;;) spin = spin + 1;
      }
      pids_.push_back(pid);
    }
  }
  ~busy_load() {
    for (const pid_t pid : pids_) ::kill(pid, SIGKILL);
    for (const pid_t pid : pids_) ::waitpid(pid, nullptr, 0);
  }
  busy_load(const busy_load&) = delete;
  busy_load& operator=(const busy_load&) = delete;

 private:
  std::vector<pid_t> pids_;
};

}  // namespace moevement::bench
