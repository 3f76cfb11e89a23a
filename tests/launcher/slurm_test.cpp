// End-to-end tests against a real local Slurm (tests/launcher/slurm_harness.hpp): the
// harness itself, srun running the real `moevement` binary, Slurm's errors, and what happens
// to a step when one task is killed with SIGKILL. Skipped, saying why, where Slurm or munge
// is not installed.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <thread>

#include "tests/launcher/slurm_harness.hpp"

namespace moevement::testing {
namespace {

std::string moevement_bin() {
  const char* bin = std::getenv("MOEVEMENT_BIN");
  return bin ? bin : "";
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// Polls `done` every 100 ms for at most timeout_s; returns whether it became true.
template <typename Fn>
bool eventually(double timeout_s, Fn&& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return done();
}

// One 3-node cluster shared by the tests of this suite (startup is ~1.5 s).
class slurm : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    skip_reason_ = local_slurm::unavailable_reason();
    if (!skip_reason_.empty()) return;
    cluster_ = std::make_unique<local_slurm>(3);
  }
  static void TearDownTestSuite() { cluster_.reset(); }

  void SetUp() override {
    if (!skip_reason_.empty()) GTEST_SKIP() << "Slurm tests skipped: " << skip_reason_;
    ASSERT_NE(cluster_, nullptr);
    ASSERT_FALSE(moevement_bin().empty()) << "MOEVEMENT_BIN is not set (run through meson test)";
  }
  void TearDown() override {
    if (!cluster_) return;
    // No job of one test may hold resources in the next one.
    cluster_->run("jobs=$(squeue -h -o %i); [ -z \"$jobs\" ] || scancel $jobs", 10);
    if (HasFailure()) {
      std::cerr << "cluster logs:\n" << cluster_->logs();
      cluster_->keep_directory();
    }
  }

  static local_slurm& cluster() { return *cluster_; }

  // Submits `wrap` with sbatch, polls (bounded) until the job ends, prints its JobState and
  // output. sbatch --wait polls slurmctld only every few seconds.
  static command_result sbatch(const std::string& options, const std::string& wrap) {
    const auto out = cluster_->dir() + "/sbatch-" + std::to_string(++sbatch_count_) + ".out";
    return cluster_->run("id=$(sbatch --parsable " + options + " -o " + out + " --wrap '" + wrap +
                             "') || exit 1\n"
                             "for i in $(seq 300); do\n"
                             "  st=$(scontrol show job $id -o | grep -o 'JobState=[A-Z_]*')\n"
                             "  case $st in *=PENDING|*=RUNNING|*=CONFIGURING|*=COMPLETING) ;;\n"
                             "    *) break ;; esac\n"
                             "  sleep 0.1\n"
                             "done\n"
                             "echo $st; cat " +
                             out,
                         60);
  }

  // Processes of the cluster other than its daemons (srun, slurmstepd, tasks).
  static std::vector<std::string> step_processes() {
    std::vector<std::string> out;
    const auto& d = cluster_->daemons();
    for (int pid : cluster_->processes()) {
      if (std::find(d.begin(), d.end(), pid) != d.end()) continue;
      const auto c = local_slurm::comm(pid);
      if (c.empty() || c == "slurmscriptd") continue;  // gone, or slurmctld's helper
      out.push_back(std::to_string(pid) + " " + c);
    }
    return out;
  }

  static inline std::unique_ptr<local_slurm> cluster_;
  static inline std::string skip_reason_;
  static inline int sbatch_count_ = 0;
};

TEST_F(slurm, cluster_has_its_nodes_idle) {
  const auto r = cluster().run("sinfo -h -o '%D %t %N'", 20);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(r.output, "3 idle n[1-3]\n");
}

TEST_F(slurm, srun_runs_moevement_check_on_four_tasks) {
  const auto r = cluster().run("srun -n 4 -l " + moevement_bin() + " check", 120);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 0) << r.output;
  for (int task = 0; task < 4; ++task) {
    EXPECT_NE(r.output.find(std::to_string(task) + ": all checks passed"), std::string::npos)
        << "task " << task << ":\n"
        << r.output;
  }
  std::cout << "srun -n 4 moevement check: " << r.seconds << " s\n";
}

