// `moevement launch` end to end: real worker processes over loopback UCX. Pipelining, data and
// expert parallelism change no bit (the same state_hash as `moevement train`), a worker killed or
// hung under policy `none` ends the job with a clear error, Ctrl-C leaves no process behind.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace {

using namespace moevement::test_support;
using namespace std::chrono_literals;

std::string tiny() {
  return source_path("examples/configs/tiny.toml");
}

std::string short_run(const std::string& extra, const std::string& log) {
  return "--set train.iterations=4 --set train.seq_len=16 --set engine.run_log=" + log + " " +
         extra;
}

// Trains with `moevement train` and `moevement launch` on the same settings; both hashes.
std::pair<std::string, std::string> train_and_launch(int pp, int dp) {
  const std::string log = log_path("pp" + std::to_string(pp) + "dp" + std::to_string(dp));
  const std::string set = short_run("--set parallel.dp=" + std::to_string(dp), log);
  const auto t = run_moevement("train " + tiny() + " " + set);
  EXPECT_EQ(t.exit_code, 0) << t.output;
  const auto l =
      run_moevement("launch " + tiny() + " " + set + " --set parallel.pp=" + std::to_string(pp));
  EXPECT_EQ(l.exit_code, 0) << l.output;
  return {hash_of(t.output), hash_of(l.output)};
}

TEST(launch, pipeline_depth_changes_no_bit) {
  for (int pp : {1, 2, 4}) {
    const auto [train, launch] = train_and_launch(pp, 1);
    EXPECT_EQ(train.size(), 16u);
    EXPECT_EQ(launch, train) << "pp=" << pp;
  }
}

// The largest heartbeat and failure timeout the config takes, passed on to every worker's
// flags: the workers take them too. (Theirs stopped at 600 s: every worker exited at its start.)
TEST(launch, the_largest_timeouts_the_config_takes_start_every_worker) {
  const auto l = run_moevement(
      "launch " + tiny() + " " +
      short_run("--set parallel.pp=2 --set cluster.heartbeat_ms=60000 "
                "--set cluster.failure_timeout_ms=3600000 --set cluster.iteration_timeout_ms=0",
                log_path("timeouts")));
  EXPECT_EQ(l.exit_code, 0) << l.output;
  EXPECT_EQ(hash_of(l.output).size(), 16u) << l.output;
}

// checkpoint.replicas beyond what the workers allow (one copy per other worker): the job says
// how many it keeps, once, and trains.
TEST(launch, more_snapshot_copies_than_workers_says_how_many_it_keeps) {
  const auto r = run_moevement(
      "launch " + tiny() + " " +
      short_run("--set parallel.pp=2 --set cluster.spares=0 --set checkpoint.policy=moevement "
                "--set checkpoint.replicas=3 --set checkpoint.durable=false",
                log_path("copies")));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string said = "checkpoint.replicas = 3, but a snapshot can have only 1 copy here";
  const auto at = r.output.find(said);
  EXPECT_NE(at, std::string::npos) << r.output;
  EXPECT_EQ(r.output.find(said, at + 1), std::string::npos) << "once";
}

// No iteration to train: the job ends at once, its hash the initial state's (train's), and the
// final line shows no loss it did not measure (it said 0 for both).
TEST(launch, no_iterations_ends_at_once_with_no_loss_shown) {
  const auto l = run_moevement("launch " + tiny() + " --set train.iterations=0 " +
                               "--set engine.run_log=" + log_path("none"));
  ASSERT_EQ(l.exit_code, 0) << l.output;
  EXPECT_NE(l.output.find("final: loss -  val_loss -  "), std::string::npos) << l.output;
  EXPECT_NE(l.output.find("ETTR -\n"), std::string::npos) << l.output;
  const auto t = run_moevement("train " + tiny() + " --set train.iterations=0");
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_NE(t.output.find("final: loss -  val_loss 5."), std::string::npos) << t.output;
  EXPECT_EQ(hash_of(l.output), hash_of(t.output));
  EXPECT_FALSE(hash_of(l.output).empty()) << l.output;
}

