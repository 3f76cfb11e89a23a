// Policy `moevement` under `moevement launch`, end to end with real processes: a worker
// killed (SIGKILL) or hung (SIGSTOP) mid-run is rebuilt on a spare by sparse-to-dense
// conversion from its replicated window and its neighbours' upstream logs, and the job ends
// with the same state_hash as a run without failures (and as `moevement train`).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "tests/launcher/recovery_jobs.hpp"

namespace {

using namespace moevement::test_support;

// The run's ETTR in job_end: useful_s is the committed attempt of each iteration index (the
// last iteration record per index), and what is lost (wall_s - useful_s) covers at least the
// recovery's own pull and replay.
void expect_ettr_accounts_for_the_recovery(const outcome& o) {
  std::map<long, double> committed;
  for (const auto& l : o.log) {
    if (l.find("\"kind\":\"iteration\"") != std::string::npos) {
      committed[long(number_field(l, "iteration"))] = number_field(l, "iteration_s");
    }
  }
  double useful = 0;
  for (const auto& [i, s] : committed) useful += s;
  const std::string* end = event(o, "job_end");
  ASSERT_NE(end, nullptr) << o.output;
  const double wall = number_field(*end, "wall_s"), ettr = number_field(*end, "ettr");
  EXPECT_NEAR(number_field(*end, "useful_s"), useful, 1e-6 * (1 + useful));
  EXPECT_NEAR(ettr, useful / wall, 1e-6);
  EXPECT_GT(ettr, 0.0);
  EXPECT_LT(ettr, 1.0);
  double recovery = 0;
  for (const auto& l : o.log) {
    if (l.find("\"event\":\"recovery_end\"") != std::string::npos) {
      recovery += number_field(l, "pull_s") + number_field(l, "replay_s");
    }
  }
  EXPECT_GT(recovery, 0.0);
  EXPECT_GE(wall - useful, recovery) << "the lost time includes the recovery";
  EXPECT_NE(o.output.find("ETTR "), std::string::npos) << o.output;
}

TEST(recovery, capture_and_replication_change_no_bit) {
  const auto o = launch("clean", job(3, 1, 1));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  int persisted = 0;
  for (const auto& l : o.log) persisted += l.find("window_persisted") != std::string::npos;
  EXPECT_GE(persisted, 4) << "12 iterations with W=2 persist a window every 2 iterations";
}

// W_sparse re-chosen mid-run (checkpoint.max_overhead, recovery/window_tuner.hpp): with a
// bound no capture meets, the head raises W at window starts from Algorithm 1's on, the stages
// capture where it places each step, and a stage killed after the change is rebuilt from a
// window of whatever W it had, bit-exact.
TEST(recovery, a_w_sparse_tuned_mid_run_keeps_recovery_bit_exact) {
  const std::string tuned = tiny() +
                            " --set train.iterations=60 --set train.seq_len=16 --set "
                            "parallel.pp=3 --set checkpoint.policy=moevement --set "
                            "cluster.spares=1 --set cluster.failure_timeout_ms=3000 --set "
                            "checkpoint.max_overhead=1e-9 --inject kill:stage=1,replica=0,iter=50";
  const auto o = launch("tuned", tuned);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1, 60));
  int raised = 0, most = 0;
  for (const auto& l : o.log) {
    if (l.find("\"event\":\"window_tuned\"") == std::string::npos) continue;
    const int w = int(number_field(l, "w_sparse"));
    most = std::max(most, w);
    raised += w > int(number_field(l, "previous")) && number_field(l, "iteration") < 50;
  }
  EXPECT_GE(raised, 1) << "W was raised before the kill\n" << o.output;
  EXPECT_NE(o.output.find("checkpoint windows: W_sparse"), std::string::npos) << o.output;
  const std::string* start = event(o, "recovery_start");
  ASSERT_NE(start, nullptr) << o.output;
  EXPECT_GE(number_field(*start, "window"), 0);
  EXPECT_LE(number_field(*start, "target_iteration") - number_field(*start, "replay_from"),
            2 * most);
}

