// `moevement launch` with cluster.backend = "slurm" against a real local Slurm of 3 nodes
// (tests/launcher/slurm_harness.hpp): pp=2 x dp=2 (+1 spare) under srun gives the local
// backend's state_hash; under policy moevement a task killed mid-run is rebuilt on a spare
// task with the same state_hash; under none a worker killed mid-run ends the job with a clear error
// naming it and leaves no srun, slurmstepd or worker; a wrong partition and too few tasks are
// clear errors. Skipped, saying why, where Slurm or munge is not installed.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <thread>

#include "tests/launcher/slurm_harness.hpp"

namespace moevement::testing {
namespace {

std::string env_or_empty(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

template <typename Fn>
bool eventually(double timeout_s, Fn&& done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return done();
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::string hash_of(const std::string& out) {
  const std::string tag = "\nstate_hash=";
  const auto at = out.rfind(tag);
  if (at == std::string::npos || out.size() < at + tag.size() + 16) return "";
  return out.substr(at + tag.size(), 16);
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// One task's line in the step output: "T: worker N (pid P): Slurm task T of M on node X: ROLE"
// (no std::regex: g++ 12 warns falsely inside it under the sanitizers).
struct task_line {
  int node = 0, pid = 0, task = 0, ntasks = 0;
  std::string node_name, role;  // role: "stage S replica R" or "spare"
};

std::vector<task_line> task_lines(const std::string& text) {
  std::vector<task_line> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    const auto at = line.find("worker ");
    if (at == std::string::npos) continue;
    task_line t;
    char name[32] = {}, role[64] = {};
    if (std::sscanf(line.c_str() + at,
                    "worker %d (pid %d): Slurm task %d of %d on node %31[^:]: %63[^\n]", &t.node,
                    &t.pid, &t.task, &t.ntasks, name, role) == 6) {
      t.node_name = name;
      t.role = role;
      out.push_back(t);
    }
  }
  return out;
}

class slurm_launch : public ::testing::Test {
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
    ASSERT_FALSE(bin().empty()) << "MOEVEMENT_BIN is not set (run through meson test)";
  }
  void TearDown() override {
    if (!cluster_) return;
    // Nothing of a test's step may outlive it (checked here for every test).
    EXPECT_TRUE(eventually(15, [] { return step_processes().empty(); }))
        << "left: " << ::testing::PrintToString(step_processes());
    const auto q = cluster_->run("squeue -h", 10);
    EXPECT_EQ(q.output, "") << "a job is still queued or running";
    cluster_->run("jobs=$(squeue -h -o %i); [ -z \"$jobs\" ] || scancel $jobs", 10);
    if (HasFailure()) {
      std::cerr << "cluster logs:\n" << cluster_->logs();
      cluster_->keep_directory();
    }
  }

  static std::string bin() { return env_or_empty("MOEVEMENT_BIN"); }
  static std::string config() {
    return env_or_empty("MOEVEMENT_SOURCE_ROOT") + "/examples/configs/pipeline_tiny.toml";
  }
  // `moevement launch` of pipeline_tiny with a run log in the cluster's directory.
  static std::string launch(const std::string& name, const std::string& extra) {
    return bin() + " launch " + config() + " --set engine.run_log=" + cluster_->dir() + "/" + name +
           ".jsonl " + extra;
  }
  static std::string slurm_log(const std::string& name) {
    return cluster_->dir() + "/" + name + ".slurm.log";
  }

  // Processes of the cluster other than its daemons (srun, slurmstepd, tasks).
  static std::vector<std::string> step_processes() {
    std::vector<std::string> out;
    const auto& d = cluster_->daemons();
    for (int pid : cluster_->processes()) {
      if (std::find(d.begin(), d.end(), pid) != d.end()) continue;
      const auto c = local_slurm::comm(pid);
      if (c.empty() || c == "slurmscriptd") continue;
      out.push_back(std::to_string(pid) + " " + c);
    }
    return out;
  }

  static inline std::unique_ptr<local_slurm> cluster_;
  static inline std::string skip_reason_;
};

constexpr const char* short_run = "--set train.iterations=4 --set train.seq_len=16 ";
constexpr const char* slurm_2x2 =
    "--set cluster.backend=slurm --set cluster.spares=1 --set cluster.slurm_nodes=3 ";

TEST_F(slurm_launch, pp2_dp2_gives_the_local_backends_state_hash) {
  const auto local = cluster_->run(launch("local", short_run), 120);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  const auto slurm = cluster_->run(launch("slurm", std::string(short_run) + slurm_2x2), 120);
  ASSERT_FALSE(slurm.timed_out) << slurm.output;
  ASSERT_EQ(slurm.exit_code, 0) << slurm.output << "\nstep output:\n"
                                << read_file(slurm_log("slurm"));
  EXPECT_EQ(hash_of(local.output).size(), 16u) << local.output;
  EXPECT_EQ(hash_of(slurm.output), hash_of(local.output)) << slurm.output;
  EXPECT_TRUE(contains(slurm.output,
                       "Slurm step output (each task's stdout and stderr): " + slurm_log("slurm")))
      << slurm.output;
  EXPECT_TRUE(contains(slurm.output, "iter      3 (4 of 4)")) << "no progress display:\n"
                                                              << slurm.output;
  // 4 workers + 1 spare do not divide by 3 nodes: a second spare fills the last node (srun
  // would put 3 tasks on the first one).
  EXPECT_TRUE(contains(slurm.output, "cluster.spares = 1 raised to 2")) << slurm.output;
  EXPECT_FALSE(contains(read_file(slurm_log("slurm")), "can't honor --ntasks-per-node"))
      << read_file(slurm_log("slurm"));
  const std::string run_log = read_file(cluster_->dir() + "/slurm.jsonl");
  EXPECT_TRUE(contains(run_log, "\"state_hash\":\"" + hash_of(local.output) + "\"")) << run_log;

  // Each task said which role it took: 6 distinct nodes ids, two spares, two tasks on each
  // node, and the two replicas of each stage on different Slurm nodes (placement).
  const std::string step = read_file(slurm_log("slurm"));
  std::set<int> ids, tasks;
  std::map<std::string, std::set<std::string>> nodes_of_stage;
  std::map<std::string, int> tasks_on;
  int spares = 0;
  for (const auto& t : task_lines(step)) {
    EXPECT_EQ(t.ntasks, 6) << step;
    ++tasks_on[t.node_name];
    ids.insert(t.node);
    tasks.insert(t.task);
    if (t.role == "spare") {
      ++spares;
    } else {
      nodes_of_stage[t.role.substr(0, t.role.find(" replica"))].insert(t.node_name);
    }
  }
  EXPECT_EQ(ids, (std::set<int>{1, 2, 3, 4, 5, 6})) << step;
  EXPECT_EQ(tasks.size(), 6u) << step;
  EXPECT_EQ(spares, 2) << step;
  for (const auto& [node, n] : tasks_on) EXPECT_EQ(n, 2) << node << ":\n" << step;
  ASSERT_EQ(nodes_of_stage.size(), 2u) << step;
  for (const auto& [stage, nodes] : nodes_of_stage) {
    EXPECT_EQ(nodes.size(), 2u) << "replicas of stage " << stage << " share a node:\n" << step;
  }
  std::cout << "launch pp=2 dp=2: local " << local.seconds << " s, slurm " << slurm.seconds
            << " s\n";
}

TEST_F(slurm_launch, launch_sbatch_submits_a_batch_job_that_gives_the_same_state_hash) {
  // The head inside its own allocation (-n 6 -N 3): srun without --immediate, on the
  // allocation's nodes.
  const auto local = cluster_->run(launch("local_b", short_run), 120);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  const auto r = cluster_->run(
      "out=$(" + launch("batch", std::string(short_run) + slurm_2x2) +
          " --sbatch -- --time=5) || { echo \"$out\"; exit 1; }\n"
          "echo \"$out\"\n"
          "id=$(echo \"$out\" | sed -n 's/^submitted Slurm job \\([0-9]*\\) .*/\\1/p')\n"
          "for i in $(seq 600); do\n"
          "  st=$(scontrol show job $id -o | grep -o 'JobState=[A-Z_]*')\n"
          "  case $st in *=PENDING|*=RUNNING|*=CONFIGURING|*=COMPLETING) ;; *) break ;; esac\n"
          "  sleep 0.1\n"
          "done\n"
          "echo $st",
      120);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "JobState=COMPLETED")) << r.output;
  const std::string batch_out = cluster_->dir() + "/batch.sbatch.out";
  EXPECT_TRUE(contains(r.output, "the head's output (progress, state_hash): " + batch_out))
      << r.output;
  const std::string head = read_file(batch_out);
  EXPECT_EQ(hash_of(head), hash_of(local.output)) << head << "\nstep output:\n"
                                                  << read_file(slurm_log("batch"));
  EXPECT_TRUE(contains(head, "inside this allocation")) << head;
}

// `--sbatch` with the durable tier: the batch job is submitted requeueable and to be signalled
// before its time limit. SIGUSR1 (here `scancel --batch --signal=USR1`, what Slurm's --signal
// does) stops it at its next durable window and requeues it; started again, the job resumes on
// its own and ends with the uninterrupted run's hash.
TEST_F(slurm_launch, a_signalled_batch_job_is_requeued_and_resumes_bit_exact) {
  // Long enough that the signal's window comes before the end on a loaded machine (the
  // requeued job runs the same command, so it cannot be endless).
  const std::string its = "--set train.iterations=200 --set train.seq_len=16 ";
  const auto ref = cluster_->run(bin() + " train " + config() + " " + its, 120);
  ASSERT_EQ(ref.exit_code, 0) << ref.output;
  const std::string durable = its +
                              "--set checkpoint.policy=moevement --set checkpoint.w_sparse=2 "
                              "--set checkpoint.durable=true --set checkpoint.dir=" +
                              cluster_->dir() + "/requeue-ckpt ";
  const std::string log = cluster_->dir() + "/requeue.jsonl";
  const auto r = cluster_->run(
      "out=$(" + launch("requeue", durable + slurm_2x2) +
          " --sbatch -- --time=5) || { echo \"$out\"; exit 1; }\n"
          "echo \"$out\"\n"
          "id=$(echo \"$out\" | sed -n 's/^submitted Slurm job \\([0-9]*\\) .*/\\1/p')\n"
          "for i in $(seq 600); do\n"
          "  grep -q '\"event\":\"durable_window\"' " +
          log +
          " 2>/dev/null && break\n"
          "  sleep 0.1\n"
          "done\n"
          "scancel --batch --signal=USR1 $id\n"
          "for i in $(seq 1200); do\n"
          "  info=$(scontrol show job $id -o)\n"
          "  st=$(echo \"$info\" | grep -o 'JobState=[A-Z_]*')\n"
          "  case $st in *=PENDING|*=RUNNING|*=CONFIGURING|*=COMPLETING|*=REQUEUED) ;; *) break ;; "
          "esac\n"
          "  sleep 0.1\n"
          "done\n"
          "echo $st; scontrol show job $id -o | grep -o 'Restarts=[0-9]*'",
      240);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string head = read_file(cluster_->dir() + "/requeue.sbatch.out");
  EXPECT_TRUE(contains(r.output, "JobState=COMPLETED")) << r.output << head;
  EXPECT_TRUE(contains(r.output, "Restarts=1")) << r.output;
  EXPECT_TRUE(contains(head, "SIGUSR1: stopping once the next durable window is on disk")) << head;
  EXPECT_TRUE(contains(head, "requeueing Slurm job")) << head;
  EXPECT_TRUE(contains(head, "requeued by Slurm: resuming from window")) << head;
  EXPECT_EQ(hash_of(head), hash_of(ref.output)) << head << "\nstep output:\n"
                                                << read_file(slurm_log("requeue"));
}

TEST_F(slurm_launch, a_worker_killed_mid_run_ends_the_job_with_a_clear_error_and_no_hung_srun) {
  // Node 2 is (stage 1, replica 0). Killed with SIGKILL once the first iteration is logged.
  const std::string dir = cluster_->dir();
  const auto r = cluster_->run(
      launch("kill", std::string("--set train.iterations=500 ") + slurm_2x2) + " >" + dir +
          "/kill.out 2>&1 &\n"
          "lp=$!\n"
          "for i in $(seq 600); do grep -q '\"kind\":\"iteration\"' " +
          dir +
          "/kill.jsonl 2>/dev/null && break; sleep 0.1; done\n"
          "pid=$(sed -n 's/.*worker 2 (pid \\([0-9]*\\)): Slurm task.*/\\1/p' " +
          slurm_log("kill") +
          ")\n"
          "[ -n \"$pid\" ] && kill -9 $pid && echo \"killed worker 2, pid $pid\"\n"
          "wait $lp; echo \"launch exit $?\"; cat " +
          dir + "/kill.out",
      120);
  ASSERT_FALSE(r.timed_out) << "launch hung after a worker was killed:\n" << r.output;
  const auto killed_at = r.output.find("killed worker 2, pid ");
  ASSERT_NE(killed_at, std::string::npos) << r.output << "\nstep output:\n"
                                          << read_file(slurm_log("kill"));
  const std::string killed_pid = std::to_string(
      std::atoi(r.output.c_str() + killed_at + std::strlen("killed worker 2, pid ")));
  EXPECT_TRUE(contains(r.output, "launch exit 1")) << r.output;
  EXPECT_TRUE(contains(r.output, "worker 2 (stage 1, replica 0, pid " + killed_pid + ") was lost"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "cannot recover a lost worker")) << r.output;
  EXPECT_TRUE(
      contains(r.output, "Slurm step output (each task's stdout and stderr): " + slurm_log("kill")))
      << r.output;
  EXPECT_FALSE(contains(r.output, "state_hash=")) << r.output;
  // The step saw that one task die and nothing else: the others were not killed by Slurm
  // (no -K1) but left on the head's Shutdown. TearDown checks that nothing is left.
  const std::string step = read_file(slurm_log("kill"));
  int task = -1;
  for (const auto& t : task_lines(step)) {
    if (t.node == 2) task = t.task;
  }
  ASSERT_GE(task, 0) << step;
  std::vector<std::string> ends;  // srun's "srun: error: n1: task 1: Killed" lines
  std::istringstream in(step);
  for (std::string line; std::getline(in, line);) {
    if (!contains(line, "srun: error:")) continue;
    if (contains(line, "Killed") || contains(line, "Terminated") || contains(line, "Exited")) {
      ends.push_back(line.substr(line.find("task")));
    }
  }
  EXPECT_EQ(ends, std::vector<std::string>{"task " + std::to_string(task) + ": Killed"}) << step;
}

TEST_F(slurm_launch, a_killed_task_is_rebuilt_on_a_spare_task_with_the_same_state_hash) {
  const std::string run = "--set train.iterations=12 --set train.seq_len=16 ";
  const std::string moe = "--set checkpoint.policy=moevement --set checkpoint.w_sparse=2 ";
  const auto local = cluster_->run(launch("fault_free", run), 120);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  const auto slurm = cluster_->run(
      launch("recover", run + moe + slurm_2x2 + "--inject kill:stage=1,replica=0,iter=6"), 120);
  ASSERT_FALSE(slurm.timed_out) << slurm.output;
  ASSERT_EQ(slurm.exit_code, 0) << slurm.output << "\nstep output:\n"
                                << read_file(slurm_log("recover"));
  EXPECT_TRUE(contains(slurm.output, "recovered on worker 5 ")) << slurm.output;
  EXPECT_EQ(hash_of(slurm.output), hash_of(local.output)) << slurm.output;
  // Every stage's snapshot copies went to workers on other Slurm nodes than its own.
  std::map<std::string, std::string> node_of;  // worker id -> Slurm node name
  const std::string step = read_file(slurm_log("recover"));
  for (std::size_t at = step.find("worker "); at != std::string::npos;
       at = step.find("worker ", at + 1)) {
    const auto sp = step.find(' ', at + 7);
    const auto on = step.find(" on node ", at);
    const auto eol = step.find(':', on == std::string::npos ? at : on + 9);
    if (sp == std::string::npos || on == std::string::npos || eol == std::string::npos) continue;
    if (step.find('\n', at) < on) continue;
    node_of[step.substr(at + 7, sp - at - 7)] = step.substr(on + 9, eol - on - 9);
  }
  const std::string log = read_file(cluster_->dir() + "/recover.jsonl");
  int checked = 0;
  for (std::size_t at = log.find("\"snapshot_holders\""); at != std::string::npos;
       at = log.find("\"snapshot_holders\"", at + 1)) {
    const std::string line = log.substr(at, log.find('\n', at) - at);
    const auto n = line.find("\"node\":"), h = line.find("\"holders\":\"");
    ASSERT_NE(n, std::string::npos);
    ASSERT_NE(h, std::string::npos);
    const std::string self = std::to_string(std::atoi(line.c_str() + n + 7));
    std::string holders = line.substr(h + 11, line.find('"', h + 11) - h - 11);
    std::stringstream in(holders);
    for (std::string x; std::getline(in, x, ',');) {
      ASSERT_TRUE(node_of.contains(x) && node_of.contains(self)) << line << "\n" << step;
      EXPECT_NE(node_of[x], node_of[self]) << "worker " << self << "'s copy on worker " << x;
      ++checked;
    }
  }
  EXPECT_GE(checked, 8) << "4 stages x 2 copies, before and after the recovery";
  // Where the nodes have host names of their own (scripts/slurm-local: a UTS namespace each),
  // every copy is on another host: the owner's memory-file handle is refused there and the
  // replica pulls instead (none maps), and the recovery above restored from pulled copies.
  if (read_file(cluster_->dir() + "/run/hosts").starts_with("distinct")) {
    const auto last = log.rfind("\"kind\":\"iteration\"");
    ASSERT_NE(last, std::string::npos);
    auto field = [&](const std::string& key) {
      const auto at = log.find("\"" + key + "\":", last);
      return at == std::string::npos ? -1L : std::atol(log.c_str() + at + key.size() + 3);
    };
    EXPECT_EQ(field("replica_maps"), 0) << log.substr(last);
    EXPECT_GT(field("replica_pulls"), 0) << log.substr(last);
  } else {
    std::cout << "[ note ] the Slurm nodes share this host's name (no UTS namespaces here): "
                 "the copies were mapped, the pull after a refused handle is not exercised\n";
  }
}

// A whole Slurm node lost at once (its failure domain: every task on it, spares included)
// under the default placement: no slot loses every copy, the lost roles are rebuilt on the
// spares of the other nodes, and the job ends with the fault-free hash.
TEST_F(slurm_launch, losing_a_whole_node_is_recovered_bit_exact) {
  const std::string run = "--set train.iterations=12 --set train.seq_len=16 ";
  const auto local = cluster_->run(launch("node_ref", run), 120);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  const auto slurm = cluster_->run(
      launch("node_lost", run + "--set checkpoint.policy=moevement --set checkpoint.w_sparse=2 "
                                "--set cluster.backend=slurm --set cluster.spares=2 "
                                "--set cluster.slurm_nodes=3 "
                                "--inject kill:stage=1,replica=0,iter=6,scope=host"),
      120);
  ASSERT_FALSE(slurm.timed_out) << slurm.output;
  ASSERT_EQ(slurm.exit_code, 0) << slurm.output << "\nstep output:\n"
                                << read_file(slurm_log("node_lost"));
  EXPECT_TRUE(contains(slurm.output, "inject: kill:stage=1,replica=0,iter=6,scope=host (worker "))
      << slurm.output;
  EXPECT_TRUE(contains(slurm.output, "(all of host n")) << slurm.output;
  // Two tasks per node: both went.
  const std::string log = read_file(cluster_->dir() + "/node_lost.jsonl");
  int struck = 0;
  for (auto at = log.find("\"event\":\"inject\""); at != std::string::npos;
       at = log.find("\"event\":\"inject\"", at + 1)) {
    ++struck;
  }
  EXPECT_EQ(struck, 2) << log;
  EXPECT_EQ(hash_of(slurm.output), hash_of(local.output)) << slurm.output;
}

// Two nodes for three tasks (an allocation of -N 2 -n 3: cluster.slurm_nodes would add a
// spare to fill the second node): the stages share a node, so each stage's second copy is on
// its own node, where the replicator maps it, and the spare is on the other node. The
// replacement is offered the mapping's handle, refuses it (another host) and pulls the slot
// from the replicator's export of its mapping, bit-exact.
TEST_F(slurm_launch, a_replacement_on_another_host_pulls_a_mapped_copy_through_its_export) {
  if (!read_file(cluster_->dir() + "/run/hosts").starts_with("distinct")) {
    GTEST_SKIP() << "the Slurm nodes share this host's name (no UTS namespaces here): every "
                    "copy maps, so no pull from a mapping happens";
  }
  // Iterations of this job take ~10 ms, less than a cross-node pull: the kill must come after
  // a window surely persisted. A capture holds at most policy_limits::max_windows_held (3)
  // windows, so the step of iteration 6 (window 3's first) waits for one to persist; iteration
  // 10 leaves a margin.
  const std::string run =
      "--set train.iterations=16 --set train.seq_len=16 --set parallel.pp=2 "
      "--set parallel.dp=1 ";
  const auto local = cluster_->run(launch("export_fault_free", run), 120);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  const auto slurm = cluster_->run(
      "salloc -N 2 -n 3 " +
          launch("export", run + "--set checkpoint.policy=moevement --set checkpoint.w_sparse=2 "
                                 "--set cluster.backend=slurm --set cluster.spares=1 "
                                 "--inject kill:stage=1,replica=0,iter=10"),
      120);
  ASSERT_FALSE(slurm.timed_out) << slurm.output;
  ASSERT_EQ(slurm.exit_code, 0) << slurm.output << "\nstep output:\n"
                                << read_file(slurm_log("export"));
  EXPECT_EQ(hash_of(slurm.output), hash_of(local.output)) << slurm.output;
  const std::string log = read_file(cluster_->dir() + "/export.jsonl");
  auto field = [&](std::size_t from, const std::string& key) {
    const auto at = log.find("\"" + key + "\":", from);
    return at == std::string::npos ? -1L : std::atol(log.c_str() + at + key.size() + 3);
  };
  const auto start = log.find("\"event\":\"recovery_start\"");
  ASSERT_NE(start, std::string::npos) << log;
  EXPECT_GE(field(start, "window"), 0) << "no window had persisted: " << log;
  const auto end = log.find("\"event\":\"recovery_end\"");
  ASSERT_NE(end, std::string::npos) << log;
  EXPECT_EQ(field(end, "slots_pulled"), 2) << "W 2: two slots, both pulled";
  EXPECT_EQ(field(end, "handles_refused"), 2) << "each offered by a replicator that maps it";
  EXPECT_EQ(field(end, "slots_mapped"), 0);
  const auto last = log.rfind("\"kind\":\"iteration\"");
  ASSERT_NE(last, std::string::npos);
  EXPECT_GT(field(last, "replica_maps"), 0) << "the copies on the owners' node map";
  EXPECT_GT(field(last, "replica_pulls"), 0) << "those on the other node pull";
}

TEST_F(slurm_launch, the_head_killed_with_sigkill_leaves_no_step_behind) {
  // srun dies with its parent (PR_SET_PDEATHSIG: SIGTERM, which cancels the step) and the
  // workers stop when they lose the head; TearDown checks that nothing is left.
  const std::string dir = cluster_->dir();
  const auto r = cluster_->run(
      launch("head", std::string("--set train.iterations=500 ") + slurm_2x2) + " >" + dir +
          "/head.out 2>&1 &\n"
          "lp=$!\n"
          "for i in $(seq 600); do grep -q '\"kind\":\"iteration\"' " +
          dir +
          "/head.jsonl 2>/dev/null && break; sleep 0.1; done\n"
          "kill -9 $lp; wait $lp; echo \"launch exit $?\"",
      60);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_TRUE(contains(r.output, "launch exit 137")) << r.output;
  EXPECT_TRUE(contains(read_file(dir + "/head.jsonl"), "\"kind\":\"iteration\""))
      << "killed before training began";
}

// cluster.standby_head under Slurm: the standby head is a step of its own; the head killed with
// SIGKILL once a window is on disk leaves the workers' step running, the standby goes on from
// the running stages, and its output (the step's file) ends with the local backend's hash.
// TearDown checks that both steps ended.
TEST_F(slurm_launch, a_killed_head_is_replaced_by_its_standby_step_bit_exact) {
  const std::string dir = cluster_->dir();
  const std::string run = "--set train.iterations=300 --set train.seq_len=16 ";
  const auto local = cluster_->run(launch("standby_reference", run), 120);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  const std::string standby_log = dir + "/standby.standby.log";
  const auto r = cluster_->run(
      launch("standby", run + slurm_2x2 +
                            "--set checkpoint.policy=moevement --set checkpoint.w_sparse=2 "
                            "--set cluster.standby_head=true --set checkpoint.dir=" +
                            dir + "/standby.ckpt") +
          " >" + dir +
          "/standby.out 2>&1 &\n"
          "lp=$!\n"
          // two windows on disk: the first is journaled by then (the journal follows the event)
          "for i in $(seq 900); do [ \"$(grep -c '\"event\":\"durable_window\"' " +
          dir +
          "/standby.jsonl 2>/dev/null)\" -ge 2 ] && break; sleep 0.1; done\n"
          "kill -9 $lp; wait $lp; echo \"launch exit $?\"\n"
          "for i in $(seq 900); do grep -q 'state_hash=' " +
          standby_log + " 2>/dev/null && break; sleep 0.1; done",
      180);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_TRUE(contains(r.output, "launch exit 137")) << r.output;
  const std::string head = read_file(dir + "/standby.out");
  EXPECT_TRUE(contains(head, "the standby head; its output: " + standby_log)) << head;
  const std::string out = read_file(standby_log);
  EXPECT_TRUE(contains(out, "goes on from the running stages")) << out;
  EXPECT_EQ(hash_of(out), hash_of(local.output)) << out << "\nhead:\n" << head;
}

// The same inside `--sbatch`: the head killed inside its batch job. The batch script's end
// ends every step of the job, the standby's too (it exec'd the head: the standby that was to
// take over died with it); the script now waits for the standby's step. Slurm's SIGUSR1 before
// the time limit (here `scancel --batch --signal=USR1`), which only the batch shell gets, then
// reaches the standby: it stops at its next window on disk and requeues the job, which resumes
// on its own and ends COMPLETED with the uninterrupted run's hash.
TEST_F(slurm_launch, a_head_killed_inside_its_batch_job_is_replaced_by_its_standby_step) {
  const std::string dir = cluster_->dir();
  const std::string run = "--set train.iterations=300 --set train.seq_len=16 ";
  const auto local = cluster_->run(launch("sb_reference", run), 120);
  ASSERT_EQ(local.exit_code, 0) << local.output;
  const std::string log = dir + "/sb.jsonl", standby_log = dir + "/sb.standby.log";
  const auto r = cluster_->run(
      "out=$(" +
          launch("sb", run + slurm_2x2 +
                           "--set checkpoint.policy=moevement --set checkpoint.w_sparse=2 "
                           "--set cluster.standby_head=true --set checkpoint.dir=" +
                           dir + "/sb.ckpt") +
          " --sbatch -- --time=5) || { echo \"$out\"; exit 1; }\n"
          "id=$(echo \"$out\" | sed -n 's/^submitted Slurm job \\([0-9]*\\) .*/\\1/p')\n"
          "for i in $(seq 900); do [ \"$(grep -c '\"event\":\"durable_window\"' " +
          log +
          " 2>/dev/null)\" -ge 2 ] && break; sleep 0.1; done\n"
          // the head: the launch with this run log that is neither the standby nor a worker
          "for p in $(pgrep -f -- 'engine.run_log=" +
          log +
          "'); do tr '\\0' ' ' </proc/$p/cmdline | grep -q -- '--standby-of\\|--sbatch' || "
          "{ [ \"$(cut -d' ' -f2 /proc/$p/stat 2>/dev/null)\" = '(moevement)' ] && "
          "tr '\\0' ' ' </proc/$p/cmdline | grep -q ' launch ' && kill -9 $p && "
          "echo killed the head $p; }; done\n"
          "for i in $(seq 900); do grep -q 'goes on from the running stages' " +
          standby_log +
          " 2>/dev/null && break; sleep 0.1; done\n"
          "scancel --batch --signal=USR1 $id\n"
          "for i in $(seq 1800); do\n"
          "  st=$(scontrol show job $id -o | grep -o 'JobState=[A-Z_]*')\n"
          "  case $st in *=PENDING|*=RUNNING|*=CONFIGURING|*=COMPLETING|*=REQUEUED) ;; *) break ;; "
          "esac\n"
          "  sleep 0.1\n"
          "done\n"
          "echo $st; scontrol show job $id -o | grep -o 'Restarts=[0-9]*'",
      300);
  ASSERT_FALSE(r.timed_out) << r.output;
  const std::string standby = read_file(standby_log), head = read_file(dir + "/sb.sbatch.out");
  EXPECT_TRUE(contains(r.output, "killed the head")) << r.output;
  EXPECT_TRUE(contains(standby, "taking over")) << standby;
  EXPECT_TRUE(contains(standby, "SIGUSR1: stopping once the next durable window is on disk"))
      << standby;
  EXPECT_TRUE(contains(r.output, "JobState=COMPLETED")) << r.output << standby << head;
  EXPECT_TRUE(contains(r.output, "Restarts=1")) << r.output << standby;
  EXPECT_TRUE(contains(head, "requeued by Slurm: resuming from window")) << head;
  EXPECT_EQ(hash_of(head), hash_of(local.output)) << head << "\nstandby:\n" << standby;
}

TEST_F(slurm_launch, a_wrong_partition_is_a_clear_error) {
  const auto r =
      cluster_->run(launch("partition", std::string(short_run) + slurm_2x2 +
                                            "--set cluster.slurm_partition=nosuchpartition"),
                    60);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_TRUE(contains(r.output, "the Slurm step ended before the job did")) << r.output;
  EXPECT_TRUE(contains(r.output, "Invalid partition name specified")) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "cluster.slurm_partition = 'nosuchpartition' is not a partition of this "
                       "cluster"))
      << r.output;
}