// A run log that cannot be written is refused before anything starts or is made, naming
// engine.run_log (it was named as the checkpoint.dir made beside it, or a directory got a
// .checkpoints sibling first).
TEST(launch, a_run_log_that_cannot_be_written_is_refused_naming_the_key) {
  const auto missing =
      run_moevement("launch " + tiny() + " --set engine.run_log=/proc/moevement-nope/x.jsonl");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("engine.run_log = /proc/moevement-nope/x.jsonl: its directory"),
            std::string::npos)
      << missing.output;
  const std::string dir = log_path("run_log_dir") + ".d";
  std::filesystem::create_directories(dir);
  const auto directory = run_moevement("launch " + tiny() + " --set engine.run_log=" + dir);
  EXPECT_NE(directory.exit_code, 0);
  EXPECT_NE(directory.output.find("is a directory: name a file"), std::string::npos)
      << directory.output;
  EXPECT_FALSE(std::filesystem::exists(dir + ".checkpoints"));
  std::filesystem::remove_all(dir);
}

TEST(launch, data_parallel_reduction_is_the_reference_left_fold) {
  // dp=3: a reduction in any other order than g0 + g1 + g2 changes bits.
  const auto [train, launch] = train_and_launch(2, 3);
  EXPECT_EQ(train.size(), 16u);
  EXPECT_EQ(launch, train);
}

TEST(launch, expert_parallelism_changes_no_bit) {
  // dp = 4 with the experts sharded over 2 and over 4 replicas, against `train`, which holds
  // every expert in one process
  const std::string set = short_run("--set parallel.dp=4", log_path("ep"));
  const auto t = run_moevement("train " + tiny() + " " + set);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  ASSERT_EQ(hash_of(t.output).size(), 16u);
  for (const auto& [ep, pp] : {std::pair{2, 2}, std::pair{4, 1}}) {
    const auto l =
        run_moevement("launch " + tiny() + " " + set + " --set parallel.ep=" + std::to_string(ep) +
                      " --set parallel.pp=" + std::to_string(pp));
    ASSERT_EQ(l.exit_code, 0) << l.output;
    EXPECT_EQ(hash_of(l.output), hash_of(t.output)) << "ep=" << ep << " pp=" << pp;
  }
  // Two tokens per micro-batch: a layer often routes no row to one EP rank's experts, which
  // then get a message without a tensor (a descriptor is never empty).
  const std::string few =
      "--set parallel.dp=2 --set train.iterations=4 "
      "--set train.micro_batch_size=1 --set train.seq_len=2 --set "
      "engine.run_log=" +
      log_path("ep_few");
  const auto tf = run_moevement("train " + tiny() + " " + few);
  const auto lf = run_moevement("launch " + tiny() + " " + few + " --set parallel.ep=2");
  ASSERT_EQ(lf.exit_code, 0) << lf.output;
  EXPECT_EQ(hash_of(lf.output), hash_of(tf.output));
}

TEST(launch, pp2_dp2_learns_and_repeats_bit_for_bit) {
  const std::string log = log_path("learn");
  const std::string args = "launch " + tiny() +
                           " --set parallel.pp=2 --set parallel.dp=2 --set train.iterations=30 "
                           "--set train.seq_len=32 --set cluster.spares=1 --set engine.run_log=" +
                           log;
  const auto a = run_moevement(args);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  std::vector<double> losses;
  for (const auto& l : lines_of(log)) {
    if (l.find("\"kind\":\"iteration\"") != std::string::npos) {
      losses.push_back(number_field(l, "loss"));
    }
  }
  ASSERT_EQ(losses.size(), 30u);
  EXPECT_LT(losses.back(), losses.front() - 0.5) << a.output;
  EXPECT_NE(a.output.find("val_loss"), std::string::npos);
  const auto b = run_moevement(args);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_EQ(hash_of(a.output), hash_of(b.output));
  EXPECT_EQ(hash_of(a.output).size(), 16u);
}

