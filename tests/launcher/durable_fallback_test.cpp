// Policy `moevement` with the durable tier (checkpoint.durable = true) under `moevement launch`,
// end to end with real processes: persisted windows are written to disk in the background,
// and when every copy of a snapshot a recovery needs is gone (a stage and the only replicator
// holding its window are SIGKILLed together, once the run log shows windows on disk), the
// whole job rolls back to the newest window every stage
// replica has complete and verified on disk, replays to the failed iteration and ends with the
// fault-free state_hash. A corrupt newest window is rejected with its reason and the one before
// it is used. (Without the durable tier the same failure ends the job saying which slot is
// gone: tests/launcher/joint_recovery_test.cpp.)
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace {

namespace fs = std::filesystem;
using namespace moevement::test_support;

std::string tiny() {
  return source_path("examples/configs/tiny.toml");
}

// A fresh checkpoint.dir, private to this test process.
std::string checkpoint_dir(const std::string& name) {
  const fs::path d =
      fs::path(::testing::TempDir()) / ("durable_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  return d.string();
}

// Iterations of the jobs: enough that a busy machine's disk (fsync) has written windows well
// before the end (40 were not always: a whole tiny job takes under a second).
constexpr const char* iterations = "100";

// tiny, pp=3, a window of 2, one copy of every slot (stage 0's on stage 1's worker, see
// recovery_test), the durable tier on (its default on the local backend) in `dir` (empty: its
// default, beside the run log), every window written (unpaced: these tests wait for windows
// on disk; `pace` is the share the durable writes may take).
std::string job(const std::string& dir, const std::string& extra = "",
                const std::string& pace = "0") {
  return tiny() + " --set train.iterations=" + iterations +
         " --set train.seq_len=16 --set parallel.pp=3 "
         "--set checkpoint.policy=moevement --set checkpoint.w_sparse=2 "
         "--set checkpoint.replicas=1 --set cluster.spares=2 "
         "--set cluster.failure_timeout_ms=3000 --set checkpoint.durable_share=" +
         pace + " " + (dir.empty() ? "" : "--set checkpoint.dir=" + dir + " ") + extra;
}

// The uninterrupted run's hash, by `moevement train`.
std::string reference(const std::string& its = iterations) {
  static std::map<std::string, std::string> hashes;
  if (!hashes.contains(its)) {
    const auto r = run_moevement("train " + tiny() + " --set train.iterations=" + its +
                                 " --set train.seq_len=16");
    EXPECT_EQ(r.exit_code, 0) << r.output;
    hashes[its] = hash_of(r.output);
  }
  return hashes[its];
}

// The least a resumed job runs.
constexpr const char* resume_iterations = "100";

int count_events(const std::vector<std::string>& log, const std::string& name) {
  int n = 0;
  for (const auto& l : log) n += l.find("\"event\":\"" + name + "\"") != std::string::npos;
  return n;
}

// The run log once it shows `windows` durable windows (or after 30 s).
std::vector<std::string> wait_for_durable_windows(background_launch& j, int windows) {
  std::vector<std::string> log;
  for (int i = 0; i < 6000 && count_events(log, "durable_window") < windows; ++i) {
    std::this_thread::sleep_for(5ms);
    log = lines_of(j.log);
  }
  return log;
}

// Once `windows` durable windows are on disk everywhere (the run log says so), SIGKILLs the
// workers of `stages` together; by default stages 0 and 1: stage 0's only snapshot copy dies
// with stage 1's worker. `meanwhile` runs with them stopped (SIGSTOP) just before: their
// files change no more.
void kill_after_durable_windows(background_launch& j, int windows,
                                const std::set<int>& stages = {0, 1},
                                const std::function<void()>& meanwhile = {}) {
  const auto log = wait_for_durable_windows(j, windows);
  ASSERT_GE(count_events(log, "durable_window"), windows) << j.output();
  ASSERT_EQ(count_events(log, "job_end"), 0) << "the job ended before the failure";
  std::vector<pid_t> victims;
  for (const auto& l : log) {
    if (l.find("\"event\":\"worker_up\"") == std::string::npos) continue;
    const int stage = int(number_field(l, "stage"));
    if (stages.contains(stage)) victims.push_back(pid_t(number_field(l, "pid")));
  }
  ASSERT_EQ(victims.size(), stages.size());
  if (meanwhile) {
    for (const pid_t p : victims) ::kill(p, SIGSTOP);
    meanwhile();
  }
  for (const pid_t p : victims) ::kill(p, SIGKILL);
}

// Waits until the run log shows `name`.
bool wait_for_event(background_launch& j, const std::string& name) {
  for (int i = 0; i < 6000; ++i) {
    if (count_events(lines_of(j.log), name) > 0) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

using outcome = launch_outcome;

std::vector<const std::string*> events(const outcome& o, const std::string& name) {
  return o.events(name);
}

TEST(durable_fallback, every_copy_gone_rolls_the_job_back_to_disk_bit_exact) {
  // The defaults: the durable tier on, in a directory beside the run log.
  background_launch j("gone", job(""));
  const fs::path dir = fs::path(j.log).replace_extension(".checkpoints");
  kill_after_durable_windows(j, 1);
  EXPECT_TRUE(fs::is_directory(dir / "stage-0-replica-0")) << dir;
  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  // Windows were written, each with its bytes and seconds.
  const auto written = events(o, "durable_window");
  ASSERT_FALSE(written.empty()) << o.output;
  for (const auto* w : written) {
    EXPECT_GT(number_field(*w, "bytes"), 0) << *w;
    EXPECT_GE(number_field(*w, "seconds"), 0) << *w;
    EXPECT_EQ(number_field(*w, "failed"), 0) << *w;
  }
  // The regional restore found a slot on no live replicator; the job went back to disk.
  const auto rollbacks = events(o, "durable_rollback");
  ASSERT_EQ(rollbacks.size(), 1u) << o.output;
  const double window = number_field(*rollbacks[0], "window");
  EXPECT_GE(window, 0);
  EXPECT_GT(number_field(*rollbacks[0], "target_iteration"), 2 * window + 1);
  EXPECT_NE(rollbacks[0]->find("is on no live replicator"), std::string::npos) << *rollbacks[0];
  const auto ends = events(o, "recovery_end");
  ASSERT_EQ(ends.size(), 1u) << o.output;
  EXPECT_NE(ends[0]->find("\"recovery\":\"durable\""), std::string::npos) << *ends[0];
  EXPECT_EQ(number_field(*ends[0], "first_stage"), 0);
  EXPECT_EQ(number_field(*ends[0], "last_stage"), 2);
  EXPECT_EQ(number_field(*ends[0], "window"), window);
  // Three stages replayed at once on this host, each on its own worker with a third of the
  // cores (checkpoint.replay_threads = 0), never all of them each: "0/0@4:0.123s:1t,...".
  const int share = std::max(1, int(std::thread::hardware_concurrency()) / 3);
  const auto at = ends[0]->find("\"replays\":\"");
  ASSERT_NE(at, std::string::npos) << *ends[0];
  const std::string replays = ends[0]->substr(at + 11, ends[0]->find('"', at + 11) - at - 11);
  int members = 0;
  for (std::size_t p = replays.find('t'); p != std::string::npos; p = replays.find('t', p + 1)) {
    const auto colon = replays.rfind(':', p);
    EXPECT_EQ(std::atoi(replays.c_str() + colon + 1), share) << replays;
    ++members;
  }
  EXPECT_EQ(members, 3) << replays;
  EXPECT_NE(o.output.find("falling back to the durable tier"), std::string::npos) << o.output;
  // Every stage replica's directory holds its windows (the replacements wrote on after it).
  for (int s = 0; s < 3; ++s) {
    EXPECT_TRUE(fs::is_directory(fs::path(dir) / ("stage-" + std::to_string(s) + "-replica-0")));
  }
  fs::remove_all(dir);
}

// The newest window on disk of a stage is corrupted just before its worker is lost (stopped
// meanwhile: its directory changes no more): it is rejected with its reason and the job
// rolls back to an older window, still bit-exact.
TEST(durable_fallback, a_corrupt_newest_window_falls_back_to_the_previous_one) {
  const std::string dir = checkpoint_dir("corrupt");
  background_launch j("corrupt", job(dir));
  // Stage 0's newest window on disk, corrupted while its worker is stopped, then killed.
  long damaged = -1;
  kill_after_durable_windows(j, 2, {0, 1}, [&] {
    fs::path newest;
    for (const auto& e : fs::directory_iterator(fs::path(dir) / "stage-0-replica-0")) {
      if (fs::exists(e.path() / "MANIFEST") && e.path().filename() > newest.filename()) {
        newest = e.path();
      }
    }
    ASSERT_FALSE(newest.empty()) << "stage 0 wrote no window";
    damaged = std::stol(newest.filename().string().substr(7));
    ASSERT_TRUE(flip_byte(newest / "slot-000000.snap", 64));
  });
  ASSERT_GE(damaged, 0);
  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  const auto rollbacks = events(o, "durable_rollback");
  ASSERT_EQ(rollbacks.size(), 1u) << o.output;
  EXPECT_LT(number_field(*rollbacks[0], "window"), damaged) << *rollbacks[0];
  EXPECT_GE(number_field(*rollbacks[0], "window"), 0) << *rollbacks[0];
  EXPECT_GE(number_field(*rollbacks[0], "rejected"), 1) << *rollbacks[0];
  std::string reasons;
  for (const auto* l : events(o, "durable_rejected")) reasons += *l + "\n";
  EXPECT_NE(reasons.find("stage 0 replica 0: window " + std::to_string(damaged)), std::string::npos)
      << reasons;
  EXPECT_NE(reasons.find("checksum mismatch"), std::string::npos) << reasons;
  EXPECT_NE(o.output.find("durable window rejected"), std::string::npos) << o.output;
  fs::remove_all(dir);
}

// A survivor (stage 2's worker) is SIGKILLed once the job has started falling back to disk:
// the fallback takes a third spare for it and still ends bit for bit as the fault-free run.
TEST(durable_fallback, a_loss_during_the_fallback_is_rebuilt_too) {
  const std::string dir = checkpoint_dir("during");
  background_launch j("during", job(dir, "--set cluster.spares=3"));
  kill_after_durable_windows(j, 1);
  ASSERT_TRUE(wait_for_event(j, "durable_rollback")) << j.output();
  pid_t survivor = 0;
  for (const auto& l : lines_of(j.log)) {
    if (l.find("\"event\":\"worker_up\"") != std::string::npos && number_field(l, "stage") == 2)
      survivor = pid_t(number_field(l, "pid"));
  }
  ASSERT_GT(survivor, 0) << j.output();
  ::kill(survivor, SIGKILL);
  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  EXPECT_GE(events(o, "durable_rollback").size(), 1u) << o.output;
  std::string lost;
  for (const auto* l : events(o, "worker_lost")) lost += *l + "\n";
  EXPECT_EQ(events(o, "worker_lost").size(), 3u) << lost;
  // The third loss came while the fallback ran (before its end), and its end names three
  // spares: stage 2's replacement joined the same recovery.
  std::size_t third_loss = 0, fallback_end = 0;
  for (std::size_t i = 0; i < o.log.size(); ++i) {
    const auto& l = o.log[i];
    if (l.find("\"event\":\"worker_lost\"") != std::string::npos && number_field(l, "stage") == 2)
      third_loss = i;
    if (l.find("\"event\":\"recovery_end\"") != std::string::npos &&
        l.find("\"recovery\":\"durable\"") != std::string::npos && fallback_end == 0)
      fallback_end = i;
  }
  ASSERT_GT(third_loss, 0u) << lost;
  ASSERT_GT(fallback_end, 0u) << o.output;
  EXPECT_LT(third_loss, fallback_end) << "the survivor was killed after the fallback ended";
  const std::string& end = o.log[fallback_end];
  const auto spares = end.find("\"spares\":\"");
  ASSERT_NE(spares, std::string::npos) << end;
  const std::string list = end.substr(spares + 10, end.find('"', spares + 10) - spares - 10);
  EXPECT_EQ(std::count(list.begin(), list.end(), ','), 2) << end;
  fs::remove_all(dir);
}

// The restart intensity: stage 1 is killed, and stage 2, whose log its restore needs, hangs
// as the recovery starts, so the region grows to 1..2 and restarts once. With
// checkpoint.region_restarts = 0 that restart is past the intensity: the region escalates to
// the job, whose strategy with the durable tier is the whole job rolled back to disk,
// bit-exact.
TEST(durable_fallback, a_region_restarting_past_its_intensity_escalates_to_the_durable_tier) {
  const std::string dir = checkpoint_dir("escalate");
  background_launch j("escalate", job(dir,
                                      "--set checkpoint.region_restarts=0 "
                                      "--inject hang:stage=2,replica=0,during=recovery"));
  kill_after_durable_windows(j, 1, {1});
  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  const auto escalated = events(o, "region_escalated");
  ASSERT_EQ(escalated.size(), 1u) << o.output;
  EXPECT_EQ(number_field(*escalated[0], "first_stage"), 1) << *escalated[0];
  EXPECT_EQ(number_field(*escalated[0], "last_stage"), 2) << *escalated[0];
  EXPECT_EQ(number_field(*escalated[0], "restarts"), 1) << *escalated[0];
  EXPECT_NE(escalated[0]->find("\"to\":\"durable_rollback\""), std::string::npos);
  ASSERT_EQ(events(o, "durable_rollback").size(), 1u) << o.output;
  EXPECT_NE(o.output.find("past checkpoint.region_restarts = 0: falling back to the durable tier"),
            std::string::npos)
      << o.output;
  fs::remove_all(dir);
}

// Turned on for a policy without a durable tier, or off for dense-disk: refused up front.
// A role whose durable writes keep failing (engine.durable_fail_from: the last stage's, from
// window 3): the other stages keep the newest window written whole, the journal's newest,
// whatever checkpoint.keep says. (They pruned it by count, keeping only windows the failing
// role never wrote: no window was whole on disk any more, nothing to resume or roll back to.)
TEST(durable_fallback, a_role_whose_writes_fail_leaves_the_newest_whole_window_on_every_disk) {
  const std::string dir = checkpoint_dir("failing_role");
  const auto r = launch("failing_role", job(dir, "--set engine.durable_fail_from=3"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("stage 2 replica 0 did not write window"), std::string::npos) << r.output;
  std::string newest;  // the journal's newest window
  for (const auto& e : fs::directory_iterator(fs::path(dir) / "head")) {
    newest = std::max(newest, e.path().filename().string());
  }
  ASSERT_FALSE(newest.empty()) << r.output;
  for (int s = 0; s < 3; ++s) {
    const fs::path manifest =
        fs::path(dir) / fmt::format("stage-{}-replica-0", s) / newest / "MANIFEST";
    EXPECT_TRUE(fs::exists(manifest)) << manifest << ": the journal's newest window is gone";
  }
  fs::remove_all(dir);
}

TEST(durable_fallback, the_key_is_refused_where_it_cannot_apply) {
  for (const std::string bad :
       {"--set checkpoint.policy=pec --set checkpoint.durable=true",
        "--set checkpoint.policy=dense-memory --set checkpoint.durable=true",
        "--set checkpoint.policy=dense-disk --set checkpoint.durable=false",
        "--set checkpoint.durable=sometimes"}) {
    const auto r = run_moevement("launch " + tiny() + " --set cluster.spares=1 " + bad);
    EXPECT_NE(r.exit_code, 0) << bad;
    EXPECT_NE(r.output.find("checkpoint.durable"), std::string::npos) << bad << ": " << r.output;
  }
}

}  // namespace

namespace {

// The newest window of stage 0 replica 0 on disk (its id), or -1.
long newest_window(const std::string& dir) {
  long newest = -1;
  for (const auto& e : fs::directory_iterator(fs::path(dir) / "stage-0-replica-0")) {
    if (!fs::exists(e.path() / "MANIFEST")) continue;
    newest = std::max(newest, std::stol(e.path().filename().string().substr(7)));
  }
  return newest;
}

// Whether the head's journal (under the checkpoint.dir that `args` sets) holds the window of
// the newest durable_window event in `log`, whole (its manifest is written last); waits 30 s.
bool wait_for_journal(const std::string& args, const std::vector<std::string>& log) {
  const std::string key = "--set checkpoint.dir=";
  const auto at = args.find(key);
  if (at == std::string::npos) return false;
  const auto from = at + key.size();
  const fs::path dir = args.substr(from, args.find(' ', from) - from);
  double window = -1;
  for (const auto& l : log) {
    if (l.find("\"event\":\"durable_window\"") != std::string::npos) {
      window = number_field(l, "window");
    }
  }
  if (window < 0) return false;
  const fs::path manifest =
      dir / "head" / fmt::format("window-{:020}", std::uint64_t(window)) / "MANIFEST";
  for (int i = 0; i < 6000; ++i) {
    if (fs::exists(manifest)) return true;
    std::this_thread::sleep_for(5ms);
  }
  return false;
}

// Launches `args` with its `workers` workers and no end in sight, waits until `windows`
// durable windows are on disk, then SIGKILLs the head: its workers must stop on their own.
// `iterations` (in: the least a resume runs) becomes what a resume of it runs: a little past
// where the killed job was, if that is more (a loaded machine's job goes further before its
// windows reach the disk; tiny has no schedule that train.iterations would change).
void kill_head_after_durable_windows(const std::string& name, const std::string& args,
                                     std::size_t workers, int windows, std::string& iterations) {
  std::vector<pid_t> pids;
  {
    background_launch j(name, args + " --set train.iterations=100000000");
    pids = j.wait_for_workers(workers);
    ASSERT_EQ(pids.size(), workers) << j.output();
    const auto log = wait_for_durable_windows(j, windows);
    ASSERT_GE(count_events(log, "durable_window"), windows) << j.output();
    // The head journals a window on a thread of its own after the run log's event: the kill
    // waits for the newest one's manifest, so that the resume starts where the test expects.
    ASSERT_TRUE(wait_for_journal(args, log)) << j.output();
    ::kill(j.pid, SIGKILL);
    EXPECT_EQ(j.wait(std::chrono::seconds(30)), 128 + SIGKILL);
    long last = 0;
    for (const auto& l : lines_of(j.log)) {
      if (l.find("\"kind\":\"iteration\"") != std::string::npos) {
        last = std::max(last, long(number_field(l, "iteration")));
      }
    }
    iterations = std::to_string(std::max(std::stol(iterations), last + 20));
  }
  EXPECT_TRUE(all_gone(pids)) << "the workers outlived their head";
}

// `moevement launch --resume` (docs/recovery.md "Resuming a killed job"). The whole job is
// killed (the head with SIGKILL; its workers stop on their own), the newest window of stage 0
// is corrupted on disk, and the job is launched again with --resume: it starts from the
// newest window every stage verifies, replays to where the journal says training was, and ends
// with the uninterrupted run's state_hash. The same journal is then refused for a job with
// another seed, naming the setting. Copies of the killed job's directory resume at other
// layouts: pp 3 -> 2 ends with the same hash; dp 1 -> 2 at pp 2 and at pp 4 end alike.
TEST(resume, a_killed_job_resumes_from_disk_bit_exact) {
  // Longer than the other jobs: three durable windows must be on disk before the kill, and a
  // loaded machine's fsyncs fell behind 40 iterations.
  std::string its = resume_iterations;
  const std::string dir = checkpoint_dir("resume");
  ASSERT_NO_FATAL_FAILURE(
      kill_head_after_durable_windows("killed", job(dir, "--set cluster.spares=0"), 3, 3, its));
  const std::string longer = " --set train.iterations=" + its;
  // Copies for the resumes at other layouts below.
  for (const char* copy : {"-pp2", "-pp2dp2", "-pp4dp2", "-lost"}) {
    fs::copy(dir, dir + copy, fs::copy_options::recursive);
  }
  const long damaged = newest_window(dir);
  ASSERT_GE(damaged, 1);
  ASSERT_TRUE(flip_byte((fs::path(dir) / "stage-0-replica-0" /
                         fmt::format("window-{:020}", damaged) / "slot-000000.snap")
                            .string(),
                        64));
  const auto o = launch("resumed", job(dir, "--set cluster.spares=0" + longer) + " --resume");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(its));
  const auto* start = o.first("job_start");
  ASSERT_NE(start, nullptr) << o.output;
  const double target = number_field(*start, "resume_iteration");
  EXPECT_GT(target, 0) << *start;
  const auto rollbacks = events(o, "durable_rollback");
  ASSERT_EQ(rollbacks.size(), 1u) << o.output;
  EXPECT_LT(number_field(*rollbacks[0], "window"), damaged) << *rollbacks[0];
  EXPECT_EQ(number_field(*rollbacks[0], "target_iteration"), target) << *rollbacks[0];
  std::string reasons;
  for (const auto* l : events(o, "durable_rejected")) reasons += *l + "\n";
  EXPECT_NE(reasons.find("checksum mismatch"), std::string::npos) << reasons;
  const auto ends = events(o, "recovery_end");
  ASSERT_EQ(ends.size(), 1u) << o.output;
  EXPECT_NE(ends[0]->find("\"recovery\":\"resume\""), std::string::npos) << *ends[0];
  // Only the iterations after the resume ran again: none before the window's first.
  const auto first = std::find_if(o.log.begin(), o.log.end(), [](const std::string& l) {
    return l.find("\"kind\":\"iteration\"") != std::string::npos;
  });
  ASSERT_NE(first, o.log.end()) << o.output;
  EXPECT_EQ(number_field(*first, "iteration"), target);
  EXPECT_NE(o.output.find("resumed from window"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find(fmt::format("({} iterations, {} of them in this run: ", its,
                                      std::stol(its) - long(target))),
            std::string::npos)
      << o.output;
  EXPECT_NE(o.output.find(" (this run's)\n"), std::string::npos) << o.output;

  // A resume of the job, now finished, goes on from its last window on disk to its end again:
  // the same hash. Its stage 1 worker killed before training started there: the spare takes
  // its role and restores it from disk with the others.
  const auto again = launch("again", job(dir, "--set cluster.spares=1" + longer +
                                                  " --inject kill:stage=1,replica=0,during=start") +
                                         " --resume");
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(again.hash, reference(its));
  EXPECT_NE(again.output.find("before training started; spare worker 4 takes its role"),
            std::string::npos)
      << again.output;

  // Nor does one with fewer iterations than the journal's point: refused, saying which.
  const auto fewer =
      launch("fewer", job(dir, "--set cluster.spares=0 --set train.iterations=3") + " --resume");
  EXPECT_NE(fewer.exit_code, 0);
  EXPECT_NE(fewer.output.find("past train.iterations = 3"), std::string::npos) << fewer.output;
  // A checkpoint.dir that cannot be made is refused before anything starts (every window's
  // write failed, each with a notice, and the job ended well).
  const auto unwritable = launch("unwritable", job("/proc/moevement-nope"));
  EXPECT_NE(unwritable.exit_code, 0);
  EXPECT_NE(unwritable.output.find("checkpoint.dir = /proc/moevement-nope cannot be written"),
            std::string::npos)
      << unwritable.output;

  // A stage's files gone altogether: nothing to resume, and the roles that lack the window
  // are named.
  fs::remove_all(fs::path(dir + "-lost") / "stage-1-replica-0");
  auto journals = [&] {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(fs::path(dir + "-lost") / "head")) {
      names.insert(e.path().filename().string());
    }
    return names;
  };
  const auto before = journals();
  const auto lost = run_moevement(
      "launch " + job(dir + "-lost", "--set cluster.spares=0" + longer) + " --resume");
  EXPECT_EQ(lost.exit_code, 1) << lost.output;
  EXPECT_NE(lost.output.find("is missing or unverified at stage 1 replica 0 ("), std::string::npos)
      << lost.output;
  // It went back through the older journals, found none whole, and left every one.
  EXPECT_EQ(journals(), before) << lost.output;
  fs::remove_all(dir + "-lost");

  // The journal is this job's: a job with another seed may not resume from it.
  const auto other =
      run_moevement("launch " + job(dir, "--set train.seed=7" + longer) + " --resume");
  EXPECT_NE(other.exit_code, 0);
  EXPECT_NE(other.output.find("train.seed = 1; this config has 7"), std::string::npos)
      << other.output;
  // --dry-run reads the journal as the resume would: the same refusal, and the same job's
  // point named.
  const auto dry_other =
      run_moevement("launch " + job(dir, "--set train.seed=7" + longer) + " --resume --dry-run");
  EXPECT_NE(dry_other.exit_code, 0);
  EXPECT_NE(dry_other.output.find("train.seed = 1; this config has 7"), std::string::npos)
      << dry_other.output;
  const auto dry = run_moevement("launch " + job(dir, longer) + " --resume --dry-run");
  EXPECT_EQ(dry.exit_code, 0) << dry.output;
  EXPECT_NE(dry.output.find("dry run: --resume would go on from window"), std::string::npos)
      << dry.output;
  fs::remove_all(dir);

  // Another layout: operators are the unit of state. At pp = 2 the hash is the uninterrupted
  // run's; at dp = 2 the global batch changes from the resume on, and the same hash comes out
  // at pp = 2 and pp = 4.
  const auto pp2 = launch(
      "pp2",
      job(dir + "-pp2",
          "--set cluster.spares=0 --set parallel.pp=2 --set checkpoint.w_sparse=3" + longer) +
          " --resume");
  ASSERT_EQ(pp2.exit_code, 0) << pp2.output;
  EXPECT_EQ(pp2.hash, reference(its));
  EXPECT_NE(pp2.output.find("the windows are of pp=3 dp=1, this job runs pp=2 dp=1"),
            std::string::npos)
      << pp2.output;
  // The resume's own W (checkpoint.w_sparse = 3, the journal's windows were of 2) from the
  // first window after where training went on.
  EXPECT_NE(pp2.output.find("W_sparse 2 -> 3 from window"), std::string::npos) << pp2.output;
  // Every window begun after where training went on (first iteration past it) is of 3: a
  // boundary one window late would leave a window of 2 among them.
  const auto* resumed_at = pp2.first("job_start");
  ASSERT_NE(resumed_at, nullptr) << pp2.output;
  const double went_on_at = number_field(*resumed_at, "resume_iteration");
  std::vector<double> firsts;
  for (const auto* l : events(pp2, "window_persisted")) {
    if (number_field(*l, "first_iteration") > went_on_at) {
      firsts.push_back(number_field(*l, "first_iteration"));
    }
  }
  ASSERT_GE(firsts.size(), 3u) << pp2.output;
  for (std::size_t i = 1; i < firsts.size(); ++i) {
    EXPECT_EQ(firsts[i] - firsts[i - 1], 3) << "window " << i << "\n" << pp2.output;
  }
  std::string dp2_hash;
  for (const char* pp : {"2", "4"}) {
    const std::string where = dir + "-pp" + pp + "dp2";
    const auto o2 = launch(std::string("dp2-") + pp,
                           job(where, std::string("--set cluster.spares=0 --set parallel.dp=2 "
                                                  "--set parallel.pp=") +
                                          pp + longer) +
                               " --resume");
    ASSERT_EQ(o2.exit_code, 0) << o2.output;
    EXPECT_NE(o2.output.find("the global batch changes from 2 to 4 micro-batches"),
              std::string::npos)
        << o2.output;
    ASSERT_FALSE(o2.hash.empty()) << o2.output;
    if (dp2_hash.empty()) dp2_hash = o2.hash;
    EXPECT_EQ(o2.hash, dp2_hash) << "pp " << pp;
    EXPECT_NE(o2.hash, reference(its));
    fs::remove_all(where);
  }
  fs::remove_all(dir + "-pp2");
}

// Replicas of a stage hold the same bits: where one replica's files are gone (what a replica
// fenced for silent corruption leaves behind), a resume restores that role from another
// replica's files, at the job's layout and at another (pp 2 -> 1), and ends with the
// uninterrupted run's hash. Before, it found no window every role verifies and stopped.
TEST(resume, a_replica_whose_files_are_gone_resumes_from_another_replicas) {
  std::string shape = " --set parallel.pp=2 --set parallel.dp=2 --set cluster.spares=0";
  const std::string dir = checkpoint_dir("replica_gone");
  std::string its = resume_iterations;
  ASSERT_NO_FATAL_FAILURE(
      kill_head_after_durable_windows("killed-dp2", job(dir, shape), 4, 3, its));
  shape += " --set train.iterations=" + its;
  const auto train = run_moevement("train " + tiny() + " --set train.seq_len=16 " + shape);
  ASSERT_EQ(train.exit_code, 0) << train.output;
  fs::copy(dir, dir + "-pp1", fs::copy_options::recursive);
  for (const auto& d : {dir, dir + "-pp1"}) fs::remove_all(fs::path(d) / "stage-1-replica-1");
  const auto same = launch("resumed-dp2", job(dir, shape) + " --resume");
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_EQ(same.hash, hash_of(train.output));
  EXPECT_NE(same.output.find("stage 1 replica 1 restores from replica 0's files"),
            std::string::npos)
      << same.output;
  const auto other =
      launch("resumed-pp1", job(dir + "-pp1", shape + " --set parallel.pp=1") + " --resume");
  ASSERT_EQ(other.exit_code, 0) << other.output;
  EXPECT_EQ(other.hash, hash_of(train.output));
  EXPECT_NE(other.output.find("from replica 0's files"), std::string::npos) << other.output;
  fs::remove_all(dir);
  fs::remove_all(dir + "-pp1");
}

// A job of one worker and no spare: no other worker can hold a copy of its snapshots, so its
// windows are whole with its own (they used to wait for copies that never came: a 10 s stall,
// no window ever on disk, and nothing to resume from). They reach the disk, and a kill of the
// whole job resumes bit-exact.
TEST(resume, a_job_of_one_worker_checkpoints_to_disk_and_resumes) {
  std::string its = resume_iterations;
  const std::string dir = checkpoint_dir("one_worker");
  const std::string one = "--set parallel.pp=1 --set cluster.spares=0";
  ASSERT_NO_FATAL_FAILURE(kill_head_after_durable_windows("one", job(dir, one), 1, 2, its));
  const auto o =
      launch("one-resumed", job(dir, one + " --set train.iterations=" + its) + " --resume");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(its));
  EXPECT_NE(o.output.find("resumed from window"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("a snapshot has no copy here"), std::string::npos) << o.output;
  EXPECT_EQ(o.output.find("captured nothing of a window"), std::string::npos) << o.output;
  // Resumed again once it ended: nothing to run, the end's hash said (it ran the last
  // iterations again before).
  const auto again = run_moevement("launch " + job(dir, one + " --set train.iterations=" + its) +
                                   " --resume --set engine.run_log=" + log_path("one-resumed"));
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("the job already ended"), std::string::npos) << again.output;
  EXPECT_EQ(hash_of(again.output), o.hash) << again.output;
  // Another job's config is refused as by any resume, not answered with this job's hash.
  const auto other =
      run_moevement("launch " + job(dir, one + " --set train.iterations=" + its) +
                    " --resume --set train.seed=5 --set engine.run_log=" + log_path("one-resumed"));
  EXPECT_NE(other.exit_code, 0) << other.output;
  EXPECT_NE(other.output.find("train.seed = 1; this config has 5"), std::string::npos)
      << other.output;
  EXPECT_TRUE(hash_of(other.output).empty()) << other.output;
  // The same job launched without --resume starts anew, saying what it removes: every stage
  // replica's windows, of roles this layout has or not.
  fs::create_directories(dir + "/stage-3-replica-1/window-00000000000000000001");
  const auto anew = launch("one-anew", job(dir, one + " --set train.iterations=4"));
  ASSERT_EQ(anew.exit_code, 0) << anew.output;
  EXPECT_NE(anew.output.find("held an earlier run's durable windows: this launch starts the job "
                             "anew and removes them"),
            std::string::npos)
      << anew.output;
  EXPECT_FALSE(fs::exists(dir + "/stage-3-replica-1")) << "another layout's windows stayed";
  fs::remove_all(dir);
}

// A resume at another layout journals its windows from its first on, its journals listing
// only them. Stopped (SIGUSR1) soon after, with every window of the new layout then damaged on
// disk, the next resume finds none of the newest journal's windows whole and goes back to the
// journals before it, down to the old layout's, and ends bit-exact. Before, "nothing to
// resume". (checkpoint.keep 8: a stage directory keeps keep + 1 windows of any layout, so
// that the new layout's writes do not prune the old one's before the resume.)
TEST(resume, damaged_windows_at_a_new_layout_go_back_to_the_journal_before) {
  std::string its = resume_iterations;
  const std::string dir = checkpoint_dir("relayout");
  ASSERT_NO_FATAL_FAILURE(kill_head_after_durable_windows(
      "relayout_killed", job(dir, "--set cluster.spares=0 --set checkpoint.keep=8"), 3, 2, its));
  const std::string pp2 = "--set cluster.spares=0 --set checkpoint.keep=8 --set parallel.pp=2";
  long old_newest = -1;
  {
    background_launch j("relayout_usr1",
                        job(dir, pp2 + " --set train.iterations=100000000") + " --resume");
    ASSERT_EQ(j.wait_for_workers(2).size(), 2u) << j.output();
    ::kill(j.pid, SIGUSR1);
    ASSERT_EQ(j.wait(std::chrono::seconds(60)), 75) << j.output();
    const std::string out = j.output();
    const std::string newest = "the journal's newest window is ";
    const auto at = out.find(newest);
    ASSERT_NE(at, std::string::npos) << out;
    old_newest = std::atol(out.c_str() + at + newest.size());
    const std::string goes_on = "goes on from iteration ";
    const auto from = out.find(goes_on, at);
    ASSERT_NE(from, std::string::npos) << out;
    its = std::to_string(
        std::max(std::stol(its), std::atol(out.c_str() + from + goes_on.size()) + 20));
  }
  int damaged = 0;
  for (const auto& e : fs::directory_iterator(fs::path(dir) / "stage-1-replica-0")) {
    const std::string name = e.path().filename().string();
    if (std::stol(name.substr(7)) <= old_newest) continue;  // the old layout's
    ASSERT_TRUE(flip_byte(e.path() / "slot-000000.snap", 64)) << e.path();
    ++damaged;
  }
  ASSERT_GT(damaged, 0);
  const auto o =
      launch("relayout_resumed", job(dir, pp2 + " --set train.iterations=" + its) + " --resume");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(its));
  EXPECT_NE(o.output.find("going back to the journal before it"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("resuming at another layout"), std::string::npos) << o.output;
  EXPECT_GE(count_events(o.log, "resume_instead"), 1) << o.output;
  fs::remove_all(dir);
}

// SIGUSR1 (what Slurm sends before a time limit, `sbatch --signal`) stops the job once its next
// durable window is journaled, with status 75 and the command that goes on; --resume then
// ends with the uninterrupted run's hash. The durable writes are paced to one window a run
// here: the stop's window is written whatever the pace.
TEST(resume, sigusr1_stops_at_the_next_window_on_disk_and_the_resume_is_bit_exact) {
  const std::string dir = checkpoint_dir("usr1");
  std::string its = resume_iterations;
  {
    // No end in sight: the stop's window must come before the job's end however slow the disk.
    background_launch j(
        "usr1", job(dir, "--set cluster.spares=0 --set train.iterations=100000000", "0.000000001"));
    ASSERT_EQ(j.wait_for_workers(3).size(), 3u) << j.output();
    ASSERT_TRUE(wait_for_event(j, "durable_window")) << j.output();
    ::kill(j.pid, SIGUSR1);
    EXPECT_EQ(j.wait(std::chrono::seconds(60)), 75) << j.output();
    const std::string out = j.output();
    EXPECT_NE(out.find("SIGUSR1: stopping once the next durable window is on disk"),
              std::string::npos)
        << out;
    const std::string goes_on = "`moevement launch CONFIG --resume` goes on from iteration ";
    const auto at = out.find(goes_on);
    ASSERT_NE(at, std::string::npos) << out;
    its =
        std::to_string(std::max(std::stol(its), std::atol(out.c_str() + at + goes_on.size()) + 20));
    EXPECT_EQ(count_events(lines_of(j.log), "durable_rollback"), 0) << out;
    // A stop on purpose, not a failure (a report or a tool reading the log tells them apart),
    // its iterations where the resume goes on, its ETTR measured.
    EXPECT_EQ(count_events(lines_of(j.log), "job_stopped"), 1) << out;
    for (const auto& l : lines_of(j.log)) {
      if (l.find("\"event\":\"job_stopped\"") == std::string::npos) continue;
      EXPECT_EQ(number_field(l, "iterations"), std::atof(out.c_str() + at + goes_on.size())) << l;
      EXPECT_GT(number_field(l, "ettr"), 0) << l;
    }
    EXPECT_EQ(count_events(lines_of(j.log), "job_failed"), 0) << out;
  }
  const auto o =
      launch("usr1-resumed",
             job(dir, "--set cluster.spares=0 --set train.iterations=" + its) + " --resume");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(its));
  EXPECT_NE(o.output.find("resumed from window"), std::string::npos) << o.output;
  fs::remove_all(dir);
}

// checkpoint.durable_share: after the first window on disk, the next waits until the writes'
// CPU is that share of the cores' time since; a share no tiny run reaches writes one window
// while every window persists in memory.
TEST(durable_fallback, durable_writes_are_paced_by_their_share_of_the_cores) {
  const std::string dir = checkpoint_dir("paced");
  const auto o = launch("paced", job(dir, "", "0.000000001"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  const auto written = events(o, "durable_window");
  ASSERT_EQ(written.size(), 1u) << o.output;
  const std::size_t at = written[0]->find("\"next_after_s\":");
  ASSERT_NE(at, std::string::npos) << *written[0];
  // the writers' CPU over a billionth of the cores: far past the run's end
  EXPECT_GT(std::strtod(written[0]->c_str() + at + 15, nullptr), 10.0) << *written[0];
  EXPECT_GE(events(o, "window_persisted").size(), 5u) << o.output;
  fs::remove_all(dir);
}

// After a recovery the next window goes to disk unpaced: the rebuilt stage's state is on
// disk soon, whatever the pace.
TEST(durable_fallback, the_first_window_after_a_recovery_is_written_whatever_the_pace) {
  const std::string dir = checkpoint_dir("paced_recovery");
  const auto o =
      launch("paced_recovery", job(dir, "--inject kill:stage=1,replica=0,iter=20", "0.000000001"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference());
  ASSERT_NE(o.first("recovery_end"), nullptr) << o.output;
  // The one after the recovery, paced or not; before it at most the first (a write still in
  // flight when the stage was lost is dropped by the recovery, never answered).
  int before = 0, after = 0;
  bool recovered = false;
  for (const auto& l : o.log) {
    recovered = recovered || l.find("\"event\":\"recovery_end\"") != std::string::npos;
    if (l.find("\"event\":\"durable_window\"") != std::string::npos) ++(recovered ? after : before);
  }
  EXPECT_LE(before, 1) << o.output;
  EXPECT_EQ(after, 1) << o.output;
  fs::remove_all(dir);
}

// What cannot be resumed says why, before any worker starts.
TEST(resume, nothing_to_resume_is_refused_saying_why) {
  const std::string dir = checkpoint_dir("nothing");
  auto r = run_moevement("launch " + job(dir) + " --resume");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("nothing to resume"), std::string::npos) << r.output;
  r = run_moevement("launch " + tiny() + " --set checkpoint.policy=dense-memory --resume");
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("--resume needs the durable tier of policy moevement"), std::string::npos)
      << r.output;
  fs::remove_all(dir);
}

}  // namespace

namespace {

// Expert parallelism: each worker's windows hold its own block of experts; the resumed job
// rebuilds every stage replica from them (each worker replaying its stage's group with its EP
// groups' rows exchanged in that process) and ends with the uninterrupted run's hash.
// Under expert parallelism each replica's files hold its block of experts. The same layout
// resumes bit-exact; so do other EP degrees and pipeline depths (the old EP groups compute
// each other's rows in the replay, and each new stage takes every expert from the replica
// that held it): ep 2 -> 1 at pp 1, and a job written at ep 1 resumed at ep 2.
TEST(resume, a_killed_expert_parallel_job_resumes_bit_exact) {
  const std::string dir = checkpoint_dir("resume_ep");
  const std::string layout = "--set cluster.spares=0 --set parallel.pp=2 --set parallel.dp=2";
  // Both killed jobs' resumes run as many iterations: the more either needs.
  std::string its = "60";
  ASSERT_NO_FATAL_FAILURE(kill_head_after_durable_windows(
      "killed_ep", job(dir, layout + " --set parallel.ep=2"), 4, 2, its));
  const std::string from_ep1 = checkpoint_dir("resume_to_ep2");
  ASSERT_NO_FATAL_FAILURE(
      kill_head_after_durable_windows("killed_ep1", job(from_ep1, layout), 4, 2, its));
  const std::string set = layout + " --set train.iterations=" + its;
  fs::copy(dir, dir + "-ep1", fs::copy_options::recursive);
  const auto o = launch("resumed_ep", job(dir, set + " --set parallel.ep=2") + " --resume");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  const auto t = run_moevement("train " + tiny() + " --set train.iterations=" + its +
                               " --set train.seq_len=16 --set parallel.dp=2");
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_EQ(o.hash, hash_of(t.output));
  fs::remove_all(dir);

  const auto ep1 = launch("resumed_ep1",
                          job(dir + "-ep1", "--set cluster.spares=0 --set train.iterations=" + its +
                                                " --set parallel.pp=1 --set parallel.dp=2") +
                              " --resume");
  ASSERT_EQ(ep1.exit_code, 0) << ep1.output;
  EXPECT_NE(ep1.output.find("the windows are of pp=2 dp=2 ep=2, this job runs pp=1 dp=2"),
            std::string::npos)
      << ep1.output;
  EXPECT_EQ(ep1.hash, hash_of(t.output));
  fs::remove_all(dir + "-ep1");

  const auto ep2 = launch("resumed_ep2", job(from_ep1, set + " --set parallel.ep=2") + " --resume");
  ASSERT_EQ(ep2.exit_code, 0) << ep2.output;
  EXPECT_NE(ep2.output.find("this job runs pp=2 dp=2 ep=2"), std::string::npos) << ep2.output;
  EXPECT_EQ(ep2.hash, hash_of(t.output));
  fs::remove_all(from_ep1);
}

}  // namespace