// The last iteration record's cumulative count of replicas made by mapping or by pulling.
std::pair<double, double> replica_kinds(const outcome& o) {
  std::pair<double, double> last{-1, -1};
  for (const auto& l : o.log) {
    if (l.find("\"kind\":\"iteration\"") != std::string::npos &&
        l.find("\"replica_maps\"") != std::string::npos) {
      last = {number_field(l, "replica_maps"), number_field(l, "replica_pulls")};
    }
  }
  return last;
}

TEST(recovery, replicas_on_the_owner_host_map_its_slots_and_pulled_copies_recover_alike) {
  // checkpoint.share_memory (the default): every worker is on this host, so every replica
  // is a mapping of the owner's memory, and the killed owner's slots outlive it there.
  const auto mapped = launch("mapped", job(3, 1, 1, "--inject kill:stage=1,replica=0,iter=7"));
  ASSERT_EQ(mapped.exit_code, 0) << mapped.output;
  EXPECT_EQ(mapped.hash, reference(1));
  const auto [maps, pulls] = replica_kinds(mapped);
  EXPECT_GT(maps, 0) << mapped.output;
  EXPECT_EQ(pulls, 0);
  // Off: every replica pulls a copy, and the recovery reads those.
  const auto copied = launch("copied", job(3, 1, 1,
                                           "--set checkpoint.share_memory=false "
                                           "--inject kill:stage=1,replica=0,iter=7"));
  ASSERT_EQ(copied.exit_code, 0) << copied.output;
  EXPECT_EQ(copied.hash, reference(1));
  const auto [maps2, pulls2] = replica_kinds(copied);
  EXPECT_EQ(maps2, 0);
  EXPECT_GT(pulls2, 0) << copied.output;
}