TEST(launch, an_aborted_and_rerun_iteration_changes_no_bit) {
  const std::string log = log_path("abort");
  const std::string set = short_run("--set parallel.dp=2 --set parallel.pp=2", log);
  const auto plain = run_moevement("launch " + tiny() + " " + set);
  ASSERT_EQ(plain.exit_code, 0) << plain.output;
  const auto aborted = run_moevement("launch " + tiny() + " " + set + " --set engine.abort_at=2");
  ASSERT_EQ(aborted.exit_code, 0) << aborted.output;
  EXPECT_EQ(hash_of(plain.output), hash_of(aborted.output));
  bool event = false, rerun = false;
  for (const auto& l : lines_of(log)) {
    event |= l.find("\"event\":\"iteration_aborted\",\"iteration\":2") != std::string::npos;
    rerun |= l.find("\"kind\":\"iteration\",\"iteration\":2,") != std::string::npos &&
             number_field(l, "attempts") == 2;
  }
  EXPECT_TRUE(event);
  EXPECT_TRUE(rerun);
  // with the experts sharded: an EP peer may still be computing the iteration when its
  // neighbour takes the Abort, and must get its rows served
  const auto ep = run_moevement("launch " + tiny() + " " + set +
                                " --set parallel.ep=2 --set engine.abort_at=2");
  ASSERT_EQ(ep.exit_code, 0) << ep.output;
  EXPECT_EQ(hash_of(ep.output), hash_of(plain.output));
}

// A job of tiny in pp=2 x dp=2 that runs until it is stopped.
struct endless_launch : background_launch {
  endless_launch(const std::string& name, const std::string& extra)
      : background_launch(name, tiny() +
                                    " --set train.iterations=100000 --set parallel.pp=2 "
                                    "--set parallel.dp=2 " +
                                    extra) {}
};

// Two heads on one job's files would overwrite each other's windows and run log: a second
// launch with the same run log (a --resume started while the job still runs) is refused, and
// so is one with another run log but the same checkpoint.dir. The running job goes on.
TEST(launch, a_second_head_on_a_running_jobs_files_is_refused) {
  const std::string policy = " --set checkpoint.policy=moevement";
  endless_launch job("locked", policy);
  ASSERT_EQ(job.wait_for_workers(4).size(), 4u) << job.output();
  const auto again =
      run_moevement("launch " + tiny() + policy + " --set engine.run_log=" + job.log + " --resume");
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_NE(again.output.find("engine.run_log = " + job.log +
                              " is in use by another running `moevement launch`"),
            std::string::npos)
      << again.output;
  const std::string dir = job.log.substr(0, job.log.rfind('.')) + ".checkpoints";
  const auto beside =
      run_moevement("launch " + tiny() + policy + " --set engine.run_log=" + job.log +
                    ".other.jsonl --set checkpoint.dir=" + dir);
  EXPECT_EQ(beside.exit_code, 1) << beside.output;
  EXPECT_NE(beside.output.find("checkpoint.dir = " + dir + " is in use"), std::string::npos)
      << beside.output;
  EXPECT_FALSE(std::filesystem::exists(job.log + ".other.jsonl")) << "a refused launch made it";
  ::kill(job.pid, SIGTERM);  // 128 + its number, as a shell reports it (Ctrl-C's is 130)
  EXPECT_EQ(job.wait(60s), 128 + SIGTERM) << job.output();
  EXPECT_EQ(job.output().find("error"), std::string::npos) << job.output();
}

TEST(launch, killed_worker_under_policy_none_ends_the_job_with_a_clear_error) {
  endless_launch job("kill", "");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  ::kill(pids[1], SIGKILL);
  const int rc = job.wait(60s);
  const std::string out = job.output();
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("pid " + std::to_string(pids[1])), std::string::npos) << out;
  EXPECT_NE(out.find("checkpoint.policy = none"), std::string::npos) << out;
  EXPECT_EQ(out.find("state_hash="), std::string::npos);
  EXPECT_TRUE(all_gone(pids)) << "a worker outlived the job";
  bool logged = false;
  for (const auto& l : lines_of(job.log)) logged |= l.find("job_failed") != std::string::npos;
  EXPECT_TRUE(logged);
}