TEST_F(slurm_launch, too_few_tasks_in_the_allocation_is_a_clear_error) {
  // `moevement launch` inside `sbatch -n 2` for a job of 6 tasks (5, the spares raised to fill
  // the 3 nodes).
  const std::string out = cluster_->dir() + "/few.out";
  const auto r = cluster_->run(
      "id=$(sbatch --parsable -n 2 -o " + out + " --wrap '" +
          launch("few", std::string(short_run) + slurm_2x2) +
          "; echo launch exit $?') || exit 1\n"
          "for i in $(seq 300); do\n"
          "  st=$(scontrol show job $id -o | grep -o 'JobState=[A-Z_]*')\n"
          "  case $st in *=PENDING|*=RUNNING|*=CONFIGURING|*=COMPLETING) ;; *) break ;; esac\n"
          "  sleep 0.1\n"
          "done\n"
          "cat " +
          out,
      60);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_TRUE(contains(r.output,
                       "too few Slurm tasks: this allocation has 2 (SLURM_NTASKS) but pp=2 x "
                       "dp=2 workers + 2 spare(s) need 6; ask sbatch/salloc for -n 6"))
      << r.output;
  EXPECT_TRUE(contains(r.output, "launch exit 1")) << r.output;
}

// `srun -n 2 moevement launch` would start two heads of two jobs: each task refuses, saying
// how to run it, before reading the config or starting anything.
TEST_F(slurm_launch, launch_under_srun_with_several_tasks_is_refused) {
  const auto r = cluster_->run(
      "srun -n 2 " + launch("many", std::string(short_run) + slurm_2x2) + "; echo srun exit $?",
      60);
  ASSERT_FALSE(r.timed_out) << r.output;
  EXPECT_TRUE(contains(r.output, "this is task 0 of 2 of a Slurm step")) << r.output;
  EXPECT_TRUE(contains(r.output, "this is task 1 of 2 of a Slurm step")) << r.output;
  EXPECT_TRUE(contains(r.output, "not under `srun -n N`")) << r.output;
  EXPECT_TRUE(contains(r.output, "srun exit 2")) << r.output;
  EXPECT_FALSE(contains(r.output, "Slurm step moevement-")) << "nothing started: " << r.output;
}

}  // namespace
}  // namespace moevement::testing