TEST(recovery, a_killed_stage_is_rebuilt_bit_exact_wherever_it_sits) {
  // middle, first and last stage of three; each from a persisted window.
  for (const auto& [stage, iter] : std::vector<std::pair<int, int>>{{1, 7}, {0, 5}, {2, 9}}) {
    const std::string inj =
        "--inject kill:stage=" + std::to_string(stage) + ",replica=0,iter=" + std::to_string(iter);
    // With stage 1: `--report`, the run drawn when it ends (moevement report on its run log).
    const std::string html = log_path("kill1") + ".html";
    const auto o = launch("kill" + std::to_string(stage),
                          job(3, 1, 1, inj + (stage == 1 ? " --report " + html : "")));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_EQ(o.hash, reference(1)) << inj;
    const std::string* start = event(o, "recovery_start");
    ASSERT_NE(start, nullptr) << o.output;
    EXPECT_EQ(number_field(*start, "stage"), stage);
    EXPECT_EQ(number_field(*start, "target_iteration"), iter);
    EXPECT_GE(number_field(*start, "window"), 0) << "a persisted window was there to start from";
    // Localized: at most 2 x W_sparse iterations replayed.
    EXPECT_LE(number_field(*start, "target_iteration") - number_field(*start, "replay_from"), 4);
    const std::string* end = event(o, "recovery_end");
    ASSERT_NE(end, nullptr) << o.output;
    EXPECT_EQ(number_field(*end, "window"), number_field(*start, "window")) << *end;
    EXPECT_NE(o.output.find("recovered on worker"), std::string::npos) << o.output;
    expect_ettr_accounts_for_the_recovery(o);
    if (stage == 1) {  // the report of the real run log: the recovery in its table
      EXPECT_NE(o.output.find("report: " + html), std::string::npos) << o.output;
      std::ifstream in(html);
      const std::string page{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
      EXPECT_NE(page.find("<td>region</td><td>stage 1 replica 0</td><td>7</td>"), std::string::npos)
          << page;
      // and its region's supervisor in the recovery tree
      EXPECT_NE(page.find("<td>started</td><td>1</td><td>1/0</td>"), std::string::npos) << page;
      EXPECT_NE(page.find("state_hash " + o.hash), std::string::npos);
    }
  }
}

// Sends of 128 KiB (16 sequences of 64 tokens), past policy_limits::log_copy_async_bytes: the
// upstream logs the replay reads were copied off the compute thread (recovery/log_copier.hpp).
// With answers of at most 64 KiB (checkpoint.log_fetch_bytes) each iteration of each
// neighbour's log comes in an answer of its own.
TEST(recovery, neighbours_logs_copied_off_the_compute_thread_rebuild_a_stage_bit_exact) {
  const std::string shape =
      " --set train.seq_len=64 --set train.micro_batch_size=16 --set train.iterations=10";
  const auto o = launch("async_log", job(3, 1, 1,
                                         "--set checkpoint.log_fetch_bytes=65536 "
                                         "--inject kill:stage=1,replica=0,iter=7" +
                                             shape) +
                                         shape);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  const auto r = run_moevement("train " + tiny() + shape);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_EQ(o.hash, hash_of(r.output)) << o.output;
  const std::string* start = event(o, "recovery_start");
  ASSERT_NE(start, nullptr) << o.output;
  EXPECT_EQ(number_field(*start, "target_iteration"), 7);
  const std::string* end = event(o, "recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  const auto replayed = number_field(*end, "iterations_replayed");
  EXPECT_GT(replayed, 1);
  EXPECT_EQ(number_field(*end, "log_pieces"), 2 * replayed) << "both neighbours, by iteration";
}

TEST(recovery, a_failure_before_any_window_replays_from_the_initial_state) {
  const auto o = launch("early", job(2, 1, 1, "--inject kill:stage=1,replica=0,iter=1"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const std::string* start = event(o, "recovery_start");
  ASSERT_NE(start, nullptr);
  EXPECT_EQ(number_field(*start, "window"), -1);
  EXPECT_EQ(number_field(*start, "replay_from"), 0);
}

// The (stage, replica) -> worker entries of recovery_end's replays ("1/0@5:0.1s:2t,...").
std::map<std::pair<int, int>, int> replayed_by(const std::string& line) {
  const auto at = line.find("\"replays\":\"");
  std::map<std::pair<int, int>, int> out;
  if (at == std::string::npos) return out;
  std::string list = line.substr(at + 11, line.find('"', at + 11) - at - 11);
  for (std::size_t pos = 0; pos < list.size();) {
    const std::size_t end = std::min(list.find(',', pos), list.size());
    int s = -1, d = -1, w = -1;
    if (std::sscanf(list.substr(pos, end - pos).c_str(), "%d/%d@%d", &s, &d, &w) == 3) {
      out[{s, d}] = w;
    }
    pos = end + 1;
  }
  return out;
}

TEST(recovery, a_lost_ep_rank_is_rebuilt_bit_exact) {
  // Expert parallelism: the lost replica holds its own block of experts. Its group replays
  // spread over its workers (the survivor rolled back on its own), the EP group's rows passing
  // between their replay routers, and each member's experts summed over their copies.
  const std::string ep = "--set parallel.ep=2 ";
  for (const char* phase : {"forward", "backward", "step", "snapshot"}) {
    const auto o =
        launch(std::string("ep_") + phase,
               job(2, 2, 1, ep + "--inject kill:stage=1,replica=1,iter=5,phase=" + phase));
    ASSERT_EQ(o.exit_code, 0) << phase << ": " << o.output;
    EXPECT_EQ(o.hash, reference(2)) << phase;
    const std::string* end = event(o, "recovery_end");
    ASSERT_NE(end, nullptr) << o.output;
    const auto by = replayed_by(*end);
    ASSERT_EQ(by.size(), 2u) << "each replica on its own worker: " << *end;
    EXPECT_NE(by.at({1, 0}), by.at({1, 1})) << *end;
  }
  // checkpoint.spread_replay = false: the spare replays the whole group in one process (its
  // EP groups exchanging rows there) and keeps its replica; the survivor, whose router saw the
  // peer go, takes the new one at the rewiring.
  const auto whole = launch("ep_whole", job(2, 2, 1,
                                            ep + "--set checkpoint.spread_replay=false "
                                                 "--inject kill:stage=1,replica=1,iter=5"));
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  EXPECT_EQ(whole.hash, reference(2));
  const std::string* end_whole = event(whole, "recovery_end");
  ASSERT_NE(end_whole, nullptr) << whole.output;
  EXPECT_EQ(replayed_by(*end_whole).size(), 1u) << "the spare alone replays: " << *end_whole;
  // dp = 4: two EP groups, each block of experts summed over its two copies.
  const auto four = launch("ep_dp4", job(2, 4, 1, ep + "--inject kill:stage=0,replica=3,iter=6"));
  ASSERT_EQ(four.exit_code, 0) << four.output;
  EXPECT_EQ(four.hash, reference(4));
  const std::string* end4 = event(four, "recovery_end");
  ASSERT_NE(end4, nullptr) << four.output;
  EXPECT_EQ(replayed_by(*end4).size(), 4u) << *end4;
  // Both EP ranks of a stage at once: every block of its experts is rebuilt from the windows.
  const auto both = launch("ep_both", job(2, 2, 2,
                                          ep + "--inject kill:stage=0,replica=0,iter=7 "
                                               "--inject kill:stage=0,replica=1,iter=7"));
  ASSERT_EQ(both.exit_code, 0) << both.output;
  EXPECT_EQ(both.hash, reference(2));
}

TEST(recovery, one_lost_replica_of_a_data_parallel_stage) {
  // dp = 4: the lost replica's group replays in parallel, each of the four replicas of stage
  // 1 on its own worker (the three survivors on theirs, the lost one on the spare).
  const auto o = launch("dp4", job(2, 4, 1, "--inject kill:stage=1,replica=1,iter=6"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(4));
  const std::string* end = event(o, "recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  const auto by = replayed_by(*end);
  ASSERT_EQ(by.size(), 4u) << *end;
  std::set<int> workers;
  for (int d = 0; d < 4; ++d) {
    ASSERT_TRUE(by.contains({1, d})) << *end;
    workers.insert(by.at({1, d}));
  }
  EXPECT_EQ(workers.size(), 4u) << "each replica on a worker of its own: " << *end;
  const std::string* lost = event(o, "worker_lost");
  ASSERT_NE(lost, nullptr);
  EXPECT_EQ(workers.count(int(number_field(*lost, "node"))), 0u) << "not on the dead worker";
}

TEST(recovery, a_replacement_lost_while_its_group_replays_restarts_the_group) {
  // dp = 2: the spare rebuilding (1, 0) is killed the moment the recovery starts, while the
  // surviving replica (1, 1) replays beside it and waits for its gradients. The region
  // restarts on another spare; the survivor's wait for the dead one ends (the new spare's
  // gradients are of a newer generation), and the job ends bit-exact.
  const auto o = launch("dpcascade", job(2, 2, 2,
                                         "--inject kill:stage=1,replica=0,iter=7 "
                                         "--inject kill:stage=1,replica=0,during=recovery"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  const auto starts = o.events("recovery_start");
  ASSERT_EQ(starts.size(), 2u) << o.output;
  EXPECT_EQ(number_field(*starts[1], "restarts"), 1);
  // The same region again (it did not grow): the console says so as the run log does.
  EXPECT_NE(o.output.find("; the recovery restarts: rebuilding stage 1"), std::string::npos)
      << o.output;
  EXPECT_EQ(o.output.find("the recovery grew"), std::string::npos) << o.output;
  const auto ends = o.events("recovery_end");
  ASSERT_EQ(ends.size(), 1u) << o.output;
  EXPECT_EQ(replayed_by(*ends[0]).size(), 2u) << *ends[0];
}

TEST(recovery, an_ep_rank_lost_while_its_group_replays_restarts_the_group) {
  // Expert parallelism, dp = 2: the spare rebuilding (1, 0) is killed the moment the recovery
  // starts, while the survivor (1, 1) replays beside it, waiting in its replay router for the
  // dead one's expert rows or answers. The newer generation ends that wait, the region
  // restarts on another spare, and the job ends bit-exact.
  const auto o = launch("epcascade", job(2, 2, 2,
                                         "--set parallel.ep=2 "
                                         "--inject kill:stage=1,replica=0,iter=7 "
                                         "--inject kill:stage=1,replica=0,during=recovery"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  EXPECT_EQ(o.events("recovery_start").size(), 2u) << o.output;
  const auto ends = o.events("recovery_end");
  ASSERT_EQ(ends.size(), 1u) << o.output;
  EXPECT_EQ(replayed_by(*ends[0]).size(), 2u) << *ends[0];
  // pp = 3: a replica of the next stage lost while stage 1's group replays spread: the region
  // grows to stages 1..2, replayed as a pipeline by every replica of both, and the survivor
  // that was replaying hears the new generation first (it waited for a peer whose restore
  // failed).
  const auto grown = launch("epgrown", job(3, 2, 2,
                                           "--set parallel.ep=2 "
                                           "--inject kill:stage=1,replica=0,iter=5 "
                                           "--inject kill:stage=2,replica=1,during=recovery"));
  ASSERT_EQ(grown.exit_code, 0) << grown.output;
  EXPECT_EQ(grown.hash, reference(2));
  EXPECT_EQ(grown.events("recovery_end").size(), 1u) << grown.output;
}

TEST(recovery, a_joint_ep_region_replays_as_a_pipeline_spread_over_its_workers) {
  // Expert parallelism, pp = 3, dp = 2: stages 1 and 2 of replica 0 killed together. Every
  // replica of both stages is a member, each replaying its own stage on its own worker: the
  // boundary tensors pass live between the stages' members, the expert rows between each
  // stage's EP group (a member waiting for a boundary tensor serves its peers' rows).
  const auto o = launch("epjoint", job(3, 2, 2,
                                       "--set parallel.ep=2 "
                                       "--inject kill:stage=1,replica=0,iter=5 "
                                       "--inject kill:stage=2,replica=0,iter=5"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  const std::string* end = event(o, "recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  EXPECT_NE(end->find("\"pipelined\":true"), std::string::npos) << *end;
  const auto by = replayed_by(*end);
  ASSERT_EQ(by.size(), 4u) << *end;
  std::set<int> workers;
  for (const auto& [role, worker] : by) workers.insert(worker);
  EXPECT_EQ(workers.size(), 4u) << "each on a worker of its own: " << *end;
}

TEST(recovery, an_ep_rank_lost_while_another_stages_region_recovers) {
  // Expert parallelism, pp = 3, dp = 2: stage 0 lost, then stage 2 (not adjacent: a region of
  // its own) while stage 0's group replays. Two regions recover side by side, each group
  // spread over its own workers with replay routers of its own.
  const auto o = launch("epconcurrent", job(3, 2, 2,
                                            "--set parallel.ep=2 "
                                            "--inject kill:stage=0,replica=0,iter=5 "
                                            "--inject kill:stage=2,replica=1,during=recovery"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  const auto ends = o.events("recovery_end");
  ASSERT_EQ(ends.size(), 2u) << o.output;
  for (const std::string* end : ends) EXPECT_EQ(replayed_by(*end).size(), 2u) << *end;
}

TEST(recovery, a_hung_worker_is_detected_and_rebuilt) {
  const auto o = launch("hang", job(2, 1, 1,
                                    "--set cluster.failure_timeout_ms=1500 "
                                    "--inject hang:stage=0,replica=0,iter=6"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  const std::string* lost = event(o, "worker_lost");
  ASSERT_NE(lost, nullptr);
  EXPECT_NE(lost->find("was lost"), std::string::npos) << *lost;  // by heartbeats
  EXPECT_NE(event(o, "recovery_end"), nullptr);
}

// A stage stuck in its compute while its worker lives (a hung kernel: heartbeats go on, no loss
// is found): once the iteration is past cluster.iteration_timeout_ms, the head probes the stages
// that have not finished it; the one computing a task of its own that long is fenced and rebuilt on
// the spare like a lost worker's, the one waiting for it is left alone, and the job ends with
// `moevement train`'s state_hash.
TEST(recovery, a_stage_stuck_in_its_compute_is_fenced_and_rebuilt_bit_exact) {
  const auto o = launch("stuck", job(2, 1, 1,
                                     "--set cluster.iteration_timeout_ms=3000 "
                                     "--inject stall:stage=1,replica=0,iter=5,phase=backward"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1));
  EXPECT_NE(o.output.find("stage 1 replica 0 (worker 2) is stuck in its compute"),
            std::string::npos)
      << o.output;
  ASSERT_EQ(o.count("worker_lost"), 1) << o.output;
  const std::string& lost = *event(o, "worker_lost");
  EXPECT_EQ(number_field(lost, "stage"), 1) << lost;
  EXPECT_NE(lost.find("stuck in iteration 5"), std::string::npos) << lost;
  EXPECT_EQ(o.count("recovery_end"), 1) << o.output;
}

// Expert parallelism: the stalled EP rank's peer waits for its rows on its own compute thread
// (not between messages), marked as a wait for a peer: only the stalled rank is fenced.
TEST(recovery, a_stuck_ep_rank_is_fenced_while_its_peer_waiting_for_its_rows_is_left_alone) {
  const auto o =
      launch("stuck_ep", job(2, 2, 1,
                             "--set parallel.ep=2 --set cluster.iteration_timeout_ms=3000 "
                             "--inject stall:stage=1,replica=1,iter=5,phase=forward"));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(2));
  EXPECT_NE(o.output.find("stage 1 replica 1 (worker 4) is stuck in its compute (one task of its "
                          "own has run"),
            std::string::npos)
      << o.output;
  ASSERT_EQ(o.count("worker_lost"), 1) << o.output;
  const std::string& lost = *event(o, "worker_lost");
  EXPECT_EQ(number_field(lost, "stage"), 1) << lost;
  EXPECT_EQ(number_field(lost, "replica"), 1) << lost;
  EXPECT_EQ(o.count("recovery_end"), 1) << o.output;
}

// Replication stalled by a real fault that is no loss: the spare, which holds copies of both
// stages' slots, is stopped (SIGSTOP) for less than the failure timeout. Meanwhile no window
// can persist; past checkpoint.max_window_wait_ms the stages skip windows (their memory stays
// at three windows) instead of stalling, windows persist again once the spare runs, and the
// job ends with no worker lost and `moevement train`'s state_hash. (A failure timeout of a
// minute: the stop lasts until the stages skip, however slow the machine.)
TEST(recovery, a_stalled_replication_skips_windows_and_costs_no_bit) {
  background_launch j("skip", job(2, 1, 1,
                                  "--set train.iterations=300 --set checkpoint.w_sparse=1 "
                                  "--set checkpoint.max_window_wait_ms=20 "
                                  "--set cluster.failure_timeout_ms=60000"));
  ASSERT_EQ(j.wait_for_workers(3).size(), 3u) << j.output();
  pid_t spare = -1;
  for (const auto& l : lines_of(j.log)) {
    if (l.find("\"worker_up\"") != std::string::npos && number_field(l, "stage") == -1) {
      spare = pid_t(number_field(l, "pid"));
    }
  }
  ASSERT_GT(spare, 1);
  const auto reached = [&](int iteration) {
    for (const auto& l : lines_of(j.log)) {
      if (l.find("\"kind\":\"iteration\"") != std::string::npos &&
          number_field(l, "iteration") >= iteration) {
        return true;
      }
    }
    return false;
  };
  const auto skipping = [&] {
    for (const auto& l : lines_of(j.log)) {
      if (l.find("\"kind\":\"iteration\"") != std::string::npos &&
          number_field(l, "windows_skipped") > 0) {
        return true;
      }
    }
    return false;
  };
  for (int i = 0; i < 3000 && !reached(10); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(reached(10)) << j.output();
  ASSERT_EQ(::kill(spare, SIGSTOP), 0);
  // Until the stages skip windows (not a fixed time: a fast machine's job would end before
  // the spare runs again), 30 s at most: under the failure timeout, no loss.
  for (int i = 0; i < 3000 && !skipping(); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_EQ(::kill(spare, SIGCONT), 0);
  const auto o = finish(j);
  ASSERT_EQ(o.exit_code, 0) << o.output;
  EXPECT_EQ(o.hash, reference(1, 300));
  EXPECT_EQ(event(o, "worker_lost"), nullptr) << o.output;
  EXPECT_NE(o.output.find("captured nothing of a window"), std::string::npos) << o.output;
  double skipped = 0, last_window = -1;
  for (const auto& l : o.log) {
    if (l.find("\"kind\":\"iteration\"") != std::string::npos) {
      skipped = number_field(l, "windows_skipped");
    }
    if (l.find("\"window_persisted\"") != std::string::npos) {
      last_window = number_field(l, "window");
    }
  }
  EXPECT_GT(skipped, 0) << o.output;
  EXPECT_GE(last_window, 270) << "windows persist again after the stall";
}

TEST(recovery, without_a_spare_the_job_ends_saying_so) {
  const auto o = launch("nospare", job(2, 1, 0, "--inject kill:stage=0,replica=0,iter=3"));
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("no spare worker is left"), std::string::npos) << o.output;
  EXPECT_EQ(o.hash, "");
}

// Two losses in one iteration and one spare: the stop names the role left without one (it
// read as the only loss, its worker unnamed).
TEST(recovery, a_second_loss_without_a_spare_is_named_with_its_worker) {
  const auto o = launch("second_nospare", job(3, 1, 1,
                                              "--inject kill:stage=0,replica=0,iter=5 "
                                              "--inject kill:stage=2,replica=0,iter=5"));
  EXPECT_EQ(o.exit_code, 1) << o.output;
  // Whichever loss the head saw second (stage s runs on worker s + 1), stopped by the region
  // that found no spare or, once the spare was taken, by the head at its detection.
  const std::regex named(
      "(stage ([02]) replica 0 \\(worker [13]\\) lost|worker [13] \\(stage [02], replica 0, "
      "pid [0-9]+\\) was killed)[^\n]*no spare worker is left");
  const bool found = std::regex_search(o.output, named);
  EXPECT_TRUE(found) << o.output;
  EXPECT_EQ(o.output.find("fell silent at once"), std::string::npos) << "killed, not silent";
}

// Two of the three workers hung at once, and one spare: the stop says that they fell silent
// together, and that the head may be the one cut off (a cut looks the same from the head).
TEST(recovery, a_majority_silent_at_once_says_the_head_may_be_the_one_cut_off) {
  const auto o = launch("silent_majority", job(2, 1, 1,
                                               "--inject hang:stage=0,replica=0,iter=4 "
                                               "--inject hang:stage=1,replica=0,iter=4"));
  EXPECT_EQ(o.exit_code, 1) << o.output;
  EXPECT_NE(o.output.find("no spare worker is left"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("2 of the 3 workers fell silent at once"), std::string::npos) << o.output;
  EXPECT_NE(o.output.find("this head is the one cut off"), std::string::npos) << o.output;
}

TEST(recovery, bad_injections_are_refused_before_anything_starts) {
  for (const std::string spec :
       {"explode:stage=0,replica=0,iter=1", "kill:stage=0,iter=1", "kill:stage=0,replica=0,iter=0",
        "kill:stage=9,replica=0,iter=2", "kill:stage=0,replica=0,iter=x", "kill"}) {
    const auto r = run_moevement("launch " + job(2, 1, 1) + " --inject " + spec);
    EXPECT_NE(r.exit_code, 0) << spec;
    EXPECT_NE(r.output.find("--inject"), std::string::npos) << spec << ": " << r.output;
    EXPECT_EQ(r.output.find("state_hash="), std::string::npos);
  }
}

}  // namespace