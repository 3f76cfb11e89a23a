// The worker processes the head started (`moevement worker ...`, or srun for the Slurm
// backend): started in their own process group and dying with the head, reaped as they exit,
// and ended (Shutdown, then SIGTERM, then SIGKILL) when the job ends.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "transport/link.hpp"

namespace moevement::launcher {

// "exited with status 1", "was killed by signal 9 (Killed)".
std::string exit_text(int status);

class worker_processes {
 public:
  explicit worker_processes(std::string token) : token_(std::move(token)) {}
  worker_processes(const worker_processes&) = delete;
  worker_processes& operator=(const worker_processes&) = delete;

  // Starts `self args...` as node `node`, with the job's token in its environment. Throws.
  // outlive_head: it does not die with this process (a standby head takes over).
  // keep: descriptors the child holds too, as 3, 4, ... (the job's locks, which a standby head
  // shares: launch_start.hpp job_lock).
  void start(const std::string& self, const std::vector<std::string>& args, transport::node_id node,
             bool outlive_head = false, const std::vector<int>& keep = {});
  // A process started elsewhere that counts as node `node` (srun: 0).
  void adopt(pid_t pid, transport::node_id node) {
    children_[pid] = node;
    ended_.erase(node);
  }
  void forget(pid_t pid) { children_.erase(pid); }
  // The pid of node's process, if it is a child of this one still running.
  std::optional<pid_t> pid_of(transport::node_id node) const {
    for (const auto& [p, n] : children_) {
      if (n == node) return p;
    }
    return std::nullopt;
  }
  // Leaves every child alone from now on (a standby head took them over).
  void forget_all() { children_.clear(); }
  // Reaps every child that exited: on_exit(node, pid, wait status) for each of ours.
  void reap_exited(const std::function<void(transport::node_id, pid_t, int)>& on_exit);
  // How node's process ended, if this launcher started it: `started` false when it did not;
  // `status` (a wait status) once it exited (reaped or not: reap_exited still reports it).
  struct child_end {
    bool started = false;
    std::optional<int> status;
  };
  child_end end_of(transport::node_id node);
  // SIGKILL to node's process if it is still `pid` (a hung worker must not wake up later and
  // talk as if nothing happened).
  void kill_node(transport::node_id node, int pid);
  // SIGKILL to node's process, whatever its pid (one that never said hello, hung as it started).
  void kill_child_of(transport::node_id node);
  // The same for a process this one did not start (a standby head that took over): only if
  // `pid` runs `moevement worker --head HEAD ... --node NODE` (the pid came over the wire, and
  // another job's worker of that node may have been given it since).
  static void kill_worker(transport::node_id node, int pid, const std::string& head);
  // Ends every child: waits up to `grace` for them to exit on their own (after Shutdown), then
  // SIGTERM, then SIGKILL. Returns the workers (not node 0) that ended badly within the grace:
  // a crash while shutting down.
  std::vector<std::string> end_all(std::chrono::milliseconds grace);

 private:
  // Waits up to `within` for children to exit; bad exits go to `bad` unless null.
  void reap(std::chrono::milliseconds within, std::vector<std::string>* bad);

  std::string token_;
  std::map<pid_t, transport::node_id> children_;
  // Children this one killed (kill_node: a lost or fenced worker): their SIGKILL is no crash
  // while shutting down, however late it is reaped.
  std::set<pid_t> killed_;
  std::map<transport::node_id, int> ended_;  // wait statuses of the children reaped
};

}  // namespace moevement::launcher