TEST(launch, a_killed_ep_rank_ends_the_job_and_no_peer_waits_for_ever) {
  // Its EP peers may be waiting for its experts' rows: they must end with the job.
  endless_launch job("kill_ep", "--set parallel.ep=2");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  std::this_thread::sleep_for(300ms);  // into training
  ::kill(pids[2], SIGKILL);
  const int rc = job.wait(60s);
  const std::string out = job.output();
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("pid " + std::to_string(pids[2])), std::string::npos) << out;
  EXPECT_EQ(out.find("state_hash="), std::string::npos);
  EXPECT_TRUE(all_gone(pids)) << "a worker outlived the job";
}

// Policy moevement: the spare holds snapshot copies (spares are run-safe holders). Its loss
// moves them to the other workers, and windows go on persisting (before, replication stayed
// stuck: every window was skipped after a 10 s stall).
TEST(launch, a_lost_spare_does_not_stop_training) {
  const std::string set = " --set train.iterations=120 --set train.seq_len=16";
  endless_launch job("spare",
                     "--set cluster.spares=1 --set checkpoint.policy=moevement "
                     "--set checkpoint.w_sparse=2 --set checkpoint.durable=false" +
                         set);
  const auto pids = job.wait_for_workers(5);
  ASSERT_EQ(pids.size(), 5u) << job.output();
  pid_t spare = 0;
  double node = -1;
  for (const auto& l : lines_of(job.log)) {
    if (l.find("\"worker_up\"") != std::string::npos && number_field(l, "stage") == -1) {
      spare = pid_t(number_field(l, "pid"));
      node = number_field(l, "node");
    }
  }
  ASSERT_GT(spare, 0);
  // Once the holders are placed: the spare is among them ("holders":"3,5").
  std::string holders;
  for (int i = 0; i < 3000 && holders.empty(); ++i) {
    for (const auto& l : lines_of(job.log)) {
      if (l.find("\"snapshot_holders\"") == std::string::npos) continue;
      const auto at = l.find("\"holders\":\"");
      if (at != std::string::npos)
        holders += "," + l.substr(at + 11, l.find('"', at + 11) - at - 11);
    }
    if (holders.empty()) std::this_thread::sleep_for(10ms);
  }
  ASSERT_NE((holders + ",").find("," + std::to_string(int(node)) + ","), std::string::npos)
      << holders;
  ::kill(spare, SIGKILL);
  ASSERT_EQ(job.wait(120s), 0) << job.output();
  const auto reference = run_moevement("train " + tiny() + " --set parallel.dp=2" + set);
  EXPECT_EQ(hash_of(job.output()), hash_of(reference.output)) << job.output();
  EXPECT_TRUE(all_gone(pids));
  int persisted_after = -1;
  for (const auto& l : lines_of(job.log)) {
    if (l.find("\"worker_lost\"") != std::string::npos) persisted_after = 0;
    if (persisted_after >= 0 && l.find("\"window_persisted\"") != std::string::npos) {
      ++persisted_after;
    }
  }
  EXPECT_GE(persisted_after, 2) << job.output();
  EXPECT_EQ(job.output().find("captured nothing of a window"), std::string::npos) << job.output();
  // Said once, by the coordinator (a hung spare, declared by the heartbeats, was not said).
  const std::string said =
      fmt::format("spare worker {} (pid {}) was killed by signal 9", int(node), spare);
  const std::string out = job.output();
  ASSERT_NE(out.find(said), std::string::npos) << out;
  EXPECT_EQ(out.find(said, out.find(said) + 1), std::string::npos) << out;
  EXPECT_NE(out.find("training goes on with 0 spare(s)"), std::string::npos) << out;
}

// The newest iteration the run log shows (-1: none yet).
double newest_iteration(const std::string& log) {
  double n = -1;
  for (const auto& l : lines_of(log)) {
    if (l.find("\"kind\":\"iteration\"") != std::string::npos) {
      n = std::max(n, number_field(l, "iteration"));
    }
  }
  return n;
}