TEST_F(slurm, slurm_env_on_three_tasks_sees_distinct_ranks_and_one_node_list) {
  const auto r = cluster().run("srun -N 3 -n 3 " + moevement_bin() + " slurm-env", 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Each task's JSON line (srun's own notes, e.g. "srun: job 2 queued and waiting for
  // resources" while an earlier test's job ends, are not the tasks').
  std::vector<std::string> lines;
  for (const auto& l : lines_of(r.output)) {
    if (!l.starts_with("srun: ")) lines.push_back(l);
  }
  ASSERT_EQ(lines.size(), 3u) << r.output;
  // srun's block distribution with one task per node puts task i on node n<i+1>.
  std::set<std::string> ranks, nodes, jobs;
  for (const auto& line : lines) {
    const auto p = line.find(R"("proc_id":)");
    const auto j = line.find(R"("job_id":)");
    ASSERT_TRUE(p != std::string::npos && j != std::string::npos) << line;
    const int rank = std::atoi(line.c_str() + p + 10);
    const std::string job = std::to_string(std::atoll(line.c_str() + j + 9));
    const std::string node = "n" + std::to_string(rank + 1);
    EXPECT_EQ(line, R"({"proc_id":)" + std::to_string(rank) + R"(,"ntasks":3,"node_name":")" +
                        node + R"(","node_index":)" + std::to_string(rank) +
                        R"(,"nodes":["n1","n2","n3"],"tasks_per_node":[1,1,1],)"
                        R"("launch_node_ipaddr":"127.0.0.1","job_id":)" +
                        job + R"(,"step_id":0})");
    ranks.insert(std::to_string(rank));
    nodes.insert(node);
    jobs.insert(job);
  }
  EXPECT_EQ(ranks, (std::set<std::string>{"0", "1", "2"}));
  EXPECT_EQ(nodes, (std::set<std::string>{"n1", "n2", "n3"}));
  EXPECT_EQ(jobs.size(), 1u);
}

TEST_F(slurm, sbatch_with_an_inner_srun_runs_slurm_env) {
  const auto r = sbatch("-N 2 -n 2", "srun " + moevement_bin() + " slurm-env");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("JobState=COMPLETED"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(R"({"proc_id":0,"ntasks":2,)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find(R"({"proc_id":1,"ntasks":2,)"), std::string::npos) << r.output;
}

TEST_F(slurm, wrong_partition_is_a_clear_error) {
  const auto r = cluster().run("srun -p nosuchpartition -n 1 true", 30);
  ASSERT_FALSE(r.timed_out);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("Invalid partition name specified"), std::string::npos) << r.output;
}

TEST_F(slurm, too_few_tasks_is_a_clear_error) {
  // Inside an allocation of 2 tasks, a step of 5 is refused at once.
  const auto inside = sbatch("-n 2", "srun -n 5 true; echo srun exit $?");
  ASSERT_EQ(inside.exit_code, 0) << inside.output;
  EXPECT_NE(inside.output.find("More processors requested than permitted"), std::string::npos)
      << inside.output;
  EXPECT_NE(inside.output.find("srun exit 1"), std::string::npos) << inside.output;
  // Outside one, more tasks than the cluster can ever run: with --immediate srun says so
  // instead of queueing for ever.
  const auto outside = cluster().run("srun --immediate=5 -n 1000 true", 30);
  ASSERT_FALSE(outside.timed_out) << outside.output;
  EXPECT_NE(outside.exit_code, 0);
  EXPECT_NE(outside.output.find("Unable to allocate resources"), std::string::npos)
      << outside.output;
}

TEST_F(slurm, moevement_slurm_env_outside_a_step_names_the_missing_variable) {
  const auto r = cluster().run(moevement_bin() + " slurm-env", 30);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("is not set: run this inside a Slurm step (srun)"), std::string::npos)
      << r.output;
}

TEST_F(slurm, task_killed_with_sigkill_under_kill_on_bad_exit_ends_the_step) {
  // Task 1 kills itself with SIGKILL after 0.5 s; the others would sleep 60 s. With -K1 srun
  // must end the step at once: the bound below is the other tasks' sleep, not a speed goal.
  const auto r = cluster().run(
      "srun -K1 -N 3 -n 3 bash -c 'if [ $SLURM_PROCID = 1 ]; then sleep 0.5; kill -9 $$; fi; "
      "exec sleep 60'",
      45);
  ASSERT_FALSE(r.timed_out) << "srun hung after a task was killed:\n" << r.output;
  EXPECT_LT(r.seconds, 30.0) << "the surviving tasks ran on:\n" << r.output;
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("task 1: Killed"), std::string::npos) << r.output;
  // Nothing of the step is left behind (PID 1 here reaps orphans every ~2 s).
  EXPECT_TRUE(eventually(15, [] { return step_processes().empty(); }))
      << "left: " << ::testing::PrintToString(step_processes());
  const auto q = cluster().run("squeue -h", 10);
  EXPECT_EQ(q.output, "") << "a job is still queued or running";
  std::cout << "srun -K1 step ended " << r.seconds << " s after start (task killed at 0.5 s)\n";
}

