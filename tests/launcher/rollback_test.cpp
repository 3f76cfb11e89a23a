// The baseline policies under `moevement launch`, end to end with real processes: a worker
// killed mid-run is replaced by a spare and the whole job rolls back to the newest checkpoint
// every stage can load. dense-memory and dense-disk end bit for bit as the fault-free run;
// pec restores stale experts and logs the tokens lost (PLT); a corrupt or truncated
// dense-disk file is rejected with its reason and the previous good checkpoint is used.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace {

namespace fs = std::filesystem;
using namespace moevement::test_support;

constexpr int iterations = 10;

std::string tiny() {
  return source_path("examples/configs/tiny.toml");
}

std::string common() {
  return " --set train.iterations=" + std::to_string(iterations) +
         " --set train.seq_len=16 --set train.val_batches=2";
}

std::string job(const std::string& policy, int pp, int dp, const std::string& extra) {
  return tiny() + common() + " --set parallel.pp=" + std::to_string(pp) +
         " --set parallel.dp=" + std::to_string(dp) + " --set checkpoint.policy=" + policy +
         " --set cluster.spares=1 " + extra;
}

// The fault-free hash of the same job (by `moevement train`, which launch equals).
std::string reference(int dp) {
  static std::map<int, std::string> cache;
  if (!cache.contains(dp)) {
    const auto r =
        run_moevement("train " + tiny() + common() + " --set parallel.dp=" + std::to_string(dp));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    cache[dp] = hash_of(r.output);
  }
  return cache[dp];
}