// Waits (a minute at most) until the run log shows iteration `it`.
bool wait_for_iteration(const std::string& log, double it) {
  for (int i = 0; i < 6000 && newest_iteration(log) < it; ++i) std::this_thread::sleep_for(10ms);
  return newest_iteration(log) >= it;
}

// The same under dense-memory: the stage whose checkpoints a lost spare held gets a new
// holder, and that holder gets the checkpoint kept now. The stage's worker then killed rolls
// the job back to it, not to iteration 0 (before, its checkpoints went to the lost spare for
// the rest of the job, and nothing newer than the start was left to roll back to).
TEST(launch, a_lost_spare_holding_dense_checkpoints_is_replaced_as_their_holder) {
  const std::string set = " --set train.iterations=200 --set train.seq_len=16";
  endless_launch job("dense_spare",
                     "--set cluster.spares=2 --set checkpoint.policy=dense-memory "
                     "--set checkpoint.interval=10 --set checkpoint.replicas=1" +
                         set);
  ASSERT_EQ(job.wait_for_workers(6).size(), 6u) << job.output();
  // A spare that holds a stage's checkpoints, and that stage's worker.
  std::map<double, pid_t> pid_of;
  std::set<double> spares;
  for (const auto& l : lines_of(job.log)) {
    if (l.find("\"worker_up\"") == std::string::npos) continue;
    pid_of[number_field(l, "node")] = pid_t(number_field(l, "pid"));
    if (number_field(l, "stage") == -1) spares.insert(number_field(l, "node"));
  }
  double owner = -1, holder = -1;
  for (const auto& l : lines_of(job.log)) {
    if (l.find("\"snapshot_holders\"") == std::string::npos) continue;
    const auto at = l.find("\"holders\":\"");
    if (at == std::string::npos) continue;
    if (const double h = std::atof(l.c_str() + at + 11); spares.contains(h)) {
      owner = number_field(l, "node");
      holder = h;
    }
  }
  ASSERT_GE(holder, 0) << "no spare holds a checkpoint\n" << job.output();
  // The checkpoint of iteration 10 is shipped; the next is at 20.
  ASSERT_TRUE(wait_for_iteration(job.log, 12)) << job.output();
  ::kill(pid_of[holder], SIGKILL);
  // Once the head has placed the owner's copies again (after the spare's loss), and the new
  // holder had a few iterations to pull the kept checkpoint: the owner's worker is lost.
  bool placed = false;
  for (int i = 0; i < 6000 && !placed; ++i) {
    bool lost = false;
    for (const auto& l : lines_of(job.log)) {
      lost = lost || l.find("\"worker_lost\"") != std::string::npos;
      placed = placed || (lost && l.find("\"snapshot_holders\"") != std::string::npos &&
                          number_field(l, "node") == owner);
    }
    if (!placed) std::this_thread::sleep_for(10ms);
  }
  ASSERT_TRUE(placed) << job.output();
  ASSERT_TRUE(wait_for_iteration(job.log, newest_iteration(job.log) + 3)) << job.output();
  ::kill(pid_of[owner], SIGKILL);
  ASSERT_EQ(job.wait(120s), 0) << job.output();
  const auto reference = run_moevement("train " + tiny() + " --set parallel.dp=2" + set);
  EXPECT_EQ(hash_of(job.output()), hash_of(reference.output)) << job.output();
  std::string end;
  for (const auto& l : lines_of(job.log)) {
    if (l.find("\"recovery_end\"") != std::string::npos) end = l;
  }
  ASSERT_FALSE(end.empty()) << job.output();
  EXPECT_GE(number_field(end, "rollback_to"), 10) << end;
}