// The harness on its own cluster: up, a step left running, down; nothing may remain.
TEST(slurm_harness, down_with_a_running_step_leaves_no_process) {
  if (const auto why = local_slurm::unavailable_reason(); !why.empty()) {
    GTEST_SKIP() << "Slurm tests skipped: " << why;
  }
  local_slurm c(2);
  const auto r = c.run("srun -N 2 -n 4 sleep 120 >" + c.dir() + "/step.out 2>&1 &", 10);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // Wait until every kind of process is there: the step's tasks run on both nodes.
  const std::vector<std::string> kinds = {"munged",     "slurmctld", "slurmd",
                                          "slurmstepd", "srun",      "sleep"};
  auto missing = [&] {
    std::map<std::string, int> count;
    for (int pid : c.processes()) ++count[local_slurm::comm(pid)];
    std::vector<std::string> out;
    for (const auto& k : kinds) {
      if (count[k] == 0) out.push_back(k);
    }
    if (count["slurmd"] < 2 || count["slurmstepd"] < 2 || count["sleep"] < 4) {
      out.push_back("(2 slurmd, 2 slurmstepd, 4 tasks)");
    }
    return out;
  };
  ASSERT_TRUE(eventually(20, [&] { return missing().empty(); }))
      << "never seen: " << ::testing::PrintToString(missing()) << "\n"
      << c.logs();
  const auto start = std::chrono::steady_clock::now();
  c.stop();
  const double stop_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  std::vector<std::string> left;
  for (int pid : c.processes()) left.push_back(std::to_string(pid) + " " + local_slurm::comm(pid));
  for (int pid : c.daemons()) {
    if (local_slurm::alive(pid)) left.push_back(std::to_string(pid) + " (daemon)");
  }
  EXPECT_TRUE(left.empty()) << "left after down: " << ::testing::PrintToString(left);
  std::cout << "slurm-local down with a running step: " << stop_s << " s\n";
}

}  // namespace
}  // namespace moevement::testing

namespace moevement::testing {
namespace {

// A test process that dies without cleaning up (SIGKILL: no destructor runs) still leaves
// nothing: the watchdog started for its --owner pid takes the cluster down.
TEST(slurm_harness, a_killed_owner_leaves_no_process) {
  if (const auto why = local_slurm::unavailable_reason(); !why.empty()) {
    GTEST_SKIP() << "Slurm tests skipped: " << why;
  }
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(fds[0]);
    std::string report;
    try {
      auto* c = new local_slurm(1);  // never freed: this process dies as a crashing test would
      c->run("srun -n 2 sleep 120 >/dev/null 2>&1 &", 10);
      report = c->dir() + "\n";
      for (int pid : c->daemons()) report += std::to_string(pid) + " ";
    } catch (const std::exception& e) {
      report = std::string("error\n") + e.what();
    }
    report += "\n";
    (void)!::write(fds[1], report.data(), report.size());
    ::kill(::getpid(), SIGKILL);
  }
  ::close(fds[1]);
  std::string report;
  char buf[1024];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) report.append(buf, n);
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status));
  const auto lines = lines_of(report);
  ASSERT_GE(lines.size(), 2u) << report;
  ASSERT_NE(lines[0], "error") << report;
  const std::string dir = lines[0];
  std::vector<int> daemons;
  std::istringstream in(lines[1]);
  for (int pid; in >> pid;) daemons.push_back(pid);
  ASSERT_GE(daemons.size(), 3u) << report;  // munged, slurmctld, slurmd
  // Whatever still runs with this cluster's SLURM_CONF, or as one of its daemons.
  auto left = [&] {
    std::vector<int> out;
    for (int pid : daemons) {
      if (local_slurm::alive(pid)) out.push_back(pid);
    }
    const auto r = run_command(
        "grep -lzx 'SLURM_CONF=" + dir + "/slurm.conf' /proc/[0-9]*/environ 2>/dev/null", 10);
    for (const auto& line : lines_of(r.output)) {
      const int pid = std::atoi(line.c_str() + 6);
      if (pid > 0 && local_slurm::alive(pid)) out.push_back(pid);
    }
    return out;
  };
  EXPECT_TRUE(eventually(30, [&] { return left().empty(); }))
      << "left after the owner died: " << ::testing::PrintToString(left());
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
}

}  // namespace
}  // namespace moevement::testing
