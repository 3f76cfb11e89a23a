// Policy `moevement` under `moevement launch` through more than one failure: failures in turn,
// contiguous stages lost together (one region, the joint recovery), regions apart, a failure
// next to a recovering region (it grows and restarts: the cascading recovery), snapshot copies
// lost with their holders. Real processes, killed (SIGKILL) or hung (SIGSTOP); every job ends
// with the fault-free state_hash.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "tests/launcher/recovery_jobs.hpp"

namespace {

using namespace moevement::test_support;

TEST(joint_recovery, two_failures_in_turn_use_two_spares) {
  const auto o = launch("twice", job(3, 1, 2,
                                     "--inject kill:stage=1,replica=0,iter=4 "
                                     "--inject kill:stage=1,replica=0,iter=9"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  int ends = 0;
  for (const auto& l : o.log) ends += l.find("recovery_end") != std::string::npos;
  EXPECT_EQ(ends, 2);
}

TEST(joint_recovery, two_contiguous_stages_recover_jointly) {
  // Stages 1 and 2 of four die together: the logs between them are gone, so one region
  // 1..2 replays jointly from stage 0's and stage 3's logs, on two spares. 24 iterations:
  // the survivors' abandoned windows are released once a window after the recovery persists
  // (iteration 11 or so on a quiet host; under the suite's load replication lagged past 15),
  // and the memory check below is of the end.
  const std::string longer = "--set train.iterations=24 ";
  const auto o = launch("joint", job(4, 1, 2,
                                     longer + "--inject kill:stage=1,replica=0,iter=7 "
                                              "--inject kill:stage=2,replica=0,iter=7"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1, 24));
  const auto ends = events(o, "recovery_end");
  ASSERT_FALSE(ends.empty()) << o.output;
  const std::string& last = *ends.back();
  EXPECT_EQ(number_field(last, "first_stage"), 1) << last;
  EXPECT_EQ(number_field(last, "last_stage"), 2) << last;
  EXPECT_LE(number_field(last, "iterations_replayed"), 4) << "at most 2 x W_sparse";
  EXPECT_NE(o.output.find("stages 1..2 recovered"), std::string::npos) << o.output;
  // Replayed as a pipeline: each member its own stage, on its own spare.
  EXPECT_NE(last.find("\"pipelined\":true"), std::string::npos) << last;
  const std::string replays = text_field(last, "replays");
  EXPECT_NE(replays.find("1/0@"), std::string::npos) << replays;
  EXPECT_NE(replays.find("2/0@"), std::string::npos) << replays;
  // Outside the region nothing was recomputed: every iteration ran once, except the one the
  // failure interrupted (aborted and run again once the region was back).
  for (const auto& l : o.log) {
    if (l.find("\"kind\":\"iteration\"") == std::string::npos) continue;
    const int it = int(number_field(l, "iteration"));
    EXPECT_LE(number_field(l, "attempts"), it == 7 ? 2 : 1) << l;
  }
  // Memory returns to the fault-free level: the host bytes of snapshots and logs at the end
  // are within what the capture may hold (the recovery's extra windows were released). The
  // fault-free run's steady level (its median from iteration 4 on) is two windows; where
  // persisting lags (a loaded host) the capture keeps a third window's buffers
  // (sparse_capture::trim_spares, policy_limits' windows held), so the bound is 3/2 of it,
  // and a window the recovery failed to release would make a fourth. "At the end" is the least
  // of the last four iterations. The release of abandoned windows itself is checked exactly in
  // sparse_capture_test.
  const auto clean = launch("joint-clean", job(4, 1, 2, longer));
  ASSERT_EQ(clean.exit_code, 0) << clean.output;
  for (const char* field : {"snapshot_host_bytes", "log_host_bytes"}) {
    std::int64_t end = -1;
    std::vector<std::int64_t> steady;
    for (const auto& l : clean.log) {
      if (l.find("\"kind\":\"iteration\"") != std::string::npos &&
          number_field(l, "iteration") >= 4) {
        steady.push_back(std::int64_t(number_field(l, field)));
      }
    }
    ASSERT_FALSE(steady.empty()) << field;
    std::sort(steady.begin(), steady.end());
    const std::int64_t peak = steady[steady.size() / 2] * 3 / 2;
    std::string series;  // per iteration, for the failure message: faulty / fault-free
    for (const auto& l : o.log) {
      if (l.find("\"kind\":\"iteration\"") == std::string::npos) continue;
      series += fmt::format(" {}:{} ({})", number_field(l, "iteration"), number_field(l, field),
                            text_field(l, "snapshot_host_bytes_by_stage"));
      if (number_field(l, "iteration") < 20) continue;
      const auto bytes = std::int64_t(number_field(l, field));
      end = end < 0 ? bytes : std::min(end, bytes);
    }
    series += " / fault-free:";
    for (const auto& l : clean.log) {
      if (l.find("\"kind\":\"iteration\"") != std::string::npos) {
        series += fmt::format(" {}", number_field(l, field));
      }
    }
    EXPECT_GT(peak, 0) << field;
    EXPECT_GE(end, 0) << field << ": no iteration after 20 in the log";
    EXPECT_LE(end, peak) << field << series;
  }
  // Slots go into memory the link allocated (replicas on this host read it with one RMA get):
  // with checkpoint.share_memory (the default) the pool makes memory files as the capture asks,
  // so every slot is lent (without it the first windows start on the heap: the pool learns
  // each slot's size from a miss, and a reorder changes the sizes). 24 iterations at W = 2.
  std::int64_t iterations = 0;
  double replication_cpu_s = 0.0;
  for (const auto& l : clean.log) {
    if (l.find("\"kind\":\"iteration\"") == std::string::npos) continue;
    const auto it = std::int64_t(number_field(l, "iteration"));
    EXPECT_GE(number_field(l, "replication_cpu_s"), 0.0) << l;
    replication_cpu_s += number_field(l, "replication_cpu_s");
    const auto bytes = std::int64_t(number_field(l, "snapshot_bytes"));
    const auto lent = std::int64_t(number_field(l, "snapshot_lent_bytes"));
    EXPECT_LE(lent, bytes) << l;
    if (it >= 9) {
      EXPECT_GT(bytes, 0) << l;
      EXPECT_EQ(lent, bytes) << l;
      EXPECT_GT(number_field(l, "capture_cpu_s"), 0.0) << "the captures' CPU time: " << l;
      ++iterations;
    }
  }
  EXPECT_EQ(iterations, 15);
  // The actor threads' offers, maps and answers are measured (the window tuner counts them).
  EXPECT_GT(replication_cpu_s, 0.0) << "the workers' CPU time on replication";
}

TEST(joint_recovery, two_stages_apart_recover_as_two_regions) {
  // Stages 0 and 2 of three: stage 1 between them is healthy and serves both its logs, so
  // two regions recover concurrently and independently.
  const auto o = launch("apart", job(3, 1, 2,
                                     "--inject kill:stage=0,replica=0,iter=6 "
                                     "--inject kill:stage=2,replica=0,iter=6"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  std::vector<int> firsts;
  for (const auto* e : events(o, "recovery_end")) {
    EXPECT_EQ(number_field(*e, "first_stage"), number_field(*e, "last_stage")) << *e;
    firsts.push_back(int(number_field(*e, "first_stage")));
  }
  std::sort(firsts.begin(), firsts.end());
  EXPECT_EQ(firsts, (std::vector<int>{0, 2})) << o.output;
}

TEST(joint_recovery, a_lost_data_parallel_pair_of_neighbours_is_one_region) {
  // (1, 0) and (2, 1) of pp=3 dp=2: different replicas, but stage 1's group replays every
  // replica and needs stage 2 replica 1's gradients, which died: one region 1..2.
  const auto o = launch("dpjoint", job(3, 2, 2,
                                       "--inject kill:stage=1,replica=0,iter=6 "
                                       "--inject kill:stage=2,replica=1,iter=6"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  const auto ends = events(o, "recovery_end");
  ASSERT_FALSE(ends.empty()) << o.output;
  EXPECT_EQ(number_field(*ends.back(), "first_stage"), 1);
  EXPECT_EQ(number_field(*ends.back(), "last_stage"), 2);
  // Four members, each replaying its own stage and replica, each stage's group summing its
  // gradients, the two stages passing tensors live.
  EXPECT_NE(ends.back()->find("\"pipelined\":true"), std::string::npos) << *ends.back();
  const std::string replays = text_field(*ends.back(), "replays");
  for (const char* role : {"1/0@", "1/1@", "2/0@", "2/1@"}) {
    EXPECT_NE(replays.find(role), std::string::npos) << role << " in " << replays;
  }
}

TEST(joint_recovery, a_rebuilt_replica_schedules_like_its_survivors) {
  // Replica 0 of stage 1 is rebuilt, then replica 1 of the same stage is lost: the second
  // recovery converts both replicas' windows, which must freeze the same operators (the
  // replacement took over the survivor's schedule state), and memory is back to the level
  // of the fault-free run.
  // Under every ordering of appendix B (the time-decayed one carries its moving average).
  for (const std::string ordering : {"popularity", "soft-count", "time-decayed"}) {
    const auto o = launch("again-" + ordering, job(2, 2, 2,
                                                   "--set checkpoint.ordering=" + ordering +
                                                       " --set checkpoint.decay_alpha=0.5 "
                                                       "--inject kill:stage=1,replica=0,iter=4 "
                                                       "--inject kill:stage=1,replica=1,iter=9"));
    ASSERT_EQ(o.exit_code, 0) << ordering << "\n" << o.output;
    EXPECT_EQ(o.hash, reference(2)) << ordering;
    EXPECT_EQ(events(o, "recovery_end").size(), 2u) << ordering << "\n" << o.output;
    EXPECT_EQ(events(o, "schedule_mismatch").size(), 0u) << ordering << "\n" << o.output;
  }
}

TEST(joint_recovery, a_lost_replicator_holding_a_needed_snapshot_is_replaced_by_its_other_copy) {
  // Stages 0 and 1 of three die together; stage 1's worker also held one of the two copies
  // of stage 0's window: the region's restore pulls stage 0's slots from the other copy.
  const auto o = launch("holder", job(3, 1, 2,
                                      "--inject kill:stage=0,replica=0,iter=7 "
                                      "--inject kill:stage=1,replica=0,iter=7"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const std::string* lost1 = nullptr;
  for (const auto* l : events(o, "worker_lost")) {
    if (number_field(*l, "stage") == 1) lost1 = l;
  }
  ASSERT_NE(lost1, nullptr) << o.output;
  const auto lost_node = std::int64_t(number_field(*lost1, "node"));
  bool held = false;
  for (const auto* l : events(o, "snapshot_holders")) {
    if (number_field(*l, "stage") != 0) continue;
    held = held || ("," + holders_of(*l) + ",").find("," + std::to_string(lost_node) + ",") !=
                       std::string::npos;
  }
  EXPECT_TRUE(held) << "stage 0's copies were meant to include the lost worker " << lost_node;
  const auto ends = events(o, "recovery_end");
  ASSERT_FALSE(ends.empty());
  EXPECT_EQ(number_field(*ends.back(), "first_stage"), 0);
  EXPECT_EQ(number_field(*ends.back(), "last_stage"), 1);
}

TEST(joint_recovery, half_the_pipeline_lost_at_once_keeps_a_copy_of_every_slot) {
  // Stages 1 and 2 of four (half the pipeline) die together, with one copy of every slot
  // (checkpoint.replicas = 1). The copies were placed run-safe (engine/snapshot_placement):
  // stage 1's is not on stage 2's worker, where it would have died with it. The region
  // restores from memory, bit-exact, with no fallback.
  const auto o = launch("half", job(4, 1, 2,
                                    "--set checkpoint.replicas=1 "
                                    "--inject kill:stage=1,replica=0,iter=7 "
                                    "--inject kill:stage=2,replica=0,iter=7"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const auto ends = events(o, "recovery_end");
  ASSERT_FALSE(ends.empty()) << o.output;
  EXPECT_EQ(number_field(*ends.back(), "first_stage"), 1);
  EXPECT_EQ(number_field(*ends.back(), "last_stage"), 2);
  // Before the failure (stage s on node s + 1), stage 1's and stage 2's copies were outside
  // stages 1..2 (nodes 2 and 3).
  for (const auto* l : events(o, "snapshot_holders")) {
    const int s = int(number_field(*l, "stage"));
    if ((s != 1 && s != 2) || number_field(*l, "node") != s + 1) continue;  // before only
    EXPECT_NE(holders_of(*l), "2") << *l;
    EXPECT_NE(holders_of(*l), "3") << *l;
  }
}

TEST(joint_recovery, when_every_copy_of_a_needed_slot_is_gone_the_job_says_which) {
  // One copy (checkpoint.replicas = 1) of stage 0's window, held by stage 1's worker, and
  // both die: nothing in memory can rebuild stage 0. Without the durable tier (on by default
  // on this backend: tests/launcher/durable_fallback_test) nothing else can either.
  const auto o = launch("nocopy", job(3, 1, 2,
                                      "--set checkpoint.replicas=1 --set checkpoint.durable=false "
                                      "--inject kill:stage=0,replica=0,iter=7 "
                                      "--inject kill:stage=1,replica=0,iter=7"));
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("is on no live replicator"), std::string::npos) << o.output;
  EXPECT_EQ(o.hash, "");
  // No fallback to disk was tried.
  EXPECT_EQ(event(o, "durable_rollback"), nullptr) << o.output;
  EXPECT_EQ(event(o, "durable_written"), nullptr) << o.output;
}

TEST(joint_recovery, a_kill_and_a_hang_next_to_it_recover_as_one_region) {
  // Stage 1 is killed and stage 2 hangs at the same moment: the kill is seen at once, but
  // aborting the survivors waits on the silent stage 2 until the heartbeats give up on it;
  // both losses then form one region 1..2.
  const auto o = launch("killhang", job(4, 1, 2,
                                        "--set cluster.failure_timeout_ms=2000 "
                                        "--inject kill:stage=1,replica=0,iter=7 "
                                        "--inject hang:stage=2,replica=0,iter=7"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const auto ends = events(o, "recovery_end");
  ASSERT_EQ(ends.size(), 1u) << o.output;
  EXPECT_EQ(number_field(*ends[0], "first_stage"), 1);
  EXPECT_EQ(number_field(*ends[0], "last_stage"), 2);
}

TEST(joint_recovery, a_failure_next_to_a_recovering_region_grows_and_restarts_it) {
  // Stage 1 is killed; the moment its recovery starts, stage 2 (whose gradient log the
  // restore needs) hangs. The restore cannot finish without stage 2, and once the heartbeats
  // give up on it, the loss next to the region still recovering grows the region to 1..2 and
  // restarts it (cascading): stage 1's spare restores again, stage 2 gets a new one. A window
  // of 3 (a replay of several iterations is under way when the loss comes).
  const auto o = launch("cascade", job(4, 1, 2,
                                       "--set checkpoint.w_sparse=3 "
                                       "--set cluster.failure_timeout_ms=2000 "
                                       "--inject kill:stage=1,replica=0,iter=7 "
                                       "--inject hang:stage=2,replica=0,during=recovery"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const auto starts = events(o, "recovery_start");
  ASSERT_EQ(starts.size(), 2u) << o.output;
  EXPECT_EQ(number_field(*starts[0], "first_stage"), 1);
  EXPECT_EQ(number_field(*starts[0], "last_stage"), 1);
  EXPECT_EQ(number_field(*starts[1], "first_stage"), 1);
  EXPECT_EQ(number_field(*starts[1], "last_stage"), 2);
  EXPECT_EQ(number_field(*starts[1], "restarts"), 1);
  EXPECT_EQ(number_field(*starts[1], "spare_node"), number_field(*starts[0], "spare_node"))
      << "stage 1's spare restores again, with the grown region";
  const auto ends = events(o, "recovery_end");
  ASSERT_EQ(ends.size(), 1u) << "one recovery, restarted once";
  const auto grew = o.output.find("the recovery grew");
  ASSERT_NE(grew, std::string::npos) << o.output;
  // That line names the worker that died this time (stage 2's), not stage 1's first loss.
  const std::string line = o.output.substr(o.output.rfind('\n', grew) + 1,
                                           o.output.find('\n', grew) - o.output.rfind('\n', grew));
  EXPECT_NE(line.find("stage 2 replica 0 (worker 3) lost"), std::string::npos) << line;
  EXPECT_EQ(line.find("stage 1 replica 0"), std::string::npos) << line;
}

// The same cascade with a restart intensity of 0 and no durable tier: the region's restart
// escalates to the job, which stops, naming the key and what would have saved it.
TEST(joint_recovery, a_region_restarting_past_its_intensity_stops_the_job_saying_so) {
  const auto o = launch("escalate", job(4, 1, 2,
                                        "--set cluster.failure_timeout_ms=2000 "
                                        "--set checkpoint.durable=false "
                                        "--set checkpoint.region_restarts=0 "
                                        "--inject kill:stage=1,replica=0,iter=7 "
                                        "--inject hang:stage=2,replica=0,during=recovery"));
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("past checkpoint.region_restarts = 0"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("checkpoint.durable = true"), std::string::npos) << o.output;
  const auto escalated = events(o, "region_escalated");
  ASSERT_EQ(escalated.size(), 1u) << o.output;
  EXPECT_NE(escalated[0]->find("\"to\":\"stop\""), std::string::npos) << *escalated[0];
}

TEST(joint_recovery, a_disjoint_failure_during_a_recovery_is_a_region_of_its_own) {
  // Stage 0 is killed; as its recovery starts, stage 2 (not next to it) is killed too: a
  // second region, recovered on its own spare, and the job ends bit-exact.
  const auto o = launch("disjoint", job(4, 1, 2,
                                        "--inject kill:stage=0,replica=0,iter=7 "
                                        "--inject kill:stage=2,replica=0,during=recovery"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  std::vector<int> regions;
  for (const auto* e : events(o, "recovery_end")) {
    EXPECT_EQ(number_field(*e, "first_stage"), number_field(*e, "last_stage")) << *e;
    regions.push_back(int(number_field(*e, "first_stage")));
  }
  std::sort(regions.begin(), regions.end());
  EXPECT_EQ(regions, (std::vector<int>{0, 2})) << o.output;
  for (const auto* e : events(o, "recovery_start")) {
    EXPECT_EQ(number_field(*e, "restarts"), 0) << "a disjoint loss restarts nothing: " << *e;
  }
}

}  // namespace