// SIGTERM to a stage's worker (what an admin or Slurm sends): it says goodbye, and that loss
// is recovered like any other, on the spare, bit-exact (before, its actor's stop ended the
// job).
TEST(launch, a_worker_stopped_with_sigterm_is_rebuilt_on_a_spare) {
  const std::string set = " --set train.iterations=100 --set train.seq_len=16";
  endless_launch job("term",
                     "--set cluster.spares=1 --set checkpoint.policy=moevement "
                     "--set checkpoint.durable=false" +
                         set);
  ASSERT_EQ(job.wait_for_workers(5).size(), 5u) << job.output();
  pid_t stage1 = 0;
  for (const auto& l : lines_of(job.log)) {
    if (l.find("\"worker_up\"") != std::string::npos && number_field(l, "stage") == 1 &&
        number_field(l, "replica") == 0) {
      stage1 = pid_t(number_field(l, "pid"));
    }
  }
  ASSERT_GT(stage1, 0) << job.output();
  ::kill(stage1, SIGTERM);
  ASSERT_EQ(job.wait(120s), 0) << job.output();
  const auto reference = run_moevement("train " + tiny() + " --set parallel.dp=2" + set);
  EXPECT_EQ(hash_of(job.output()), hash_of(reference.output)) << job.output();
  EXPECT_NE(job.output().find("stopped by signal 15"), std::string::npos) << job.output();
  EXPECT_NE(job.output().find("stage 1 recovered on worker"), std::string::npos) << job.output();
}

TEST(launch, hung_worker_is_detected_by_heartbeats) {
  endless_launch job("hang", "--set cluster.failure_timeout_ms=500");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  ::kill(pids[2], SIGSTOP);
  const int rc = job.wait(60s);
  const std::string out = job.output();
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("was lost"), std::string::npos) << out;
  EXPECT_TRUE(all_gone(pids)) << "the stopped worker outlived the job";
}

// A stage whose compute hangs while its worker lives (heartbeats go on: no loss is found): the
// iteration's time limit ends the job, naming the stages that did not finish it.
TEST(launch, a_stage_stalled_with_its_worker_alive_ends_the_job_at_the_iteration_time_limit) {
  const auto o = launch("stall", tiny() +
                                     " --set train.iterations=20 --set parallel.pp=2 "
                                     "--set cluster.iteration_timeout_ms=2000 "
                                     "--inject stall:stage=1,replica=0,iter=5,phase=backward");
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("inject: stall:stage=1,replica=0,iter=5,phase=backward"),
            std::string::npos)
      << o.output;
  EXPECT_NE(o.output.find("iteration 5 did not end within cluster.iteration_timeout_ms = 2000 ms"),
            std::string::npos)
      << o.output;
  EXPECT_NE(o.output.find("stage 1 replica 0"), std::string::npos) << o.output;
  EXPECT_EQ(o.count("worker_lost"), 0) << o.output;
  EXPECT_EQ(o.hash, "");
}

TEST(launch, interrupt_stops_every_worker) {
  endless_launch job("sigint", "");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  ::kill(job.pid, SIGINT);
  const int rc = job.wait(60s);
  EXPECT_EQ(rc, 130) << job.output();
  EXPECT_NE(job.output().find("interrupted"), std::string::npos);
  EXPECT_TRUE(all_gone(pids)) << "a worker outlived Ctrl-C";
}

