// `moevement launch` end to end: real worker processes over loopback UCX. Pipelining and data
// parallelism change no bit (the same state_hash as `moevement train`), a worker killed or
// hung under policy `none` ends the job with a clear error, Ctrl-C leaves no process behind.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/run_moevement.hpp"

namespace {

using moevement::test_support::run_moevement;
using moevement::test_support::source_path;
using namespace std::chrono_literals;

std::string tiny() {
  return source_path("examples/configs/tiny.toml");
}

// A run log path private to this test process.
std::string log_path(const std::string& name) {
  return ::testing::TempDir() + "launch_test_" + std::to_string(::getpid()) + "_" + name + ".jsonl";
}

std::string hash_of(const std::string& out) {
  const std::string tag = "state_hash=";
  const auto at = out.rfind(tag);
  if (at == std::string::npos || (at != 0 && out[at - 1] != '\n')) return "";
  const std::string rest = out.substr(at + tag.size());
  if (rest.size() != 17 || rest.back() != '\n') return "";
  return rest.substr(0, 16);
}

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// The number after "key": in a JSON line (our run log writes flat objects).
double number_field(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":");
  if (at == std::string::npos) return -1;
  return std::strtod(line.c_str() + at + key.size() + 3, nullptr);
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

TEST(launch, data_parallel_reduction_is_the_reference_left_fold) {
  // dp=3: a reduction in any other order than g0 + g1 + g2 changes bits.
  const auto [train, launch] = train_and_launch(2, 3);
  EXPECT_EQ(train.size(), 16u);
  EXPECT_EQ(launch, train);
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
}

// ---- failures: a launch in the background, its workers found through the run log

struct background_launch {
  pid_t pid = -1;
  std::string out_path, log;

  background_launch(const std::string& name, const std::string& extra) {
    out_path = log_path(name) + ".out";
    log = log_path(name);
    ::unlink(log.c_str());
    const std::string bin = std::getenv("MOEVEMENT_BIN");
    const std::string cmd = "exec " + bin + " launch " + tiny() +
                            " --set train.iterations=100000 --set parallel.pp=2 "
                            "--set parallel.dp=2 --set engine.run_log=" +
                            log + " " + extra + " > " + out_path + " 2>&1";
    pid = ::fork();
    if (pid == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
      ::_exit(127);
    }
  }
  // Worker pids from the run log's worker_up events, once all `n` are up and training runs.
  std::vector<pid_t> wait_for_workers(std::size_t n) {
    for (int i = 0; i < 600; ++i) {
      std::vector<pid_t> pids;
      bool training = false;
      for (const auto& l : lines_of(log)) {
        if (l.find("\"event\":\"worker_up\"") != std::string::npos) {
          pids.push_back(pid_t(number_field(l, "pid")));
        }
        if (l.find("\"kind\":\"iteration\"") != std::string::npos) training = true;
      }
      if (pids.size() == n && training) return pids;
      if (::waitpid(pid, nullptr, WNOHANG) == pid) {  // the launch ended early
        pid = -1;
        return {};
      }
      std::this_thread::sleep_for(50ms);
    }
    return {};
  }
  // Exit status, or -1 if it had to be killed after `limit` (a hang: the test fails).
  int wait(std::chrono::seconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    int status = 0;
    while (std::chrono::steady_clock::now() < until) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(20ms);
    }
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    pid = -1;
    return -1;
  }
  std::string output() const {
    std::ifstream in(out_path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  ~background_launch() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

// Gone, or a zombie waiting for a reaper that is not ours.
bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string s;
  std::getline(stat, s);
  const auto close = s.rfind(')');
  return close != std::string::npos && close + 2 < s.size() && s[close + 2] == 'Z';
}

bool all_gone(const std::vector<pid_t>& pids) {
  for (int i = 0; i < 200; ++i) {
    bool gone = true;
    for (pid_t p : pids) gone = gone && process_gone(p);
    if (gone) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

TEST(launch, killed_worker_under_policy_none_ends_the_job_with_a_clear_error) {
  background_launch job("kill", "");
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

TEST(launch, a_lost_spare_does_not_stop_training) {
  const std::string set = " --set train.iterations=40 --set train.seq_len=16";
  background_launch job("spare", "--set cluster.spares=1" + set);
  const auto pids = job.wait_for_workers(5);
  ASSERT_EQ(pids.size(), 5u) << job.output();
  pid_t spare = 0;
  for (const auto& l : lines_of(job.log)) {
    if (l.find("\"worker_up\"") != std::string::npos && number_field(l, "stage") == -1) {
      spare = pid_t(number_field(l, "pid"));
    }
  }
  ASSERT_GT(spare, 0);
  ::kill(spare, SIGKILL);
  ASSERT_EQ(job.wait(120s), 0) << job.output();
  const auto reference = run_moevement("train " + tiny() + " --set parallel.dp=2" + set);
  EXPECT_EQ(hash_of(job.output()), hash_of(reference.output)) << job.output();
  EXPECT_TRUE(all_gone(pids));
}

TEST(launch, hung_worker_is_detected_by_heartbeats) {
  background_launch job("hang", "--set cluster.failure_timeout_ms=500");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  ::kill(pids[2], SIGSTOP);
  const int rc = job.wait(60s);
  const std::string out = job.output();
  EXPECT_EQ(rc, 1) << out;
  EXPECT_NE(out.find("was lost"), std::string::npos) << out;
  EXPECT_TRUE(all_gone(pids)) << "the stopped worker outlived the job";
}

TEST(launch, interrupt_stops_every_worker) {
  background_launch job("sigint", "");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  ::kill(job.pid, SIGINT);
  const int rc = job.wait(60s);
  EXPECT_EQ(rc, 130) << job.output();
  EXPECT_NE(job.output().find("interrupted"), std::string::npos);
  EXPECT_TRUE(all_gone(pids)) << "a worker outlived Ctrl-C";
}

TEST(launch, head_killed_takes_its_workers_with_it) {
  background_launch job("headkill", "");
  const auto pids = job.wait_for_workers(4);
  ASSERT_EQ(pids.size(), 4u) << job.output();
  ::kill(job.pid, SIGKILL);
  EXPECT_EQ(job.wait(60s), 128 + SIGKILL);
  EXPECT_TRUE(all_gone(pids)) << "a worker outlived its head";
}

TEST(launch, bad_configs_name_the_key) {
  const std::string log = " --set engine.run_log=" + log_path("bad");
  struct bad {
    std::string set, key;
  };
  for (const bad& b :
       {bad{"parallel.pp=5", "parallel.pp"}, bad{"parallel.dp=two", "parallel.dp"},
        bad{"parallel.ppp=2", "parallel.ppp"}, bad{"train.micro_batches=0", "train.micro_batches"},
        bad{"engine.stage=nope", "engine.stage"}}) {
    const auto r = run_moevement("launch " + tiny() + " --set " + b.set + log);
    EXPECT_NE(r.exit_code, 0) << b.set;
    EXPECT_NE(r.output.find(b.key), std::string::npos) << b.set << ": " << r.output;
  }
  const auto none = run_moevement("launch /nonexistent.toml");
  EXPECT_NE(none.exit_code, 0);
  EXPECT_NE(none.output.find("/nonexistent.toml"), std::string::npos) << none.output;
}

}  // namespace