// A fresh directory for dense-disk, private to this test process.
std::string checkpoint_dir(const std::string& name) {
  const fs::path d =
      fs::path(::testing::TempDir()) / ("rollback_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(d);
  return d.string();
}

using outcome = launch_outcome;

const std::string* event(const outcome& o, const std::string& name) {
  return o.first(name);
}

// Kill (stage 1, replica 0) at iteration 7 with a checkpoint every 3 iterations: the job goes
// back to iteration 6 and recomputes it.
TEST(rollback, dense_memory_kill_rolls_back_bit_exact) {
  background_launch j("dm", job("dense-memory", 2, 2,
                                "--set checkpoint.interval=3 "
                                "--inject kill:stage=1,replica=1,iter=7"));
  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  const std::string* end = event(o, "recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  EXPECT_EQ(number_field(*end, "target_iteration"), 7);
  EXPECT_EQ(number_field(*end, "rollback_to"), 6);
  EXPECT_EQ(number_field(*end, "iterations_recomputed"), 1);
  EXPECT_NE(end->find("holder on worker"), std::string::npos)
      << "the replacement's copy came from a peer's memory: " << *end;
  EXPECT_NE(o.output.find("rolled back to iteration 6"), std::string::npos) << o.output;
}

// Expert parallelism: each worker's full snapshot holds its own block of experts; the rollback
// reloads every worker's own, in memory and on disk alike.
TEST(rollback, the_dense_baselines_roll_back_an_expert_parallel_job_bit_exact) {
  const std::string dir = checkpoint_dir("ep");
  for (const char* policy : {"dense-memory", "dense-disk"}) {
    background_launch j(std::string("ep_") + policy,
                        job(policy, 2, 2,
                            "--set parallel.ep=2 --set checkpoint.interval=3 "
                            "--set checkpoint.dir=" +
                                dir + " --inject kill:stage=1,replica=1,iter=7"));
    const auto o = finish(j);
    ASSERT_EQ(o.exit_code, 0) << policy << ": " << o.output;
    EXPECT_EQ(o.hash, reference(2)) << policy;
    const std::string* end = event(o, "recovery_end");
    ASSERT_NE(end, nullptr) << o.output;
    // dense-disk: the newest checkpoint every stage has on disk (written in the background, so
    // on a loaded machine one before, 3, or even none yet: seen once, 0); dense-memory: the
    // newest, 6.
    const int to = int(number_field(*end, "rollback_to"));
    EXPECT_TRUE(to == 6 || (std::string(policy) == "dense-disk" && (to == 3 || to == 0))) << *end;
  }
  fs::remove_all(dir);
}

// The demo's scale (small preset, 27 M parameters, pp 2 x dp 2 and a spare: five processes on
// the test machine's cores): each stage's copy of its initial state (165 MB) is made on the
// thread that built the stage. Made on the actor thread, it silenced the heartbeats of 1 to 3
// workers past the 1 s failure timeout before the first iteration (the job stopped, 3 of 3
// runs on two cores).
TEST(rollback, a_baseline_starts_at_the_demos_scale) {
  const auto o = launch("dm-demo", source_path("examples/configs/demo.toml") +
                                       " --set train.iterations=2 --set train.val_batches=0 "
                                       "--set checkpoint.policy=dense-memory --set "
                                       "cluster.spares=1");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash.size(), 16u) << o.output;
  EXPECT_EQ(o.events("worker_lost").size(), 0u) << o.output;
}

// dense-memory checkpoints go into memory the link allocated, which holders on this host read
// with one RMA get: the first ones start on the heap while the pool learns their size, then
// every one is lent (run log: snapshot_lent_bytes == snapshot_bytes).
TEST(rollback, dense_memory_checkpoints_end_up_in_lent_memory) {
  const auto o = launch("dm-lent", job("dense-memory", 3, 1, "--set checkpoint.interval=1"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  int checked = 0;
  for (const auto& l : o.log) {
    if (l.find("\"kind\":\"iteration\"") == std::string::npos) continue;
    const auto bytes = std::int64_t(number_field(l, "snapshot_bytes"));
    const auto lent = std::int64_t(number_field(l, "snapshot_lent_bytes"));
    EXPECT_LE(lent, bytes) << l;
    if (number_field(l, "iteration") >= iterations - 3) {
      EXPECT_GT(bytes, 0) << l;
      EXPECT_EQ(lent, bytes) << l;
      EXPECT_GT(number_field(l, "capture_cpu_s"), 0.0) << "the capture's CPU time: " << l;
      ++checked;
    }
  }
  EXPECT_EQ(checked, 3);
}

// A second loss during the rollback: a survivor (stage 2), or the spare being rebuilt as
// stage 1 itself. The rollback takes another spare for it, starts its loading over, and the
// job still ends bit for bit as the fault-free run. The first kill comes two iterations after
// checkpoint 6 was taken: with one, under load its copies were sometimes not all made yet when
// the second kill took a holder, and the job (rightly) went back to 3.
TEST(rollback, a_loss_during_the_rollback_adds_a_rebuild_and_starts_it_over) {
  for (const std::string second : {"stage=2,replica=0", "stage=1,replica=0"}) {
    background_launch j("during" + second.substr(6, 1),
                        job("dense-memory", 3, 1,
                            "--set checkpoint.interval=3 --set cluster.spares=2 "
                            "--set cluster.failure_timeout_ms=3000 "
                            "--inject kill:stage=1,replica=0,iter=8 --inject kill:" +
                                second + ",during=recovery"));
    const auto o = finish(j);
    ASSERT_EQ(o.exit_code, 0) << second << "\n" << o.output;
    EXPECT_EQ(o.hash, reference(1)) << second;
    int ends = 0;
    for (const auto& l : o.log) ends += l.find("\"event\":\"recovery_end\"") != std::string::npos;
    EXPECT_EQ(ends, 1) << "one rollback, restarted: " << second << "\n" << o.output;
    const std::string* end = event(o, "recovery_end");
    ASSERT_NE(end, nullptr) << o.output;
    // 6, the newest checkpoint; 3 where the second kill took a holder of a checkpoint-6 copy
    // not made yet (see above: the job then rightly goes back to the newest every stage has).
    const auto to = number_field(*end, "rollback_to");
    EXPECT_TRUE(to == 6 || to == 3) << *end;
    EXPECT_GE(number_field(*end, "restarts"), 1) << *end;
    if (second == "stage=2,replica=0") {
      EXPECT_NE(end->find("2/0@"), std::string::npos) << *end;
    }
    EXPECT_NE(end->find("1/0@"), std::string::npos) << *end;
  }
}

// Before the first checkpoint: every stage goes back to its initial state.
TEST(rollback, a_failure_before_any_checkpoint_restarts_from_the_initial_state) {
  background_launch j("early", job("dense-memory", 2, 1,
                                   "--set checkpoint.interval=4 "
                                   "--inject kill:stage=0,replica=0,iter=2"));
  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const std::string* end = event(o, "recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  EXPECT_EQ(number_field(*end, "rollback_to"), 0);
  EXPECT_EQ(number_field(*end, "iterations_recomputed"), 2);
  EXPECT_NE(end->find("the initial state"), std::string::npos) << *end;
}

TEST(rollback, dense_disk_kill_rolls_back_bit_exact) {
  const std::string dir = checkpoint_dir("dd");
  background_launch j("dd", job("dense-disk", 2, 1,
                                "--set checkpoint.interval=2 --set checkpoint.dir=" + dir +
                                    " --inject kill:stage=0,replica=0,iter=9"));
  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const std::string* end = event(o, "recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  // The newest window every stage has on disk: the persist runs in the background (CheckFreq
  // loses what is not on disk yet), at most three snapshots behind the newest (8).
  const int to = int(number_field(*end, "rollback_to"));
  EXPECT_TRUE(to == 8 || to == 6 || to == 4 || to == 2) << *end;
  EXPECT_EQ(number_field(*end, "iterations_recomputed"), 9 - to);
  EXPECT_NE(end->find("stage-0-replica-0 window " + std::to_string(to)), std::string::npos) << *end;
  EXPECT_TRUE(fs::is_directory(fs::path(dir) / "stage-0-replica-0"));
  fs::remove_all(dir);
}

TEST(rollback, pec_kill_restores_stale_experts_and_logs_plt) {
  background_launch j("pec", job("pec", 2, 1,
                                 "--set checkpoint.interval=2 --set checkpoint.pec_experts=1 "
                                 "--inject kill:stage=1,replica=0,iter=7"));
  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  const std::string* end = event(o, "recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  EXPECT_EQ(number_field(*end, "rollback_to"), 6);
  EXPECT_GT(number_field(*end, "stale_experts"), 0);
  EXPECT_GT(number_field(*end, "lost_tokens"), 0);
  EXPECT_GT(number_field(*end, "plt"), 0.0);
  EXPECT_LT(number_field(*end, "plt"), 1.0);
  EXPECT_GT(number_field(*end, "run_plt"), 0.0);
  EXPECT_NE(o.output.find("PLT"), std::string::npos) << o.output;
  // By design: the stale experts lost updates, so the run is not the fault-free one.
  EXPECT_NE(o.hash, "");
  EXPECT_NE(o.hash, reference(1));
}

// pec under expert parallelism: every EP rank selects over the layer's experts alike and saves
// the selected ones it holds, so the job's checkpoints, its rollback, the stale experts and the
// tokens they lost are those of ep = 1: the same state_hash and PLT at ep = 2 as at ep = 1.
TEST(rollback, pec_with_expert_parallelism_loses_what_it_loses_without) {
  std::vector<outcome> runs;
  for (const char* ep : {"1", "2"}) {
    background_launch j(std::string("pec_ep") + ep,
                        job("pec", 2, 2,
                            std::string("--set parallel.ep=") + ep +
                                " --set checkpoint.interval=2 --set checkpoint.pec_experts=1 "
                                "--inject kill:stage=1,replica=1,iter=7"));
    runs.push_back(finish(j));
    ASSERT_EQ(runs.back().exit_code, 0) << "ep " << ep << ": " << runs.back().output;
  }
  const std::string *one = event(runs[0], "recovery_end"), *two = event(runs[1], "recovery_end");
  ASSERT_NE(one, nullptr);
  ASSERT_NE(two, nullptr);
  ASSERT_EQ(number_field(*two, "rollback_to"), number_field(*one, "rollback_to")) << *two;
  EXPECT_GT(number_field(*one, "lost_tokens"), 0) << *one;
  for (const char* field : {"lost_tokens", "stale_experts", "plt", "run_plt"}) {
    EXPECT_EQ(number_field(*two, field), number_field(*one, field)) << field;
  }
  EXPECT_EQ(runs[1].hash, runs[0].hash);
  EXPECT_NE(runs[1].hash, reference(2));  // by design: stale experts lost updates
}

// The newest window of each stage is damaged (stage 1's flipped, stage 0's truncated) while
// stage 1 hangs: both are rejected with their reason and the job rolls back to the previous
// good checkpoint, still bit-exact. keep = 3: should the hung stage's newest persisted window
// be one older than the other's, the one before both damaged windows is still on disk.
TEST(rollback, corrupt_and_truncated_files_fall_back_to_the_previous_checkpoint) {
  const std::string dir = checkpoint_dir("corrupt");
  background_launch j("corrupt", job("dense-disk", 2, 1,
                                     "--set checkpoint.interval=2 --set checkpoint.keep=3 "
                                     "--set checkpoint.dir=" +
                                         dir +
                                         " --set cluster.failure_timeout_ms=3000 "
                                         "--inject hang:stage=1,replica=0,iter=9"));
  bool hung = false;
  for (int i = 0; i < 3000 && !hung; ++i) {
    hung = j.output().find("inject: hang") != std::string::npos;
    if (!hung) std::this_thread::sleep_for(20ms);
  }
  ASSERT_TRUE(hung) << j.output();
  // Let the running stage's persist in flight land (the hung one's is stopped with it): a
  // window is being written while its directory has no MANIFEST yet (written last).
  auto writing = [&](int stage) {
    for (const auto& e : fs::directory_iterator(
             fs::path(dir) / ("stage-" + std::to_string(stage) + "-replica-0"))) {
      if (!fs::exists(e.path() / "MANIFEST")) return true;
    }
    return false;
  };
  std::this_thread::sleep_for(500ms);
  for (int i = 0; i < 3000 && writing(0); ++i) std::this_thread::sleep_for(10ms);
  auto newest = [&](int stage) {
    fs::path best;
    for (const auto& e : fs::directory_iterator(
             fs::path(dir) / ("stage-" + std::to_string(stage) + "-replica-0"))) {
      if (fs::exists(e.path() / "MANIFEST") && e.path().filename() > best.filename()) {
        best = e.path();
      }
    }
    return best;
  };
  const fs::path w1 = newest(1), w0 = newest(0);
  ASSERT_FALSE(w1.empty());
  ASSERT_FALSE(w0.empty());
  ASSERT_TRUE(flip_byte(w1 / "snapshot", 100));
  fs::resize_file(w0 / "snapshot", fs::file_size(w0 / "snapshot") / 2);
  // Each stage's newest window is damaged: the newest both still have is 2 iterations older.
  const long damaged = std::min(std::stol(w1.filename().string().substr(7)),
                                std::stol(w0.filename().string().substr(7)));

  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const std::string* end = event(o, "recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  EXPECT_EQ(number_field(*end, "rollback_to"), damaged - 2);
  EXPECT_GE(number_field(*end, "rejected"), 2);
  std::string reasons;
  for (const auto& l : o.log) {
    if (l.find("checkpoint_rejected") != std::string::npos) reasons += l + "\n";
  }
  EXPECT_NE(reasons.find("checksum mismatch"), std::string::npos) << reasons;
  EXPECT_NE(reasons.find("truncated"), std::string::npos) << reasons;
  EXPECT_NE(o.output.find("checkpoint rejected"), std::string::npos) << o.output;
  fs::remove_all(dir);
}

}  // namespace
