// worker_processes::kill_worker: a standby head that took over kills a lost worker by the pid
// its hello carried (untrusted), only if that process's command line is that worker's own (its
// node, and this job's head).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "launcher/worker_processes.hpp"

namespace {

using moevement::launcher::worker_processes;

// `sh -c 'sleep 30; true' worker --head HEAD --node NODE` (or `what` for worker): a live process
// with that argv (the `; true` keeps the shell from exec'ing sleep, which would replace the
// command line).
pid_t start(const char* what, const char* head, const char* node) {
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::execl("/bin/sh", "sh", "-c", "sleep 30; true", what, "--head", head, "--node", node, nullptr);
    ::_exit(127);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));  // its argv is in place
  return pid;
}

// Killed by SIGKILL within a second, or not (then it is ended here).
bool killed(pid_t pid) {
  int status = 0;
  for (int i = 0; i < 100; ++i) {
    if (::waitpid(pid, &status, WNOHANG) == pid) {
      return WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::kill(pid, SIGTERM);
  ::waitpid(pid, &status, 0);
  return false;
}

TEST(worker_processes, kill_worker_kills_only_that_nodes_worker) {
  const char* head = "127.0.0.1:4000";
  const pid_t other_node = start("worker", head, "2");
  worker_processes::kill_worker(1, other_node, head);
  EXPECT_FALSE(killed(other_node)) << "node 2's worker, asked as node 1";
  const pid_t not_a_worker = start("launch", head, "1");
  worker_processes::kill_worker(1, not_a_worker, head);
  EXPECT_FALSE(killed(not_a_worker)) << "not a worker";
  // The lost worker's pid given since to node 1 of another job on this host.
  const pid_t other_job = start("worker", "127.0.0.1:4001", "1");
  worker_processes::kill_worker(1, other_job, head);
  EXPECT_FALSE(killed(other_job)) << "another job's worker";
  const pid_t worker = start("worker", head, "1");
  worker_processes::kill_worker(1, worker, head);
  EXPECT_TRUE(killed(worker));
  worker_processes::kill_worker(1, 1, head);  // init, or a pid that came over the wire as 1: never
  worker_processes::kill_worker(1, 0, head);
  worker_processes::kill_worker(1, -1, head);
}

// A worker the launcher itself killed (lost or fenced) and reaped only at the job's end is no
// crash while shutting down; one killed by anything else is.
TEST(worker_processes, a_worker_it_killed_is_no_crash_at_the_end) {
  const char* head = "127.0.0.1:4000";
  worker_processes processes("token");
  const pid_t fenced = start("worker", head, "1");
  const pid_t crashed = start("worker", head, "2");
  processes.adopt(fenced, 1);
  processes.adopt(crashed, 2);
  processes.kill_node(1, fenced);
  ::kill(crashed, SIGKILL);
  const auto bad = processes.end_all(std::chrono::milliseconds(2000));
  ASSERT_EQ(bad.size(), 1u);
  EXPECT_NE(bad[0].find("worker 2 (pid " + std::to_string(crashed) + ") was killed by signal 9"),
            std::string::npos)
      << bad[0];
}

// How a worker ended, looked at before the launcher's SIGCHLD reaps it (the head's verdict on
// a lost worker says that, not the link's view), without taking the exit from reap_exited.
TEST(worker_processes, end_of_says_how_a_child_ended_and_leaves_it_to_reap) {
  const char* head = "127.0.0.1:4000";
  worker_processes processes("token");
  const pid_t worker = start("worker", head, "1");
  processes.adopt(worker, 1);
  EXPECT_FALSE(processes.end_of(7).started) << "not a child of this launcher";
  auto running = processes.end_of(1);
  EXPECT_TRUE(running.started);
  EXPECT_FALSE(running.status.has_value()) << "a running worker has ended?";
  ::kill(worker, SIGKILL);
  std::optional<int> status;
  for (int i = 0; i < 200 && !status; ++i) {
    status = processes.end_of(1).status;
    if (!status) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_TRUE(status.has_value());
  EXPECT_EQ(moevement::launcher::exit_text(*status), "was killed by signal 9 (Killed)");
  std::vector<std::string> reaped;
  processes.reap_exited([&](moevement::transport::node_id n, pid_t pid, int st) {
    reaped.push_back(std::to_string(n) + " " + std::to_string(pid) + " " +
                     moevement::launcher::exit_text(st));
  });
  ASSERT_EQ(reaped.size(), 1u) << "end_of took the exit from reap_exited";
  EXPECT_EQ(reaped[0], "1 " + std::to_string(worker) + " was killed by signal 9 (Killed)");
  EXPECT_EQ(processes.end_of(1).status, status) << "forgotten once reaped";
}

}  // namespace
