// Silent data corruption under `moevement launch` (docs/recovery.md "Silent data corruption"),
// end to end with real processes: a worker flips one bit of its master weights after a step
// (--inject flip:...), the head finds its replica's digests differ from the other replicas',
// the majority names it, its worker is fenced and the stage rebuilt on a spare from a trusted
// replica's snapshot copies, and the job ends with the fault-free state_hash.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace {

using namespace moevement::test_support;

std::string tiny() {
  return source_path("examples/configs/tiny.toml");
}

constexpr int iterations = 16;

std::string shape(int pp, int dp, int ep) {
  return tiny() + " --set train.iterations=" + std::to_string(iterations) +
         " --set train.seq_len=16 --set parallel.pp=" + std::to_string(pp) +
         " --set parallel.dp=" + std::to_string(dp) + " --set parallel.ep=" + std::to_string(ep);
}

std::string job(int pp, int dp, int ep, const std::string& extra) {
  return shape(pp, dp, ep) +
         " --set checkpoint.policy=moevement --set checkpoint.w_sparse=2 --set cluster.spares=1 "
         "--set cluster.failure_timeout_ms=3000 --set checkpoint.durable_share=0 " +
         extra;
}

// The fault-free hash (`moevement train` emulates dp in one process; placement changes no bit).
std::string reference(int dp) {
  static std::map<int, std::string> cache;
  if (!cache.contains(dp)) {
    const auto r = run_moevement("train " + shape(1, dp, 1));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    cache[dp] = hash_of(r.output);
  }
  return cache[dp];
}

std::string field(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":\"");
  if (at == std::string::npos) return "";
  return line.substr(at + key.size() + 4,
                     line.find('"', at + key.size() + 4) - at - key.size() - 4);
}

// The judged replica was fenced and rebuilt, and nobody else was lost.
void expect_replaced(const launch_outcome& o, int stage, int replica, const char* digest, double at,
                     const char* how = "majority") {
  const std::string* suspected = o.first("sdc_suspected");
  ASSERT_NE(suspected, nullptr) << o.output;
  EXPECT_EQ(field(*suspected, "digest"), digest) << *suspected;
  EXPECT_EQ(number_field(*suspected, "iteration"), at) << *suspected;
  EXPECT_EQ(number_field(*suspected, "stage"), stage);
  const std::string* judged = o.first("sdc_judged");
  ASSERT_NE(judged, nullptr) << o.output;
  EXPECT_EQ(field(*judged, "how"), how);
  EXPECT_EQ(number_field(*judged, "stage"), stage);
  EXPECT_EQ(number_field(*judged, "replica"), replica);
  EXPECT_GE(number_field(*judged, "copies_from"), 0);
  EXPECT_NE(number_field(*judged, "copies_from"), replica);
  ASSERT_EQ(o.count("worker_lost"), 1) << o.output;
  const std::string* lost = o.first("worker_lost");
  EXPECT_EQ(number_field(*lost, "node"), number_field(*judged, "node"));
  EXPECT_NE(lost->find("fenced for silent data corruption"), std::string::npos) << *lost;
  EXPECT_EQ(o.count("recovery_end"), 1) << o.output;
  EXPECT_NE(o.output.find("holds corrupted state after iteration"), std::string::npos) << o.output;
  const std::string* end = o.first("job_end");
  ASSERT_NE(end, nullptr) << o.output;
  EXPECT_EQ(number_field(*end, "sdc_fenced"), 1) << *end;
}