// A hang-up (the terminal closed): a worker's is ignored (UCX's own handler turned its log to
// debug level, flooding the console), the head's stops the job as an interrupt does.
TEST(launch, a_hang_up_stops_the_job_from_the_head_only) {
  endless_launch job("sighup", "");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  ::kill(pids[1], SIGHUP);
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(::kill(pids[1], 0), 0) << "a worker ended on SIGHUP";
  ::kill(job.pid, SIGHUP);
  EXPECT_EQ(job.wait(60s), 128 + SIGHUP) << job.output();
  const std::string out = job.output();
  EXPECT_NE(out.find("interrupted by signal 1 (Hangup): stopped every worker"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("UCX  DEBUG"), std::string::npos) << out;
  EXPECT_TRUE(all_gone(pids)) << "a worker outlived the hang-up";
}

// `moevement launch ... | head`: a closed standard output stops the job as an interrupt does,
// saying so on stderr and in the run log (the head died of SIGPIPE where it printed, silently).
TEST(launch, a_closed_standard_output_stops_the_job_saying_so) {
  const std::string log = log_path("sigpipe");
  const std::string err = log + ".stderr";
  std::filesystem::remove(log);
  const auto r =
      run_moevement("launch " + tiny() + " " + short_run("--set train.iterations=400", log) +
                    " 2>" + err + " | head -n 1");
  EXPECT_EQ(r.exit_code, 0) << r.output;  // head's
  std::ifstream e(err);
  const std::string said((std::istreambuf_iterator<char>(e)), std::istreambuf_iterator<char>());
  EXPECT_NE(said.find("the output was closed (SIGPIPE): stopped every worker"), std::string::npos)
      << said;
  std::ifstream l(log);
  const std::string logged((std::istreambuf_iterator<char>(l)), std::istreambuf_iterator<char>());
  EXPECT_NE(logged.find("\"event\":\"job_failed\""), std::string::npos) << logged;
  std::filesystem::remove(err);
}

TEST(launch, head_killed_takes_its_workers_with_it) {
  endless_launch job("headkill", "");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  ::kill(job.pid, SIGKILL);
  EXPECT_EQ(job.wait(60s), 128 + SIGKILL);
  EXPECT_TRUE(all_gone(pids)) << "a worker outlived its head";
}

// The head stopped (SIGSTOP) past the failure timeout and continued: its workers gave up on
// it meanwhile, and the job says so, not only that the workers were lost.
TEST(launch, a_head_stopped_and_continued_says_what_happened) {
  endless_launch job("headstop", "--set cluster.failure_timeout_ms=500");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  ::kill(job.pid, SIGSTOP);
  std::this_thread::sleep_for(2s);
  ::kill(job.pid, SIGCONT);
  const int rc = job.wait(60s);
  const std::string out = job.output();
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("the head did not run for"), std::string::npos) << out;
  EXPECT_NE(out.find("the head itself did not run for"), std::string::npos) << out;
  EXPECT_TRUE(all_gone(pids)) << "a worker outlived the job";
}

// The head's port, from a worker's command line ("--head HOST:PORT"); 0 if not found.
int head_port_of(pid_t worker) {
  std::ifstream in("/proc/" + std::to_string(worker) + "/cmdline");
  std::vector<std::string> args;
  for (std::string a; std::getline(in, a, '\0');) args.push_back(a);
  for (std::size_t i = 0; i + 1 < args.size(); ++i) {
    if (args[i] == "--head")
      return std::atoi(args[i + 1].substr(args[i + 1].rfind(':') + 1).c_str());
  }
  return 0;
}

