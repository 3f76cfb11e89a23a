// Head failover (cluster.standby_head, docs/recovery.md "Head failover"), end to end with real
// processes: `moevement launch` starts a standby head beside its workers; the head is killed
// (SIGKILL) or stopped (SIGSTOP past the failure timeout) mid-run; the workers stay up, the
// standby takes the head's place and goes on from the running stages (only the iteration in
// flight runs again), or, where a role's worker was lost too, every stage goes back to the
// newest durable window in place; the job ends with the uninterrupted run's state_hash. A head
// woken after it was replaced leaves the workers to the standby.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace {

namespace fs = std::filesystem;
using namespace moevement::test_support;

constexpr const char* iterations = "300";

// tiny at pp = 3 with a spare, windows of 2 with one copy of each slot, the durable tier in
// its default place (beside the run log), and a standby head.
std::string job(const std::string& extra = "") {
  return source_path("examples/configs/tiny.toml") + " --set train.iterations=" + iterations +
         " --set train.seq_len=16 --set parallel.pp=3 --set checkpoint.policy=moevement "
         "--set checkpoint.w_sparse=2 --set checkpoint.replicas=1 --set cluster.spares=1 "
         "--set cluster.standby_head=true --set checkpoint.durable_share=0 " +
         extra;
}

std::string reference(const std::string& its = iterations) {
  static std::map<std::string, std::string> hashes;
  if (!hashes.contains(its)) {
    const auto r = run_moevement("train " + source_path("examples/configs/tiny.toml") +
                                 " --set train.iterations=" + its + " --set train.seq_len=16");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    hashes[its] = hash_of(r.output);
  }
  return hashes[its];
}

int count_events(const std::vector<std::string>& log, const std::string& name) {
  int n = 0;
  for (const auto& l : log) n += l.find("\"event\":\"" + name + "\"") != std::string::npos;
  return n;
}

// Waits until `windows` durable windows are on disk (the run log says so) and the head's
// journal holds one: the journal is written on a thread of its own, which on a loaded machine
// can trail the run log by more than a window (a standby then finds nothing to take over).
// Whether the head's journal holds a whole window: its manifest is written last (renamed into
// place), so a window directory without one is still being written.
bool has_journal(const std::filesystem::path& journal) {
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(journal, ec)) {
    if (std::filesystem::exists(entry.path() / "MANIFEST", ec)) return true;
  }
  return false;
}