// A bit the 2-byte compute weights keep (the default, bit 22) differs in them after the next
// step: found by that step's weights check, before the next forward reads them.
// The fenced replica's windows on disk go with it: a later restore from disk (a resume) takes
// another replica's files for any window it wrote.
TEST(silent_corruption, a_flipped_weight_is_found_at_the_next_step_and_replaced_bit_exact) {
  const auto dir = std::filesystem::path(::testing::TempDir()) /
                   ("sdc_" + std::to_string(::getpid()) + "_flip_dp3");
  std::filesystem::remove_all(dir);
  const auto o =
      launch("flip_dp3", job(2, 3, 1,
                             "--set checkpoint.w_sparse=4 --set checkpoint.dir=" + dir.string() +
                                 " --inject flip:stage=1,replica=2,iter=6"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(3));
  expect_replaced(o, 1, 2, "weights", 7);
  int windows = 0;
  for (const auto& w : std::filesystem::directory_iterator(dir / "stage-1-replica-2")) {
    std::ifstream meta(w.path() / "window.meta");
    std::string line;
    while (std::getline(meta, line)) {
      if (!line.starts_with("first_iteration ")) continue;
      ++windows;
      EXPECT_GT(std::stoll(line.substr(16)), 7) << "a window the fenced replica wrote is kept";
    }
  }
  EXPECT_GT(windows, 0) << "the replacement wrote no window of its own";
  std::filesystem::remove_all(dir);
}

// A low bit the compute weights round away is found by the whole-state check
// (checkpoint.verify_every), within verify_every iterations.
TEST(silent_corruption, a_bit_only_the_master_holds_is_found_by_the_state_check) {
  const auto o = launch(
      "flip_low_bit", job(2, 3, 1,
                          "--set checkpoint.verify_every=4 --inject "
                          "flip:stage=0,replica=0,iter=5,operator=layer0.attention,word=3,bit=2"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(3));
  expect_replaced(o, 0, 0, "state", 8);
  // Every iteration checked the compute weights, every fourth the whole state.
  int state = 0, weights = 0;
  for (const auto& l : o.log) {
    if (l.find("\"kind\":\"iteration\"") == std::string::npos) continue;
    state += field(l, "verified") == "state";
    weights += field(l, "verified") == "weights";
  }
  EXPECT_EQ(state, 5) << "iterations 0, 4, 8, 12 and the last";
  EXPECT_EQ(weights, iterations - 5);
}

// A flip after the last step: that step's whole-state check finds it (no later step would),
// the replica is replaced and the job ends with the fault-free hash (before, it ended with
// the flipped replica's).
TEST(silent_corruption, a_flip_after_the_last_step_is_found_before_the_job_ends) {
  const auto o = launch(
      "flip_last",
      job(2, 3, 1, "--inject flip:stage=1,replica=0,iter=" + std::to_string(iterations - 1)));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(3));
  expect_replaced(o, 1, 0, "state", iterations - 1);
}

// Expert parallelism: an expert is compared among the replicas holding its shard (dp 6, ep 2:
// three copies of each), and its rebuild takes a copy of the same shard.
TEST(silent_corruption, a_flipped_expert_is_judged_within_its_shard) {
  const auto o = launch("flip_ep", job(1, 6, 2,
                                       "--inject flip:stage=0,replica=3,iter=6,operator=layer1."
                                       "expert2,bit=20"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(6));
  expect_replaced(o, 0, 3, "weights", 7);
  const std::string* suspected = o.first("sdc_suspected");
  EXPECT_EQ(field(*suspected, "replicas"), "1,3,5") << *suspected;
  EXPECT_EQ(int(number_field(*o.first("sdc_judged"), "copies_from")) % 2, 1);
}

// Two copies: no majority. An idle spare replays the stage's group from the persisted window
// (whose copies agree: the flip came after it) and the copy that differs from the replay is
// the bad one; it is fenced and rebuilt like the majority's.
TEST(silent_corruption, two_copies_are_judged_by_a_replay_on_a_spare) {
  const auto o = launch("flip_dp2", job(2, 2, 1, "--inject flip:stage=1,replica=1,iter=9"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  expect_replaced(o, 1, 1, "weights", 10, "replay");
  const std::string* replayed = o.first("sdc_replayed");
  ASSERT_NE(replayed, nullptr) << o.output;
  EXPECT_EQ(field(*replayed, "agrees_with"), "0") << *replayed;
  EXPECT_NE(o.output.find("judging stage 1 by replay"), std::string::npos) << o.output;
  // The judge stayed a spare: the replacement came from the spare pool all the same.
  EXPECT_EQ(number_field(*o.first("sdc_replayed"), "spare"),
            number_field(*o.first("recovery_start"), "spare_node"));
}

// A replica whose worker dies while the judge runs (here the healthy one): the copy still
// there is judged against the replay, fenced, and both are rebuilt, bit-exact. Before, the
// judge's read of the dead replica ended the job.
TEST(silent_corruption, a_replica_lost_while_its_stage_is_judged_leaves_the_other_judged) {
  const auto o = launch("flip_dp2_lost", job(2, 2, 1,
                                             "--set cluster.spares=2 --set checkpoint.w_sparse=5 "
                                             "--inject flip:stage=1,replica=0,iter=10 "
                                             "--inject kill:stage=1,replica=1,iter=12"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  const std::string* judged = o.first("sdc_judged");
  ASSERT_NE(judged, nullptr) << o.output;
  EXPECT_EQ(number_field(*judged, "replica"), 0) << *judged;
  EXPECT_EQ(field(*judged, "how"), "replay") << *judged;
}

// A judge trusts only a window whose copies agree: a low bit flipped at iteration 1 and found
// by the state check at 8 (W 1: every window since holds the flipped operator's full state)
// leaves no such window, and the job stops saying so rather than train on either copy.
TEST(silent_corruption, a_judge_with_no_window_to_trust_stops_the_job_saying_why) {
  const auto o = launch("flip_untrusted",
                        job(2, 2, 1,
                            "--set checkpoint.w_sparse=1 --set checkpoint.verify_every=8 --inject "
                            "flip:stage=0,replica=1,iter=1,operator=layer0.attention,bit=3"));
  EXPECT_NE(o.exit_code, 0);
  EXPECT_TRUE(o.hash.empty()) << o.output;
  EXPECT_NE(o.output.find("could take either side"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("the job stops here rather than train on either copy"), std::string::npos)
      << o.output;
  EXPECT_EQ(o.count("sdc_judged"), 0) << o.output;
}

// A bit flipped in a replicator's copy of a snapshot slot: the restore that pulls it checks
// its checksum, refuses it and takes the other copy, bit-exact. Slot 0 of two windows in a row
// is flipped at its first holder (the one a restore asks first), so whichever of them is the
// persisted one when the stage is killed, the restore meets a bad copy.
TEST(silent_corruption, a_corrupt_snapshot_copy_is_refused_and_the_other_one_used) {
  const auto o = launch("flip_slot", shape(2, 1, 1) +
                                         " --set checkpoint.policy=moevement --set "
                                         "checkpoint.w_sparse=2 --set cluster.spares=1 --set "
                                         "checkpoint.share_memory=false --set "
                                         "cluster.failure_timeout_ms=3000 "
                                         "--inject flip:stage=1,replica=0,iter=6,target=slot "
                                         "--inject flip:stage=1,replica=0,iter=8,target=slot "
                                         "--inject kill:stage=1,replica=0,iter=10");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const std::string* end = o.first("recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  EXPECT_EQ(number_field(*end, "copies_refused"), 1) << *end;
  EXPECT_NE(o.output.find("is refused (snapshot checksum mismatch"), std::string::npos) << o.output;
}

// A rollback past the corruption: the run log's durable_rollback went back to a window every
// capture of which came before iteration `before` and trained on from `before`.
void expect_rolled_back_before(const launch_outcome& o, double before) {
  const std::string* back = o.first("durable_rollback");
  ASSERT_NE(back, nullptr) << o.output;
  EXPECT_EQ(number_field(*back, "clean_before"), before) << *back;
  EXPECT_EQ(number_field(*back, "target_iteration"), before) << *back;
  // W 2: the window's captures are after the steps of first - 1 and first.
  EXPECT_LT(number_field(*back, "first_iteration"), before) << *back;
  EXPECT_NE(o.output.find("the whole job rolls back to the newest durable window captured "
                          "before iteration " +
                          std::to_string(int(before))),
            std::string::npos)
      << o.output;
}

// One copy (dp = 1): a shadow replay on a spare (checkpoint.shadow_every) compares each stage
// in turn with its replay. Fault-free every check agrees and changes nothing. A flipped bit is
// found at its stage's next check; what the stage sent since may have spread everywhere, so
// its worker is fenced and the whole job rolls back to a durable window captured before the
// replayed window's first iteration (the flip came after it), and trains on from there:
// the fault-free hash. Without the durable tier the job stops, naming the stage.
TEST(silent_corruption, with_one_copy_a_shadow_replay_finds_a_flip_and_the_job_rolls_back) {
  const std::string base = job(2, 1, 1, "--set checkpoint.shadow_every=4");
  const auto clean = launch("shadow_clean", base);
  ASSERT_EQ(clean.exit_code, 0) << clean.output;
  EXPECT_EQ(clean.hash, reference(1));
  const auto checks = clean.events("shadow_checked");
  ASSERT_EQ(checks.size(), 4u) << "after iterations 3, 7, 11 and 15\n" << clean.output;
  for (std::size_t k = 0; k < checks.size(); ++k) {
    EXPECT_NE(checks[k]->find("\"agrees\":true"), std::string::npos) << *checks[k];
    EXPECT_EQ(number_field(*checks[k], "stage"), double(k % 2)) << "each stage in turn";
  }
  const std::string flip = " --inject flip:stage=1,replica=0,iter=5";
  const auto o = launch("shadow_flip", base + flip);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  EXPECT_NE(o.output.find("found by a shadow replay after iteration 7: stage 1"), std::string::npos)
      << o.output;
  const std::string* suspected = o.first("sdc_suspected");
  ASSERT_NE(suspected, nullptr) << o.output;
  EXPECT_EQ(field(*suspected, "digest"), "shadow");
  // The flipped operator among them; by the check (two steps on) the others differ too: the
  // flipped weights were read by a forward, and its gradients reached the whole stage.
  EXPECT_TRUE(field(*suspected, "operator_name").starts_with("layer2.norm1,")) << *suspected;
  // Found from the window of iterations 5..6 (W 2): the flip came after its first capture.
  expect_rolled_back_before(o, number_field(*suspected, "clean_before"));
  EXPECT_EQ(number_field(*suspected, "clean_before"), 5) << *suspected;
  const std::string* judged = o.first("sdc_judged");
  ASSERT_NE(judged, nullptr) << o.output;
  EXPECT_EQ(field(*judged, "how"), "shadow");
  ASSERT_EQ(o.count("worker_lost"), 1) << o.output;
  EXPECT_NE(o.first("worker_lost")->find("fenced for silent data corruption"), std::string::npos);
  EXPECT_EQ(number_field(*o.first("job_end"), "sdc_fenced"), 1);

  const auto stopped =
      launch("shadow_flip_no_disk", base + flip + " --set checkpoint.durable=false");
  EXPECT_NE(stopped.exit_code, 0);
  EXPECT_TRUE(stopped.hash.empty()) << stopped.output;
  EXPECT_NE(stopped.output.find("so the job stops here rather than train on: no durable window "
                                "captured before iteration 5"),
            std::string::npos)
      << stopped.output;
}

// A flip the persisted window already captured: a replay from that window would carry it and
// agree (checkpoint.shadow_coverage "recent": this job ended with a wrong hash and no
// warning). With "full" each check replays from a window the previous round of checks vouched
// for (the first round from the job's start), so stage 1's check after iteration 23 replays
// from before the flip at 16 and finds it; a replay from the persisted window agrees, so every
// state before stage 1's last check that agreed (after 15) is clean, and the job rolls back
// before 16 (to a durable window kept on disk for it).
TEST(silent_corruption, a_flip_the_persisted_window_captured_is_found_from_a_vouched_one) {
  const auto o = launch("shadow_vouched", job(2, 1, 1,
                                              "--set checkpoint.shadow_every=4 "
                                              "--set checkpoint.shadow_coverage=full "
                                              "--set train.iterations=24 "
                                              "--inject flip:stage=1,replica=0,iter=16"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  const auto fault_free = run_moevement("train " + shape(1, 1, 1) + " --set train.iterations=24");
  ASSERT_EQ(fault_free.exit_code, 0) << fault_free.output;
  EXPECT_EQ(o.hash, hash_of(fault_free.output));
  const auto checks = o.events("shadow_checked");
  ASSERT_GE(checks.size(), 6u) << o.output;
  // The first round from the job's start; each later one from a window before its checks.
  EXPECT_EQ(number_field(*checks[0], "from"), 0) << *checks[0];
  EXPECT_EQ(number_field(*checks[1], "from"), 0) << *checks[1];
  for (std::size_t k = 0; k < 6; ++k) {
    EXPECT_NE(checks[k]->find("\"vouched\":true"), std::string::npos) << *checks[k];
    if (k >= 2) {  // (a window every capture of which precedes the round before)
      EXPECT_LE(number_field(*checks[k], "from"), number_field(*checks[k], "iteration") - 4);
    }
  }
  EXPECT_NE(checks[5]->find("\"agrees\":false"), std::string::npos) << *checks[5];
  EXPECT_LT(number_field(*checks[5], "from"), 16) << *checks[5];
  const std::string* suspected = o.first("sdc_suspected");
  ASSERT_NE(suspected, nullptr) << o.output;
  EXPECT_EQ(number_field(*suspected, "iteration"), 23) << *suspected;
  EXPECT_EQ(number_field(*suspected, "stage"), 1) << *suspected;
  EXPECT_EQ(number_field(*suspected, "clean_before"), 16) << *suspected;
  expect_rolled_back_before(o, 16);
}

// The rollback wrote the resume journal again for the window it went back to and dropped the
// journal's entries of the windows begun since (the timeline it left: a resume from one
// would go back to a window captured after the flip). The windows from then on are numbered
// past them. A job that ends soon after and is resumed ends with the fault-free hash. (The
// flip comes 40 iterations in, found by stage 0's shadow check after iteration 43: the
// rollback needs a durable window from before it whole on disk, and a loaded machine wrote
// the first ones too late for a flip at iteration 5.)
TEST(silent_corruption, a_job_resumed_after_a_rollback_goes_on_from_before_the_flip) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("sdc_resume_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::string base = job(2, 1, 1,
                               "--set checkpoint.shadow_every=4 --set checkpoint.w_sparse=8 "
                               "--set checkpoint.dir=" +
                                   dir.string());
  const auto cut = launch(
      "shadow_cut", base + " --set train.iterations=45 --inject flip:stage=0,replica=0,iter=41");
  ASSERT_EQ(cut.exit_code, 0) << cut.output;
  // The windows persisted before the rollback, and the one it went back to.
  double left = -1, back = -1;
  for (const auto& line : cut.log) {
    if (line.find("\"event\":\"durable_rollback\"") != std::string::npos) {
      back = number_field(line, "window");
      break;
    }
    if (line.find("\"event\":\"window_persisted\"") != std::string::npos) {
      left = std::max(left, number_field(line, "window"));
    }
  }
  ASSERT_GE(back, 0) << cut.output;
  ASSERT_GT(left, back) << cut.output;
  for (const auto& e : std::filesystem::directory_iterator(dir / "head")) {
    const double id = std::stod(e.path().filename().string().substr(std::string("window-").size()));
    EXPECT_FALSE(id > back && id <= left)
        << e.path() << ": a journal of the timeline the rollback left (windows " << back + 1 << ".."
        << left << ")";
  }
  const auto resumed = launch("shadow_resumed", base + " --set train.iterations=48 --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto fault_free = run_moevement("train " + shape(1, 1, 1) + " --set train.iterations=48");
  ASSERT_EQ(fault_free.exit_code, 0) << fault_free.output;
  EXPECT_EQ(resumed.hash, hash_of(fault_free.output));
  std::filesystem::remove_all(dir);
}

// The same job killed as soon as its rollback chose the window to go back to (its replay under
// way): the journals of the timeline left are gone already, so the --resume goes on from
// before the flip and ends with the fault-free hash. (They were dropped only at the recovery's
// end: the resume went on along the timeline left, its plans of corrupted gradients.)
TEST(silent_corruption, a_job_killed_during_its_rollback_resumes_from_before_the_flip) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("sdc_killed_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const std::string base = job(2, 1, 1,
                               "--set checkpoint.shadow_every=4 --set checkpoint.w_sparse=8 "
                               "--set checkpoint.dir=" +
                                   dir.string());
  double back = -1;
  {
    background_launch cut(
        "shadow_killed",
        base + " --set train.iterations=48 --inject flip:stage=0,replica=0,iter=41");
    for (int i = 0; i < 12000 && back < 0; ++i) {
      for (const auto& line : lines_of(cut.log)) {
        if (line.find("\"event\":\"durable_rollback\"") != std::string::npos) {
          back = number_field(line, "window");
        }
      }
      if (back < 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    ::kill(cut.pid, SIGKILL);  // its workers go with it
    ASSERT_GE(back, 0) << cut.output();
  }
  for (const auto& e : std::filesystem::directory_iterator(dir / "head")) {
    const double id = std::stod(e.path().filename().string().substr(std::string("window-").size()));
    EXPECT_LE(id, back) << e.path() << ": a journal of the timeline the rollback left";
  }
  const auto resumed =
      launch("shadow_killed_resumed", base + " --set train.iterations=48 --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto fault_free = run_moevement("train " + shape(1, 1, 1) + " --set train.iterations=48");
  ASSERT_EQ(fault_free.exit_code, 0) << fault_free.output;
  EXPECT_EQ(resumed.hash, hash_of(fault_free.output));
  std::filesystem::remove_all(dir);
}

// The rollback's window still being written when the corruption is found (every write held
// 1.5 s, as a loaded host starved the writers and this failed under load): every live worker
// finishes its durable writes before the bad one is fenced, which would take its own with it,
// and the job goes back to that window, bit-exact. Before, it stopped: "no durable window
// captured before iteration 33 is complete".
TEST(silent_corruption, a_rollback_waits_for_the_window_still_being_written) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / ("sdc_slow_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const auto o = launch("shadow_slow_disk",
                        job(2, 1, 1,
                            "--set checkpoint.shadow_every=4 --set checkpoint.w_sparse=8 "
                            "--set engine.durable_write_delay_ms=1500 --set train.iterations=45 "
                            "--set checkpoint.dir=" +
                                dir.string() + " --inject flip:stage=0,replica=0,iter=41"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  // (On a quiet host window 0, the only one written by then; a slower run gets further.)
  ASSERT_NE(o.first("durable_rollback"), nullptr) << o.output;
  const auto fault_free = run_moevement("train " + shape(1, 1, 1) + " --set train.iterations=45");
  ASSERT_EQ(fault_free.exit_code, 0) << fault_free.output;
  EXPECT_EQ(o.hash, hash_of(fault_free.output));
  std::filesystem::remove_all(dir);
}

// A miscomputed activation (flipped before it is logged and sent) leaves every replica in
// agreement: nothing to compare. A replay finds it: here a kill of the other replica makes
// the stage's group replay iteration 10, the survivor its own replica, each tensor it sends
// checked against what it logged then. What was sent has spread: the sender's worker is
// fenced and the whole job rolls back to a window captured before iteration 10. (Late in the
// run: a durable window before it must be whole on disk at the kill, and a loaded host writes
// the first ones slowly.)
TEST(silent_corruption, a_flipped_activation_is_found_at_a_replay_and_the_job_rolls_back) {
  const auto o =
      launch("flip_activation", job(2, 2, 1,
                                    "--set cluster.spares=2 "
                                    "--inject flip:stage=0,replica=1,iter=10,target=activation "
                                    "--inject kill:stage=0,replica=0,iter=11"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  EXPECT_NE(o.output.find("the replay of iteration 10 micro-batch 0 replica 1 sent other bits "
                          "than logged: silent data corruption"),
            std::string::npos)
      << o.output;
  const std::string* suspected = o.first("sdc_suspected");
  ASSERT_NE(suspected, nullptr) << o.output;
  EXPECT_EQ(field(*suspected, "digest"), "replay");
  EXPECT_EQ(number_field(*suspected, "stage"), 0);
  EXPECT_EQ(field(*suspected, "replicas"), "1");
  EXPECT_EQ(number_field(*suspected, "sent_in"), 10);
  const std::string* judged = o.first("sdc_judged");
  ASSERT_NE(judged, nullptr) << o.output;
  EXPECT_EQ(field(*judged, "how"), "replay_log");
  EXPECT_EQ(number_field(*judged, "stage"), 0);
  EXPECT_EQ(number_field(*judged, "replica"), 1);
  expect_rolled_back_before(o, 10);
  EXPECT_EQ(o.count("worker_lost"), 2) << "the kill and the fence\n" << o.output;
}

// Two copies that disagree where the judge trusts no window (the flip came before the
// persisted window's capture of that operator): every state before the last whole-state check
// that agreed (iteration 4) is clean, so the whole job rolls back to a window captured before
// it, every replica from its own files, no worker replaced.
TEST(silent_corruption, two_copies_no_verdict_roll_back_to_before_the_last_state_check) {
  const auto o = launch("flip_no_verdict",
                        job(2, 2, 1,
                            "--set checkpoint.verify_every=4 --inject "
                            "flip:stage=0,replica=1,iter=5,operator=layer0.attention,bit=3"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  EXPECT_NE(o.output.find("could take either side"), std::string::npos) << o.output;
  const std::string* judged = o.first("sdc_judged");
  ASSERT_NE(judged, nullptr) << o.output;
  EXPECT_EQ(field(*judged, "how"), "none");
  EXPECT_EQ(number_field(*judged, "clean_before"), 4);
  expect_rolled_back_before(o, 4);
  EXPECT_EQ(o.count("worker_lost"), 0) << o.output;
  EXPECT_NE(o.output.find("recovered in place on workers"), std::string::npos) << o.output;
}

// A job that cannot rebuild the bad replica stops, saying why, rather than train on it.
TEST(silent_corruption, a_policy_that_cannot_rebuild_stops_the_job_saying_why) {
  const auto o = launch("flip_none", shape(2, 3, 1) + " --inject flip:stage=1,replica=0,iter=3");
  EXPECT_NE(o.exit_code, 0);
  EXPECT_TRUE(o.hash.empty()) << o.output;
  EXPECT_NE(o.output.find("checkpoint.policy = none cannot rebuild it"), std::string::npos)
      << o.output;
  EXPECT_EQ(o.count("sdc_judged"), 1) << o.output;
}

// Checks off: the flip is refused before anything starts (it would go unseen).
TEST(silent_corruption, a_flip_that_would_go_unseen_is_refused) {
  // A snapshot copy flipped where there is no other copy (the owner's memory, mapped).
  const auto shared = run_moevement("launch " + job(2, 1, 1, "") +
                                    " --inject flip:stage=0,replica=0,iter=3,target=slot");
  EXPECT_NE(shared.exit_code, 0);
  EXPECT_NE(shared.output.find("checkpoint.share_memory = false"), std::string::npos)
      << shared.output;
  for (const std::string& extra :
       {std::string("--set parallel.dp=1"), std::string("--set checkpoint.verify_every=0")}) {
    const auto r =
        run_moevement("launch " + job(2, 3, 1, extra) + " --inject flip:stage=0,replica=0,iter=3");
    EXPECT_NE(r.exit_code, 0) << extra;
    EXPECT_NE(r.output.find("would go unseen"), std::string::npos) << extra << "\n" << r.output;
  }
}

}  // namespace