// With shared memory only (UCX_TLS=sm,self) a job starts (UCX's own listener could not connect
// such processes: every worker lost the head at once) and trains to `train`'s hash. 64 zero
// bytes sent to the head's port meanwhile (they aborted the head inside UCX's connection
// manager before the admission socket) cost nothing and are reported in the run log.
TEST(launch, a_shared_memory_only_job_trains_bit_exact_and_shrugs_off_junk) {
  const std::string set = "--set train.iterations=100 --set train.seq_len=16";
  const auto t = run_moevement("train " + tiny() + " " + set);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  ::setenv("UCX_TLS", "sm,self", 1);
  background_launch job("sm_only", tiny() + " " + set + " --set parallel.pp=2");
  const auto pids = job.wait_for_workers(2);
  ::unsetenv("UCX_TLS");
  ASSERT_EQ(pids.size(), 2u) << job.output();
  const int port = head_port_of(pids[0]);
  ASSERT_GT(port, 0);
  const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(std::uint16_t(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(s, reinterpret_cast<const sockaddr*>(&a), sizeof a), 0);
  const std::vector<char> zeros(64, 0);
  EXPECT_EQ(::send(s, zeros.data(), zeros.size(), MSG_NOSIGNAL), 64);
  ::close(s);
  ASSERT_EQ(job.wait(120s), 0) << job.output();
  EXPECT_EQ(hash_of(job.output()), hash_of(t.output));
  bool reported = false;
  for (const auto& l : lines_of(job.log)) {
    reported = reported || (l.find("\"event\":\"link_refusals\"") != std::string::npos &&
                            number_field(l, "bad_hellos") >= 1);
  }
  EXPECT_TRUE(reported) << "the junk is not in the run log";
}

TEST(launch, bad_configs_name_the_key) {
  const std::string log = " --set engine.run_log=" + log_path("bad");
  struct bad {
    std::string set, key;
  };
  for (const bad& b :
       {bad{"parallel.pp=5", "parallel.pp"}, bad{"parallel.dp=two", "parallel.dp"},
        bad{"parallel.ppp=2", "parallel.ppp"}, bad{"train.micro_batches=0", "train.micro_batches"},
        bad{"engine.stage=nope", "engine.stage"}, bad{"train.device=cuda", "train.device:"},
        bad{"train.micro_batch_size=1000000000", "train.micro_batch_size"}}) {
    const auto r = run_moevement("launch " + tiny() + " --set " + b.set + log);
    EXPECT_NE(r.exit_code, 0) << b.set;
    EXPECT_NE(r.output.find(b.key), std::string::npos) << b.set << ": " << r.output;
  }
  const auto none = run_moevement("launch /nonexistent.toml");
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.output.find("/nonexistent.toml"), std::string::npos) << none.output;
  // A directory is no config (TOML readers take it for an empty file: every default).
  for (const char* command : {"launch ", "train "}) {
    const auto dir = run_moevement(command + ::testing::TempDir());
    EXPECT_NE(dir.exit_code, 0) << dir.output;
    EXPECT_NE(dir.output.find("not a config file"), std::string::npos) << dir.output;
    EXPECT_EQ(dir.output.find("state_hash="), std::string::npos) << dir.output;
  }
  // The simulator's configs and profiles say what reads them.
  for (const char* file : {"simulate_gpt_moe.toml", "profile_tiny_measured.toml"}) {
    const auto sim = run_moevement(
        "launch " + source_path(std::string("examples/configs/") + file) + " --dry-run");
    EXPECT_NE(sim.exit_code, 0) << sim.output;
    EXPECT_NE(sim.output.find("`moevement simulate` reads it"), std::string::npos) << sim.output;
  }
  // --dry-run reads the corpus, as every worker would at its start.
  const auto corpus =
      run_moevement("launch " + tiny() + " --dry-run --set train.corpus=/nonexistent-corpus");
  EXPECT_EQ(corpus.exit_code, 1) << corpus.output;
  EXPECT_NE(corpus.output.find("train.corpus: '/nonexistent-corpus' does not exist"),
            std::string::npos)
      << corpus.output;
  // A report with nowhere to go is refused before the job runs.
  const auto report = run_moevement("launch " + tiny() + " --report /nonexistent-dir/r.html");
  EXPECT_NE(report.exit_code, 0);
  EXPECT_NE(report.output.find("there is no directory /nonexistent-dir"), std::string::npos)
      << report.output;
  EXPECT_EQ(report.output.find("state_hash="), std::string::npos) << report.output;
  // So is one that would overwrite the run log (named another way): it ran the job before,
  // then wrote no report and exited 0.
  const std::string own_log = ::testing::TempDir() + "report_is_log_" + std::to_string(::getpid());
  const auto same = run_moevement("launch " + tiny() + " --set engine.run_log=" + own_log +
                                  ".jsonl --report " + ::testing::TempDir() + "./" +
                                  std::filesystem::path(own_log).filename().string() + ".jsonl");
  EXPECT_EQ(same.exit_code, 1) << same.output;
  EXPECT_NE(same.output.find("that is the job's run log (engine.run_log)"), std::string::npos)
      << same.output;
  EXPECT_EQ(same.output.find("state_hash="), std::string::npos) << same.output;
  EXPECT_FALSE(std::filesystem::exists(own_log + ".jsonl"));
}

}  // namespace