bool wait_for_windows(background_launch& j, int windows) {
  const auto journal = std::filesystem::path(j.log).replace_extension(".checkpoints") / "head";
  for (int i = 0; i < 6000; ++i) {
    const auto log = lines_of(j.log);
    if (count_events(log, "job_end") > 0) return false;
    if (count_events(log, "durable_window") >= windows && has_journal(journal)) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

// Waits until the run log has the record of iteration `it`.
bool wait_for_iteration(background_launch& j, int it) {
  const std::string tag = "\"iteration\":" + std::to_string(it) + ",";
  for (int i = 0; i < 6000; ++i) {
    const auto log = lines_of(j.log);
    if (count_events(log, "job_end") > 0) return false;
    for (const auto& l : log) {
      if (l.find(tag) != std::string::npos) return true;
    }
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

// The standby's end: its state_hash line in the shared output (the head's process is gone).
std::string wait_for_hash(background_launch& j) {
  for (int i = 0; i < 1200; ++i) {
    const std::string h = hash_of(j.output());
    if (!h.empty()) return h;
    std::this_thread::sleep_for(100ms);
  }
  return "";
}

// The pid of the worker that started with stage `stage` (its worker_up event), or -1.
pid_t stage_worker_pid(background_launch& j, int stage) {
  pid_t pid = -1;
  for (const auto& l : lines_of(j.log)) {
    if (l.find("\"event\":\"worker_up\"") != std::string::npos &&
        number_field(l, "stage") == stage) {
      pid = pid_t(number_field(l, "pid"));
    }
  }
  return pid;
}

pid_t standby_pid(const std::string& output) {
  const std::string tag = "(standby head, pid ";
  const auto at = output.find(tag);
  return at == std::string::npos ? -1 : pid_t(std::atoi(output.c_str() + at + tag.size()));
}

TEST(head_failover, a_killed_head_is_replaced_by_the_standby_bit_exact) {
  background_launch j("killed_head", job());
  const auto workers = j.wait_for_workers(4);
  ASSERT_EQ(workers.size(), 4u) << j.output();
  ASSERT_TRUE(wait_for_windows(j, 2)) << j.output();
  const auto killed_at = std::chrono::steady_clock::now();
  ::kill(j.pid, SIGKILL);
  EXPECT_EQ(j.wait(std::chrono::seconds(30)), 128 + SIGKILL);
  // A --resume at once (a wrapper retrying the killed launch) is refused: the standby holds the
  // job's locks from its start (it ran beside the standby's takeover, two heads on one job).
  const auto again =
      run_moevement("launch " + job() + " --set engine.run_log=" + j.log + " --resume");
  EXPECT_EQ(again.exit_code, 1) << again.output;
  EXPECT_NE(again.output.find("is in use by another running `moevement launch`"), std::string::npos)
      << again.output;
  const std::string hash = wait_for_hash(j);
  const std::string out = j.output();
  EXPECT_EQ(hash, reference()) << out;
  EXPECT_NE(out.find("the head was lost"), std::string::npos) << out;
  EXPECT_NE(out.find("taking over with 4 workers"), std::string::npos) << out;
  // The run log goes on: the standby's job_start, live from the running stages, one end.
  const auto log = lines_of(j.log);
  EXPECT_EQ(count_events(log, "job_start"), 2) << out;
  EXPECT_EQ(count_events(log, "job_end"), 1) << out;
  std::string resumed;
  double last_logged = -1;  // the lost head's last committed iteration
  for (const auto& l : log) {
    if (l.find("\"resume_window\"") != std::string::npos) resumed = l;
    if (resumed.empty() && l.find("\"kind\":\"iteration\"") != std::string::npos) {
      last_logged = number_field(l, "iteration");
    }
  }
  ASSERT_FALSE(resumed.empty()) << out;
  EXPECT_NE(resumed.find("\"takeover\":\"live\""), std::string::npos) << resumed;
  EXPECT_NE(out.find("goes on from the running stages"), std::string::npos) << out;
  // Nothing committed is lost: training goes on past the last iteration the head logged (and
  // past one more where the stages stepped it, the head lost before it heard).
  const double resumed_at = number_field(resumed, "resume_iteration");
  EXPECT_GE(resumed_at, last_logged + 1) << resumed;
  EXPECT_LE(resumed_at, last_logged + 2) << resumed;
  // The standby's final line says which iterations and seconds were its own.
  EXPECT_NE(out.find(fmt::format("({} iterations, {} of them in this run: ", iterations,
                                 std::stol(iterations) - long(resumed_at))),
            std::string::npos)
      << out;
  std::printf("head killed: the standby's hash after %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count());
  // Nothing is left behind: the workers (and the spare) and the standby end with the job.
  EXPECT_TRUE(all_gone(workers)) << out;
  const pid_t standby = standby_pid(out);
  ASSERT_GT(standby, 0) << out;
  EXPECT_TRUE(all_gone({standby})) << out;
}

// The head lost while its Step messages go out (engine.head_exit_at: sent to stage 0 only, then
// SIGKILL): stage 0 stepped iteration 150 and the others hold its reduced gradients. The
// standby sends them the lost head's Step (its plan, place and popularity, kept by stage 0),
// and nothing is lost: training goes on at 151, bit-exact.
TEST(head_failover, a_step_that_reached_part_of_the_stages_is_completed_by_the_standby) {
  background_launch j("half_step", job("--set engine.head_exit_at=150"));
  const auto workers = j.wait_for_workers(4);
  ASSERT_EQ(workers.size(), 4u) << j.output();
  EXPECT_EQ(j.wait(std::chrono::seconds(60)), 128 + SIGKILL);
  const std::string hash = wait_for_hash(j);
  const std::string out = j.output();
  EXPECT_EQ(hash, reference()) << out;
  EXPECT_NE(out.find("(the step of iteration 150 sent to the stages that lacked it)"),
            std::string::npos)
      << out;
  std::string resumed;
  for (const auto& l : lines_of(j.log)) {
    if (l.find("\"takeover\":\"live\"") != std::string::npos) resumed = l;
  }
  ASSERT_FALSE(resumed.empty()) << out;
  EXPECT_EQ(number_field(resumed, "resume_iteration"), 151) << resumed;
  EXPECT_EQ(number_field(resumed, "completed_step"), 150) << resumed;
  // Step 150 began the lost head's window 75 (W 2): the standby's windows begin at 151, part
  // of the way through it. Its windows still persist: each stage ships the slot of its step
  // from the window it captured it into (it took the older, empty one for it, and no window
  // ever persisted again: a 10 s stall, then every window skipped).
  int persisted = 0;
  bool after = false;
  for (const auto& l : lines_of(j.log)) {
    after |= l.find("\"takeover\":\"live\"") != std::string::npos;
    persisted += after && l.find("\"event\":\"window_persisted\"") != std::string::npos;
  }
  EXPECT_GE(persisted, 3) << out;
  EXPECT_EQ(out.find("captured nothing of a window"), std::string::npos) << out;
  EXPECT_TRUE(all_gone(workers)) << out;
}

// Group replays before and after a takeover (dp 2: stage 1's group replays on its spare and
// the survivor replica): the standby numbers its recovery generations past the lost head's,
// which every worker's hello carries. (From 1 again, the survivor's group exchange, at the
// lost head's generation 2, took the next replay for an old one: "superseded", the job lost.)
TEST(head_failover, group_replays_after_a_takeover_go_on_past_the_lost_heads_generations) {
  const std::string config =
      source_path("examples/configs/tiny.toml") +
      " --set train.iterations=60 --set train.seq_len=16 --set parallel.pp=2 --set parallel.dp=2";
  const auto fault_free = run_moevement("train " + config);
  ASSERT_EQ(fault_free.exit_code, 0) << fault_free.output;
  background_launch j("generations",
                      config +
                          " --set checkpoint.policy=moevement --set checkpoint.w_sparse=2 "
                          "--set cluster.spares=3 --set cluster.standby_head=true "
                          "--set checkpoint.durable_share=0 --set engine.head_exit_at=30 "
                          "--inject kill:stage=1,replica=0,iter=5,phase=forward "
                          "--inject kill:stage=1,replica=0,iter=15,phase=forward "
                          "--inject kill:stage=1,replica=0,iter=45,phase=forward");
  EXPECT_EQ(j.wait(std::chrono::seconds(60)), 128 + SIGKILL);
  const std::string hash = wait_for_hash(j);
  const std::string out = j.output();
  EXPECT_EQ(hash, hash_of(fault_free.output)) << out;
  EXPECT_EQ(out.find("superseded"), std::string::npos) << out;
  std::vector<double> generations;  // of every recovery, the lost head's then the standby's
  bool taken_over = false;
  for (const auto& l : lines_of(j.log)) {
    if (l.find("\"takeover\"") != std::string::npos) taken_over = true;
    if (l.find("\"event\":\"recovery_start\"") != std::string::npos) {
      generations.push_back(number_field(l, "generation"));
    }
  }
  EXPECT_TRUE(taken_over) << out;
  ASSERT_EQ(generations.size(), 3u) << out;
  EXPECT_LT(generations[0], generations[1]);
  EXPECT_LT(generations[1], generations[2]) << "the standby numbers past the lost head";
}

// A worker killed with the head: lost while the standby takes over, its role goes to the spare,
// which restores it from disk like every other stage, and the job ends bit-exact.
TEST(head_failover, a_worker_lost_with_the_head_is_replaced_by_the_spare) {
  // Durable writes paced (seconds apart here): the journal trails the stages by many windows,
  // whose numbers the workers' replicators had seen persist.
  background_launch j("head_and_worker", job("--set checkpoint.durable_share=0.0001"));
  const auto workers = j.wait_for_workers(4);
  ASSERT_EQ(workers.size(), 4u) << j.output();
  const pid_t stage1 = stage_worker_pid(j, 1);
  ASSERT_GT(stage1, 0) << j.output();
  ASSERT_TRUE(wait_for_windows(j, 1)) << j.output();
  ASSERT_TRUE(wait_for_iteration(j, 60)) << j.output();
  // Stopped before the head dies, so that it answers nothing of the standby's: the standby
  // finds the head's port closed at once (its admission socket refuses), and a worker killed
  // a moment after the head could still answer its first ask.
  ::kill(stage1, SIGSTOP);
  ::kill(j.pid, SIGKILL);
  ::kill(stage1, SIGKILL);
  EXPECT_EQ(j.wait(std::chrono::seconds(30)), 128 + SIGKILL);
  const std::string hash = wait_for_hash(j);
  const std::string out = j.output();
  EXPECT_EQ(hash, reference()) << out;
  EXPECT_NE(out.find("while the standby head took over; its role goes to a spare"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("cannot go on from the running stages (a role's worker was lost"),
            std::string::npos)
      << out;
  // Windows persist again from the journal's on (the replicators, told of the restart, took
  // them; they refused every one as older than the lost head's, and none persisted again).
  int after = -1;
  for (const auto& l : lines_of(j.log)) {
    if (l.find("\"event\":\"recovery_end\"") != std::string::npos) after = 0;
    if (after >= 0) after += l.find("\"event\":\"window_persisted\"") != std::string::npos;
  }
  EXPECT_GE(after, 2) << out;
  EXPECT_EQ(out.find("captured nothing of a window"), std::string::npos) << out;
  EXPECT_TRUE(all_gone(workers)) << out;
  const pid_t standby = standby_pid(out);
  ASSERT_GT(standby, 0) << out;
  EXPECT_TRUE(all_gone({standby})) << out;
}

// A stage's worker killed right after a live takeover, before the standby head's first window
// persisted (windows of 50 here): the stages told the standby which window the lost head had
// persisted, so the stage is rebuilt from that window's copies in memory (no rollback to
// disk), and the job ends bit-exact.
TEST(head_failover, a_worker_lost_right_after_a_live_takeover_is_rebuilt_from_memory) {
  // Longer than the others: two durable windows of 50 must be on disk before the kill, and
  // under a loaded machine's fsyncs 300 iterations ended first.
  const std::string longer = "600";
  background_launch j("lost_after_takeover",
                      job("--set checkpoint.w_sparse=50 --set train.iterations=" + longer));
  const auto workers = j.wait_for_workers(4);
  ASSERT_EQ(workers.size(), 4u) << j.output();
  const pid_t stage1 = stage_worker_pid(j, 1);
  ASSERT_GT(stage1, 0) << j.output();
  ASSERT_TRUE(wait_for_windows(j, 2)) << j.output();  // the first is journaled by then
  ::kill(j.pid, SIGKILL);
  EXPECT_EQ(j.wait(std::chrono::seconds(30)), 128 + SIGKILL);
  // A minute at most: the loss must come after the takeover, however slow the machine.
  for (int i = 0; i < 12000 && j.output().find("goes on from the running") == std::string::npos;
       ++i) {
    std::this_thread::sleep_for(5ms);
  }
  ASSERT_NE(j.output().find("goes on from the running"), std::string::npos) << j.output();
  ::kill(stage1, SIGKILL);
  const std::string hash = wait_for_hash(j);
  const std::string out = j.output();
  EXPECT_EQ(hash, reference(longer)) << out;
  EXPECT_NE(out.find("goes on from the running stages"), std::string::npos) << out;
  EXPECT_NE(out.find("a recovery starts from window"), std::string::npos) << out;
  EXPECT_NE(out.find("in memory"), std::string::npos) << out;
  const auto log = lines_of(j.log);
  EXPECT_EQ(count_events(log, "durable_rollback"), 0) << out;
  EXPECT_GE(count_events(log, "recovery_end"), 1) << out;
  EXPECT_TRUE(all_gone(workers)) << out;
}

// Once two windows are on disk, stops the head (SIGSTOP past the 3 s failure timeout of these
// jobs) and waits, a minute at most, until the output says the standby takes over; the head
// stays stopped. The workers, or none where they did not all start.
std::vector<pid_t> stop_head_until_taken_over(background_launch& j) {
  auto workers = j.wait_for_workers(4);
  if (workers.size() != 4 || !wait_for_windows(j, 2)) return {};
  ::kill(j.pid, SIGSTOP);
  for (int i = 0; i < 3000 && j.output().find("taking over") == std::string::npos; ++i) {
    std::this_thread::sleep_for(20ms);
  }
  return workers;
}

// SIGSTOP past the failure timeout: the standby takes over; the head, woken, finds that it was
// replaced and ends (status 1) without touching the workers, which finish under the standby.
TEST(head_failover, a_stopped_head_yields_to_the_standby_when_it_wakes) {
  background_launch j("stopped_head", job("--set cluster.failure_timeout_ms=3000"));
  const auto workers = stop_head_until_taken_over(j);  // woken only once the standby took over
  ::kill(j.pid, SIGCONT);
  ASSERT_EQ(workers.size(), 4u) << j.output();
  ASSERT_NE(j.output().find("taking over"), std::string::npos) << j.output();
  // It waits for the standby, its child, and ends with the job's status.
  EXPECT_EQ(j.wait(std::chrono::seconds(60)), 0) << j.output();
  EXPECT_NE(j.output().find("waiting for the standby head (pid"), std::string::npos) << j.output();
  const std::string hash = wait_for_hash(j);
  const std::string out = j.output();
  EXPECT_EQ(hash, reference()) << out;
  // (Its own stall's words, or the standby's verdict on it: whichever it read first.)
  EXPECT_TRUE(out.find("the standby head took this head's place") != std::string::npos ||
              out.find("this head did not run for longer than the failure timeout (3000 ms)") !=
                  std::string::npos)
      << out;
  EXPECT_NE(out.find("the job to it"), std::string::npos) << out;
  EXPECT_TRUE(all_gone(workers)) << out;
}

// SIGUSR1 (stop at the next window on disk) to a head that yielded to its standby and waits
// for it: passed on to the standby, which stops the job there (status 75, `--resume` goes on).
// (It was dropped: the job ran to its end.)
TEST(head_failover, sigusr1_to_a_replaced_head_stops_the_job_under_the_standby) {
  background_launch j("usr1_replaced", job("--set cluster.failure_timeout_ms=3000"));
  const auto workers = stop_head_until_taken_over(j);
  ::kill(j.pid, SIGCONT);
  ASSERT_EQ(workers.size(), 4u) << j.output();
  for (int i = 0; i < 3000 && j.output().find("waiting for the standby head") == std::string::npos;
       ++i) {
    std::this_thread::sleep_for(20ms);
  }
  ASSERT_NE(j.output().find("waiting for the standby head"), std::string::npos) << j.output();
  ::kill(j.pid, SIGUSR1);
  EXPECT_EQ(j.wait(std::chrono::seconds(60)), 75) << j.output();
  const std::string out = j.output();
  EXPECT_NE(out.find("SIGUSR1 passed on to the standby head"), std::string::npos) << out;
  EXPECT_NE(out.find("SIGUSR1: stopping once the next durable window is on disk"),
            std::string::npos)
      << out;
  EXPECT_EQ(count_events(lines_of(j.log), "job_stopped"), 1) << out;
  EXPECT_TRUE(all_gone(workers)) << out;
}

// The standby takes over from a stopped head and is then killed itself: the workers say they
// lost the standby that took over, and the head, woken, says the standby took the job over and
// ended before the job's end (it said the standby never took it over), with how to go on.
TEST(head_failover, a_standby_killed_after_it_took_over_is_reported_as_such) {
  background_launch j("standby_killed", job("--set cluster.failure_timeout_ms=3000"));
  const auto workers = stop_head_until_taken_over(j);
  bool started = false;  // the standby's job_start (a takeover)
  for (int i = 0; i < 3000 && !started; ++i) {
    for (const auto& l : lines_of(j.log)) {
      started |= l.find("\"event\":\"job_start\"") != std::string::npos &&
                 l.find("\"takeover\"") != std::string::npos;
    }
    if (!started) std::this_thread::sleep_for(20ms);
  }
  const pid_t standby = standby_pid(j.output());
  if (!started || standby <= 0 || workers.size() != 4) ::kill(j.pid, SIGCONT);
  ASSERT_TRUE(started && standby > 0 && workers.size() == 4) << j.output();
  ::kill(standby, SIGKILL);
  ::kill(j.pid, SIGCONT);
  EXPECT_EQ(j.wait(std::chrono::seconds(60)), 128 + SIGKILL) << j.output();
  const std::string out = j.output();
  EXPECT_NE(out.find("which ended (status 137) after it took the job over, before the job's end: "
                     "`moevement launch CONFIG --resume` goes on"),
            std::string::npos)
      << out;
  const auto log = lines_of(j.log);
  EXPECT_EQ(count_events(log, "job_failed"), 1) << out;
  EXPECT_EQ(count_events(log, "job_end"), 0) << out;
  EXPECT_TRUE(all_gone(workers)) << out;
  // (Their last words, once they are gone.)
  EXPECT_NE(j.output().find("lost the standby head (node 5) that took over"), std::string::npos)
      << j.output();
}

// SIGTERM to a standby that has not taken over ends it alone: it leaves the cluster, the head
// says the job goes on without one, and the job ends bit-exact. (It was ignored, and a later
// takeover ran the job anyway.)
// The launch's child with --standby-of on its command line, or -1.
pid_t standby_child(pid_t launch) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator("/proc", ec)) {
    std::ifstream stat(entry.path() / "stat");
    std::string pid, name, state, ppid;
    if (!(stat >> pid >> name >> state >> ppid) || ppid != std::to_string(launch)) continue;
    std::ifstream cmd(entry.path() / "cmdline");
    const std::string args((std::istreambuf_iterator<char>(cmd)), {});
    if (args.find("--standby-of") != std::string::npos) return std::atoi(pid.c_str());
  }
  return -1;
}

TEST(head_failover, a_standby_stopped_by_sigterm_leaves_and_the_job_goes_on) {
  background_launch j("standby_term", job("--set train.iterations=120"));
  const auto workers = j.wait_for_workers(4);
  ASSERT_EQ(workers.size(), 4u) << j.output();
  ASSERT_TRUE(wait_for_iteration(j, 5)) << j.output();
  const pid_t standby = standby_child(j.pid);
  ASSERT_GT(standby, 0) << j.output();
  ::kill(standby, SIGTERM);
  EXPECT_EQ(j.wait(std::chrono::seconds(60)), 0) << j.output();
  const std::string out = j.output();
  EXPECT_EQ(hash_of(out), reference("120")) << out;
  EXPECT_NE(out.find("stopped by signal 15 (Terminated) before it took over"), std::string::npos)
      << out;
  EXPECT_EQ(count_events(lines_of(j.log), "standby_lost"), 1) << out;
  EXPECT_TRUE(all_gone(workers)) << out;
  EXPECT_TRUE(all_gone({standby})) << out;
}

// The same before the standby said hello (stopped as it starts, then SIGTERM): the head,
// whose admission waits for that hello, hears of its end and starts without one. (It failed
// the job: "worker 5 (pid ...) was killed by signal 15".)
TEST(head_failover, a_standby_ended_before_it_joined_leaves_the_job_to_the_head) {
  background_launch j("standby_early", job("--set train.iterations=60"));
  pid_t standby = -1;
  for (int i = 0; i < 20000 && standby < 0; ++i) {
    standby = standby_child(j.pid);
    if (standby < 0) std::this_thread::sleep_for(1ms);
  }
  ASSERT_GT(standby, 0) << j.output();
  ::kill(standby, SIGSTOP);
  ::kill(standby, SIGTERM);
  ::kill(standby, SIGCONT);
  EXPECT_EQ(j.wait(std::chrono::seconds(60)), 0) << j.output();
  const std::string out = j.output();
  EXPECT_EQ(hash_of(out), reference("60")) << out;
  EXPECT_EQ(count_events(lines_of(j.log), "standby_lost"), 1) << out;
  // (Killed by the signal, or exited on it: as far as it got in its start.)
  EXPECT_NE(out.find(" before it joined: a loss of this head now ends the job"), std::string::npos)
      << out;
}

// The head killed before the first durable window is journaled: the standby has nothing to
// take over from; it says so and ends, and the workers end with it (nothing left behind).
TEST(head_failover, a_head_lost_before_the_first_window_ends_the_job_saying_why) {
  background_launch j("no_window", job("--set checkpoint.w_sparse=50"));
  const auto workers = j.wait_for_workers(4);
  ASSERT_EQ(workers.size(), 4u) << j.output();
  ASSERT_EQ(count_events(lines_of(j.log), "durable_window"), 0) << j.output();
  ::kill(j.pid, SIGKILL);
  EXPECT_EQ(j.wait(std::chrono::seconds(30)), 128 + SIGKILL);
  EXPECT_TRUE(all_gone(workers)) << j.output();
  const std::string said =
      "the head was lost before the job's first durable window reached the disk: nothing to "
      "take over from; run the job again";
  for (int i = 0; i < 1500 && j.output().find(said) == std::string::npos; ++i) {
    std::this_thread::sleep_for(20ms);
  }
  const std::string out = j.output();
  EXPECT_NE(out.find(said), std::string::npos) << out;
  const pid_t standby = standby_pid(out);
  ASSERT_GT(standby, 0) << out;
  EXPECT_TRUE(all_gone({standby})) << out;
  EXPECT_TRUE(hash_of(out).empty()) << out;
  // The run log ends with the job's failure, saying why (a report shows it).
  EXPECT_EQ(count_events(lines_of(j.log), "job_failed"), 1) << out;
}

// Where it cannot apply (no durable tier to take over from), the key is a config error.
TEST(head_failover, the_key_is_refused_without_the_durable_tier) {
  for (const char* bad : {"--set checkpoint.policy=none", "--set checkpoint.durable=false"}) {
    const auto r = run_moevement("launch " + job(bad) + " --dry-run");
    EXPECT_NE(r.exit_code, 0) << bad;
    EXPECT_NE(r.output.find("cluster.standby_head"), std::string::npos) << r.output;
  }
}

}  // namespace
