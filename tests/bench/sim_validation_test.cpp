// bench/sim_validation.hpp: what `moevement bench simvalidate` hands the simulator. The profile it
// writes reads back through the simulator's own parser with the same values, the failure trace
// built from a run log has the failures' times and stages, and the fixed-work prediction agrees
// with hand-computed runs. No timing of this machine is involved.
#include "bench/sim_validation.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

using namespace moevement;
using namespace moevement::bench;

TEST(sim_validation, toml_floats_read_back_as_floats) {
  EXPECT_EQ(toml_float(2.0), "2.0");
  EXPECT_EQ(toml_float(0.1), "0.1");
  EXPECT_EQ(toml_float(1e-5), "1e-05");
  EXPECT_THROW(toml_float(std::numeric_limits<double>::infinity()), std::invalid_argument);
}

TEST(sim_validation, profile_round_trips_through_the_simulators_parser) {
  sim::profile_data p;
  p.producer = "moevement bench simvalidate";
  p.iteration_s = 0.017312345678901234;
  p.stage_microbatch_s = {0.0021, 2.0, 1.0 / 3.0};
  p.sync_s = 0.0;
  p.update_s = 1e-5;
  p.snapshot_bytes_per_s_per_gpu = 1.234567891e9;
  p.restart_s = 0.0123;
  p.persist_lag_s = 0.004;
  p.replay_iteration_s = 0.0029;
  p.snapshot_s = {{"dense-memory", 0.5}, {"pec", 0.0625}};
  p.load_s = {{"dense-disk", 0.125}, {"moevement", 0.003}};
  const std::string text = profile_toml(p);
  const sim::profile_data q = sim::parse_profile(text);
  EXPECT_EQ(q.format_version, 1);
  EXPECT_EQ(q.producer, p.producer);
  EXPECT_EQ(q.iteration_s, p.iteration_s);  // bit-exact: shortest round-trip digits
  EXPECT_EQ(q.stage_microbatch_s, p.stage_microbatch_s);
  EXPECT_EQ(q.sync_s, p.sync_s);
  EXPECT_EQ(q.update_s, p.update_s);
  // Written in GB/s, read back times 1e9: equal to the last bit or one ulp off.
  EXPECT_DOUBLE_EQ(q.snapshot_bytes_per_s_per_gpu, p.snapshot_bytes_per_s_per_gpu);
  EXPECT_EQ(q.restart_s, p.restart_s);
  EXPECT_EQ(q.persist_lag_s, p.persist_lag_s);
  EXPECT_EQ(q.replay_iteration_s, p.replay_iteration_s);
  EXPECT_EQ(q.snapshot_s, p.snapshot_s);
  EXPECT_EQ(q.load_s, p.load_s);
}

TEST(sim_validation, unmeasured_fields_are_left_out) {
  sim::profile_data p;
  p.iteration_s = 0.25;
  const std::string text = profile_toml(p);
  EXPECT_EQ(text.find("restart_s"), std::string::npos);
  EXPECT_EQ(text.find("stage_microbatch_s"), std::string::npos);
  const sim::profile_data q = sim::parse_profile(text);
  EXPECT_EQ(q.iteration_s, 0.25);
  EXPECT_LT(q.restart_s, 0);
  EXPECT_LT(q.persist_lag_s, 0);
  EXPECT_LT(q.sync_s, 0);
  EXPECT_TRUE(q.stage_microbatch_s.empty());
  EXPECT_TRUE(q.snapshot_s.empty());
}

std::string iter(long i, double s) {
  return fmt::format(
      "{{\"kind\":\"iteration\",\"iteration\":{},\"iteration_s\":{},"
      "\"max_stage_compute_s\":0.008,\"mean_stage_compute_s\":0.006,\"snapshot_bytes\":10}}",
      i, s);
}

std::vector<stamped> two_failure_log() {
  return {
      {0.5, R"({"kind":"event","event":"job_start","pp":3,"dp":1,"spares":2,"iterations":4})"},
      {0.6, iter(0, 0.1)},
      {0.65,
       R"({"kind":"event","event":"window_persisted","window":0,"first_iteration":1,"iteration":1})"},
      {0.6,
       R"({"kind":"event","event":"window_chosen","w_sparse":1,"profile_iteration_s":0.1,"profile_bandwidth":2.5e8,"iteration":0})"},
      {1.7,
       R"({"kind":"event","event":"worker_lost","node":2,"stage":1,"replica":0,"how":"was lost","iteration":1,"time_s":1.69})"},
      {1.8,
       R"({"kind":"event","event":"recovery_start","stage":1,"replica":0,"target_iteration":1,"window":0,"replay_from":1})"},
      {1.9,
       R"({"kind":"event","event":"recovery_end","stage":1,"replica":0,"target_iteration":1,"iterations_replayed":0,"seconds":0.2,"spawn_s":0.05,"pull_s":0.01,"replay_s":0.0,"rejoin_s":0.12,"time_s":1.89})"},
      {2.0,
       R"({"kind":"event","event":"worker_lost","node":5,"stage":-1,"replica":-1,"how":"was lost","iteration":1})"},
      {2.1, iter(1, 0.25)},
      {2.2, iter(2, 0.1)},
      {2.225,
       R"({"kind":"event","event":"window_persisted","window":1,"first_iteration":3,"iteration":3})"},
      {3.1,
       R"({"kind":"event","event":"worker_lost","node":3,"stage":2,"replica":0,"how":"was lost","iteration":3})"},
      {3.4,
       R"({"kind":"event","event":"recovery_end","stage":2,"replica":0,"target_iteration":3,"iterations_replayed":1,"seconds":0.3,"spawn_s":0.1,"pull_s":0.02,"replay_s":0.125,"rejoin_s":0.05})"},
      {3.6, iter(3, 0.1)},
      {3.9, R"({"kind":"event","event":"job_end","iterations":4,"state_hash":"ab"})"},
  };
}

TEST(sim_validation, run_log_gives_losses_recoveries_and_the_training_window) {
  const run_result r = parse(two_failure_log());
  ASSERT_EQ(r.losses.size(), 3u);
  EXPECT_EQ(r.losses[0].stage, 1);
  EXPECT_EQ(r.losses[0].iteration, 1);
  EXPECT_DOUBLE_EQ(r.losses[0].t, 1.7);
  EXPECT_EQ(r.losses[1].stage, -1);  // a spare
  ASSERT_EQ(r.recoveries.size(), 2u);
  EXPECT_DOUBLE_EQ(r.recoveries[1].seconds, 0.3);
  EXPECT_DOUBLE_EQ(r.recoveries[1].spawn_s, 0.1);
  EXPECT_DOUBLE_EQ(r.recoveries[1].pull_s, 0.02);
  EXPECT_DOUBLE_EQ(r.recoveries[1].replay_s, 0.125);
  EXPECT_DOUBLE_EQ(r.recoveries[1].rejoin_s, 0.05);
  EXPECT_EQ(r.recoveries[1].replayed, 1);
  EXPECT_EQ(r.recoveries[1].target, 3);
  EXPECT_DOUBLE_EQ(r.profile_bandwidth, 2.5e8);
  EXPECT_DOUBLE_EQ(r.iterations[0].mean_stage_compute_s, 0.006);
  EXPECT_DOUBLE_EQ(r.t_last_iteration, 3.6);
  // 4 iterations of 0.1 s useful, over job_start (0.5) .. last iteration (3.6), not job_end.
  const std::map<long, double> ff{{0, 0.1}, {1, 0.1}, {2, 0.1}, {3, 0.1}};
  EXPECT_DOUBLE_EQ(ettr_training_window(r, ff), 0.4 / 3.1);
  EXPECT_DOUBLE_EQ(ettr(r, ff), 0.4 / 3.4);
}

// The simulator takes the W a failure replayed from: the tuner's at the first failure, not the
// one it chose after the recovery (a run killed at W 6 ended with W 10).
TEST(sim_validation, the_w_of_a_run_is_the_tuners_at_its_first_failure) {
  auto log = two_failure_log();  // Algorithm 1's W 1; failures at iterations 1 and 3
  EXPECT_EQ(w_at_failure(parse(log)), 1);
  const auto tuned = [](int w, int previous, long iteration) {
    return fmt::format(
        R"({{"kind":"event","event":"window_tuned","w_sparse":{},"previous":{},"iteration":{}}})",
        w, previous, iteration);
  };
  log.insert(log.begin() + 4, {0.61, tuned(6, 1, 1)});  // takes effect at iteration 1
  log.insert(log.begin() + 5, {0.62, tuned(6, 6, 1)});  // measured again, unchanged
  log.push_back({3.7, tuned(10, 6, 4)});                // after the recovery
  const run_result r = parse(log);
  EXPECT_EQ(r.w_sparse, 10);
  EXPECT_EQ(w_at_failure(r), 6);
  run_result fault_free = r;
  fault_free.recoveries.clear();
  EXPECT_EQ(w_at_failure(fault_free), 10);
}

TEST(sim_validation, own_times_persist_lags_and_stage_times) {
  const run_result r = parse(two_failure_log());
  const auto own = own_times(r);
  ASSERT_EQ(own.size(), 4u);
  EXPECT_DOUBLE_EQ(own.at(1), 0.25);
  EXPECT_DOUBLE_EQ(own.at(3), 0.1);
  // Window 0 (replay from 1) persisted 0.05 s after iteration 0's record; window 1 (replay from
  // 3) 0.025 s after iteration 2's.
  const auto lags = persist_lags(r);
  ASSERT_EQ(lags.size(), 2u);
  EXPECT_NEAR(lags[0], 0.05, 1e-12);
  EXPECT_NEAR(lags[1], 0.025, 1e-12);
  EXPECT_DOUBLE_EQ(stage_microbatch_s({r}, 4), 0.006 / 4);
}

TEST(sim_validation, trace_has_the_stage_failures_at_their_times_from_job_start) {
  const auto trace = failure_trace(parse(two_failure_log()));
  ASSERT_EQ(trace.size(), 2u);  // the lost spare is no failure of the training
  EXPECT_DOUBLE_EQ(trace[0].time_s, 1.7 - 0.5);
  EXPECT_EQ(trace[0].stage, 1);
  EXPECT_DOUBLE_EQ(trace[1].time_s, 3.1 - 0.5);
  EXPECT_EQ(trace[1].stage, 2);
  // The trace file reads back through the simulator's parser unchanged.
  const auto back = sim::parse_failure_trace(trace_text(trace));
  ASSERT_EQ(back.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(back[i].time_s, trace[i].time_s);
    EXPECT_EQ(back[i].stage, trace[i].stage);
  }
}

TEST(sim_validation, tiny_model_in_simulator_terms_has_the_engines_parameter_count) {
  job_shape j;
  j.model = models::preset("tiny");
  j.pp = 3;
  j.micro_batches = 4;
  j.micro_batch_size = 4;
  const auto m = sim_model(j);
  EXPECT_DOUBLE_EQ(sim::total_params(m), double(j.model.parameter_count()));
  EXPECT_GT(m.extra_params, 0);  // position embedding and norms
  const auto in = sim_inputs(j, 1e9, 2e8);
  EXPECT_EQ(in.plan.microbatches(), 4);
  const auto costs =
      sim::estimate_iteration(in.model, in.cluster, in.plan, in.constants, j.replicas);
  EXPECT_EQ(costs.stages.size(), 3u);
  EXPECT_DOUBLE_EQ(costs.total_params, double(j.model.parameter_count()));
}

// A hand-built moevement policy: 0.1 s iterations, 0.01 s stall, W = 1, windows persisted at once.
sim::policy_model simple_policy() {
  sim::policy_model m;
  m.kind = sim::policy_kind::moevement;
  m.iteration_s = 0.1;
  m.stall_s = 0.01;
  m.w_sparse = 1;
  m.stages = 1;
  m.conversion_s = {{0.05}};
  m.catch_up_s = {0.08};
  m.restart_s = 0.2;
  return m;
}

TEST(sim_validation, fixed_work_prediction_without_failures_is_the_stall_alone) {
  sim::failure_settings f;
  f.restart_s = 0.2;
  const auto p = predict_fixed_work(simple_policy(), 20, f, {});
  EXPECT_NEAR(p.wall_s, 20 * 0.11, 1e-9);
  EXPECT_NEAR(p.ettr, 0.1 / 0.11, 1e-9);
  EXPECT_EQ(p.failures, 0);
}

TEST(sim_validation, a_window_not_yet_persisted_at_the_failure_is_replayed) {
  sim::failure_settings f;
  f.restart_s = 0.2;
  auto m = simple_policy();
  // Window of iteration 8 (ends at 0.99) persisted only 0.08 s later: the failure at 1.05 finds
  // the previous window, so iteration 8 is caught up (0.08 s) before the restart is done.
  m.persist_lag_s = 0.08;
  const auto p = predict_fixed_work(m, 20, f, {{1.05, 0}});
  EXPECT_NEAR(p.wall_s, 1.25 + 0.08 + 11 * 0.11, 1e-9);
}

TEST(sim_validation, fixed_work_prediction_with_a_failure_counts_restart_and_the_abort) {
  sim::failure_settings f;
  f.restart_s = 0.2;
  // Iteration 9 runs 0.99 .. 1.10; the failure at 1.05 aborts it. The window of iteration 8 is
  // persisted (lag 0), so nothing is replayed: resume at 1.05 + 0.2, then 11 iterations.
  const auto p = predict_fixed_work(simple_policy(), 20, f, {{1.05, 0}});
  EXPECT_NEAR(p.wall_s, 1.25 + 11 * 0.11, 1e-9);
  EXPECT_NEAR(p.ettr, 2.0 / (1.25 + 11 * 0.11), 1e-9);
  EXPECT_EQ(p.failures, 1);
  EXPECT_NEAR(p.time_lost_s, 1.25 + 11 * 0.11 - 2.0, 1e-9);
}

}  // namespace

namespace {

TEST(sim_validation, failure_points_are_the_aborted_iteration_and_the_time_into_it) {
  const auto points = failure_points(parse(two_failure_log()));
  ASSERT_EQ(points.size(), 2u);
  EXPECT_EQ(points[0].iteration, 1);  // iteration 0 committed (0.6) before the loss at 1.7
  EXPECT_NEAR(points[0].offset_s, 1.1, 1e-12);
  EXPECT_EQ(points[0].stage, 1);
  EXPECT_EQ(points[1].iteration, 3);  // 0, 1, 2 committed before the loss at 3.1
  EXPECT_NEAR(points[1].offset_s, 0.9, 1e-12);
  EXPECT_EQ(points[1].stage, 2);
}

TEST(sim_validation, trace_at_points_places_failures_on_the_simulators_clock) {
  sim::failure_settings f;
  f.restart_s = 0.2;
  // Iterations of 0.11 s (0.1 + 0.01 stall). The first failure 0.03 s into iteration 5 (which
  // starts at 0.55); the restart ends at 0.78, iterations 5..9 then end at 1.33, and the second
  // failure is 0.02 s into iteration 10.
  const auto trace = trace_at_points({{5, 0.03, 0}, {10, 0.02, 0}}, simple_policy(), f);
  ASSERT_EQ(trace.size(), 2u);
  EXPECT_NEAR(trace[0].time_s, 0.58, 1e-9);
  EXPECT_NEAR(trace[1].time_s, 1.35, 1e-9);
}

}  // namespace

// The baselines: a rollback run's log, the simulator's model of our baselines from a profile,
// and the profile `moevement bench policies --profile-out` writes.
namespace {

std::string iter_stall(long i, double s, double stall) {
  return fmt::format(
      "{{\"kind\":\"iteration\",\"iteration\":{},\"iteration_s\":{},\"stall_s\":{},"
      "\"mean_stage_compute_s\":0.008,\"snapshot_bytes\":10}}",
      i, s, stall);
}

// dense-memory at k = 5: a kill of stage 2 detected in iteration 7; every stage back to 5.
std::vector<stamped> rollback_log() {
  std::vector<stamped> log{
      {0.5,
       R"({"kind":"event","event":"job_start","pp":3,"dp":1,"spares":1,"iterations":10,"micro_batches":4})"},
      {0.6, iter_stall(0, 0.1, 0)},
      {0.6,
       R"({"kind":"event","event":"interval_chosen","interval":5,"snapshot_s":0.002,"profile_iteration_s":0.1,"mtbf_s":3600,"iteration":1})"},
  };
  for (long i = 1; i < 7; ++i)
    log.push_back({0.6 + 0.1 * double(i), iter_stall(i, 0.1, i == 4 ? 0.004 : 0)});
  log.push_back(
      {1.25,
       R"({"kind":"event","event":"worker_lost","node":3,"stage":2,"replica":0,"how":"was lost","iteration":7})"});
  log.push_back(
      {1.26,
       R"({"kind":"event","event":"recovery_start","recovery":"rollback","policy":"dense-memory","stage":2,"replica":0,"target_iteration":7})"});
  log.push_back(
      {1.5,
       R"({"kind":"event","event":"recovery_end","recovery":"rollback","policy":"dense-memory","stage":2,"replica":0,"target_iteration":7,"rollback_to":5,"replay_from":5,"iterations_recomputed":2,"seconds":0.25,"restore_s":0.2,"load_s":0.05})"});
  for (long i = 5; i < 10; ++i)
    log.push_back({1.5 + 0.1 * double(i - 4), iter_stall(i, 0.1, i == 9 ? 0.006 : 0)});
  log.push_back({2.1, R"({"kind":"event","event":"job_end","iterations":10,"state_hash":"cd"})"});
  return log;
}

TEST(sim_validation, a_rollback_log_gives_interval_restart_load_and_the_trace) {
  const run_result r = parse(rollback_log());
  EXPECT_EQ(r.interval, 5);
  EXPECT_DOUBLE_EQ(r.interval_snapshot_s, 0.002);
  EXPECT_EQ(r.micro_batches, 4);
  ASSERT_EQ(r.recoveries.size(), 1u);
  EXPECT_EQ(r.recoveries[0].rollback_to, 5);
  const auto split = split_recovery(r.recoveries[0]);
  EXPECT_DOUBLE_EQ(split.restart_s, 0.2);
  EXPECT_DOUBLE_EQ(split.load_s, 0.05);
  const auto trace = failure_trace(r);
  ASSERT_EQ(trace.size(), 1u);
  EXPECT_DOUBLE_EQ(trace[0].time_s, 1.25 - 0.5);
  EXPECT_EQ(trace[0].stage, 2);
  // Checkpoint iterations 4 and 9 ((i + 1) % 5 == 0), their stalls 0.004 and 0.006.
  EXPECT_DOUBLE_EQ(checkpoint_stall_s({r}), 0.005);
  // Iterations 5 and 6 were recomputed: their last records count.
  const auto own = own_times(r);
  EXPECT_EQ(own.size(), 10u);
}

TEST(sim_validation, moevements_recovery_splits_into_restart_and_pull) {
  const run_result r = parse(two_failure_log());
  const auto a = split_recovery(r.recoveries[1]);  // seconds 0.3, replay 0.125, pull 0.02
  EXPECT_NEAR(a.restart_s, 0.3 - 0.125 - 0.02, 1e-12);
  EXPECT_DOUBLE_EQ(a.load_s, 0.02);
}

// The tiny job, a profile at 0.1 s iterations, a baseline at k = 5.
job_shape tiny_job() {
  job_shape j;
  j.model = models::preset("tiny");
  j.pp = 3;
  j.micro_batches = 4;
  j.micro_batch_size = 4;
  return j;
}

sim::profile_data tiny_profile() {
  sim::profile_data p;
  p.iteration_s = 0.1;
  p.stage_microbatch_s = {0.002, 0.002, 0.002};
  p.snapshot_bytes_per_s_per_gpu = 1e9;
  p.restart_s = 0.2;
  p.snapshot_s = {{"dense-memory", 0.01}, {"dense-disk", 0.01}, {"pec", 0.01}};
  p.load_s = {{"dense-memory", 0.05}, {"dense-disk", 0.05}, {"pec", 0.05}};
  return p;
}

TEST(sim_validation, baselines_take_interval_snapshot_and_load_from_the_profile) {
  sim::failure_settings f;
  f.restart_s = 0.2;
  for (const std::string name : {"dense-memory", "dense-disk", "pec"}) {
    const auto m = sim_policy(tiny_job(), tiny_profile(), name, 5, f);
    EXPECT_EQ(m.interval, 5) << name;
    EXPECT_EQ(m.snapshot_s, 0.01) << name;
    EXPECT_EQ(m.load_s, 0.05) << name;
    EXPECT_EQ(m.restart_s, 0.2) << name;
    EXPECT_EQ(m.iteration_s, 0.1) << name;
    EXPECT_EQ(without_stall(m).stall_s, 0) << name;
  }
  EXPECT_THROW(sim_policy(tiny_job(), tiny_profile(), "dense-memory", 0, f), std::invalid_argument);
}

TEST(sim_validation, a_baseline_rolls_every_stage_back_to_its_newest_checkpoint) {
  sim::failure_settings f;
  f.restart_s = 0.2;
  for (const std::string name : {"dense-memory", "dense-disk", "pec"}) {
    const auto m = without_stall(sim_policy(tiny_job(), tiny_profile(), name, 5, f));
    // Iteration 12 runs 1.2 .. 1.3; the failure at 1.23 aborts it. The checkpoint of state 10
    // (persisted long before) is the newest: back to 10, resume at 1.23 + 0.2 + 0.05, then the
    // 10 iterations 10..19.
    const auto p = predict_fixed_work(m, 20, f, {{1.23, 1}});
    EXPECT_NEAR(p.wall_s, 1.48 + 1.0, 1e-9) << name;
    EXPECT_NEAR(p.ettr, 2.0 / 2.48, 1e-9) << name;
    // 1.005: the checkpoint of state 10 (iteration 9 ended at 1.0) is not persisted yet (its
    // snapshot takes 0.01 s): back to 5, resume at 1.255, then iterations 5..19.
    const auto q = predict_fixed_work(m, 20, f, {{1.005, 1}});
    EXPECT_NEAR(q.wall_s, 1.255 + 1.5, 1e-9) << name;
  }
  // moevement replays the failed stage alone instead: less lost than a rollback.
  const auto moe = without_stall(sim_policy(tiny_job(), tiny_profile(), "moevement", 0, f));
  EXPECT_LT(predict_fixed_work(moe, 20, f, {{1.23, 1}}).wall_s, 2.48);
  // At the W the engine's tuner chose: a failure replays from a window of that W, longer.
  const auto tuned = without_stall(sim_policy(tiny_job(), tiny_profile(), "moevement", 0, f, 9));
  EXPECT_EQ(tuned.w_sparse, 9);
  EXPECT_NE(moe.w_sparse, 9);
  EXPECT_GT(predict_fixed_work(tuned, 20, f, {{1.23, 1}}).wall_s,
            predict_fixed_work(moe, 20, f, {{1.23, 1}}).wall_s);
}

std::vector<stamped> none_log() {
  std::vector<stamped> log{
      {0.1,
       R"({"kind":"event","event":"job_start","pp":3,"dp":1,"spares":1,"iterations":4,"micro_batches":4})"}};
  // Seen 0.05, 0.04, 0.03 and 0.02 s after their own iteration_s: the dispatch gaps.
  for (long i = 0; i < 4; ++i)
    log.push_back({0.1 + 0.15 * double(i + 1), iter(i, 0.1 + 0.01 * double(i))});
  log.push_back({0.8, R"({"kind":"event","event":"job_end","iterations":4,"state_hash":"ab"})"});
  return log;
}

// Under expert parallelism the profile says the EP degree and the all-to-all's share of a
// micro-batch (the longest expert wait per micro-batch), and the simulator takes it only at
// that plan.ep.
TEST(sim_validation, the_policies_bench_profile_carries_expert_parallelism) {
  auto log = none_log();
  log[0].line =
      R"({"kind":"event","event":"job_start","pp":3,"dp":2,"spares":1,"iterations":4,"micro_batches":4,"ep":2})";
  for (std::size_t i = 1; i + 1 < log.size(); ++i) {
    auto& l = log[i].line;
    l.insert(l.size() - 1, ",\"max_expert_wait_s\":" + std::to_string(0.0004 * double(i)));
  }
  const run_result none = parse(log), moe = parse(two_failure_log());
  EXPECT_EQ(none.ep, 2);
  const auto p = policies_profile({none}, {moe}, {moe}, 1, 3);
  EXPECT_EQ(p.ep, 2);
  EXPECT_NEAR(p.alltoall_s, 0.0012 / 4, 1e-12);  // iterations 1..3 wait 0.0008, 0.0012, 0.0016
  EXPECT_EQ(policies_profile({parse(none_log())}, {moe}, {moe}, 1, 3).ep, 0);  // ep 1: not said
  const auto dir = std::filesystem::temp_directory_path() /
                   ("sim_validation_ep_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "profile.toml") << profile_toml(p);
  const std::string config =
      "[model]\npreset = \"gpt-moe\"\n[plan]\npp = 3\ndp = 4\n"
      "[policies]\nlist = [\"moevement\"]\n[profile]\nfile = \"profile.toml\"\n";
  const auto cfg = sim::parse_config(config, {"plan.ep=2", "failures.trials=2"}, dir);
  ASSERT_TRUE(cfg.profile.has_value());
  EXPECT_EQ(cfg.profile->ep, 2);
  EXPECT_EQ(cfg.profile->alltoall_s, p.alltoall_s);
  const auto costs =
      sim::apply_profile(sim::estimate_iteration(cfg.inputs.model, cfg.inputs.cluster,
                                                 cfg.inputs.plan, cfg.inputs.constants, 2),
                         *cfg.profile);
  for (const auto& st : costs.stages) {
    EXPECT_EQ(st.comm_s, p.alltoall_s);
    EXPECT_NEAR(st.compute_s + st.comm_s, st.microbatch_s, 1e-15);
  }
  try {
    (void)sim::parse_config(config, {"plan.ep=4", "failures.trials=2"}, dir);
    ADD_FAILURE() << "a profile measured at ep 2 was taken for plan.ep = 4";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("plan.ep"), std::string::npos) << e.what();
  }
  std::filesystem::remove_all(dir);
}

TEST(sim_validation, the_policies_bench_profile_loads_in_the_simulator_with_its_values) {
  const run_result none = parse(none_log()), moe = parse(two_failure_log());
  const auto p = policies_profile({none}, {moe}, {moe}, 1, 3);
  EXPECT_EQ(p.producer, "moevement bench policies");
  EXPECT_DOUBLE_EQ(p.iteration_s, 0.12);  // median of iterations 1..3: 0.11, 0.12, 0.13
  EXPECT_EQ(p.stage_microbatch_s, std::vector<double>(3, 0.006 / 4));
  EXPECT_DOUBLE_EQ(p.snapshot_bytes_per_s_per_gpu, 2.5e8);
  EXPECT_NEAR(p.persist_lag_s, 0.0375, 1e-12);  // median of 0.05 and 0.025
  // Recoveries: 0.2 - 0 - 0.01 and 0.3 - 0.125 - 0.02; pulls 0.01 and 0.02.
  EXPECT_NEAR(p.restart_s, (0.19 + 0.155) / 2, 1e-12);
  EXPECT_NEAR(p.load_s.at("moevement"), 0.015, 1e-12);
  EXPECT_NEAR(p.policy_restart_s.at("moevement"), (0.19 + 0.155) / 2, 1e-12);  // the median
  EXPECT_NEAR(p.dispatch_s, 0.035, 1e-12);  // mean of none's gaps 0.05, 0.04, 0.03, 0.02
  ASSERT_EQ(p.persist_lag_samples_s.at("moevement").size(), 2u);  // every window, not a median
  EXPECT_THROW(policies_profile({}, {moe}, {}, 1, 3), std::invalid_argument);

  // Through the file `moevement simulate` reads (profile.file), every value bit for bit.
  const auto dir = std::filesystem::temp_directory_path() /
                   ("sim_validation_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir / "profile.toml") << profile_toml(p);
  const auto cfg = sim::parse_config(
      "[model]\npreset = \"gpt-moe\"\n[plan]\npp = 3\ndp = 4\nep = 8\n"
      "[policies]\nlist = [\"dense-memory\", \"moevement\"]\n"
      "[profile]\nfile = \"profile.toml\"\n",
      {"failures.trials=2"}, dir);
  std::filesystem::remove_all(dir);
  ASSERT_TRUE(cfg.profile.has_value());
  const auto& q = *cfg.profile;
  EXPECT_EQ(q.producer, p.producer);
  EXPECT_EQ(q.iteration_s, p.iteration_s);
  EXPECT_EQ(q.stage_microbatch_s, p.stage_microbatch_s);
  EXPECT_DOUBLE_EQ(q.snapshot_bytes_per_s_per_gpu, p.snapshot_bytes_per_s_per_gpu);
  EXPECT_EQ(q.restart_s, p.restart_s);
  EXPECT_EQ(q.persist_lag_s, p.persist_lag_s);
  EXPECT_EQ(q.load_s, p.load_s);
  EXPECT_EQ(q.policy_restart_s, p.policy_restart_s);
  EXPECT_EQ(q.dispatch_s, p.dispatch_s);
  EXPECT_EQ(q.persist_lag_samples_s, p.persist_lag_samples_s);
  EXPECT_EQ(cfg.failures.restart_s, p.restart_s);
  ASSERT_EQ(cfg.policies.size(), 2u);
  EXPECT_LT(cfg.policies[0].load_s, 0);  // dense-memory: not measured, modelled
  EXPECT_EQ(cfg.policies[1].load_s, p.load_s.at("moevement"));
  const auto costs =
      sim::apply_profile(sim::estimate_iteration(cfg.inputs.model, cfg.inputs.cluster,
                                                 cfg.inputs.plan, cfg.inputs.constants, 2),
                         q);
  EXPECT_EQ(costs.iteration_s, p.iteration_s);
  const auto m = sim::build_policy(cfg.inputs, costs, cfg.policies[1], cfg.failures, 3600);
  EXPECT_EQ(m.load_s, p.load_s.at("moevement"));
}

}  // namespace

namespace {

TEST(sim_validation, dense_disk_windows_count_once_every_store_has_their_manifest) {
  namespace fs = std::filesystem;
  const auto dir =
      fs::temp_directory_path() / ("sim_validation_disk_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  for (const char* store : {"stage-0-replica-0", "stage-1-replica-0"})
    fs::create_directories(dir / store / "window-00000000000000000005");
  disk_windows_seen seen;
  watch_disk_windows(dir, 0.5, seen);  // no manifest yet: not a window
  std::ofstream(dir / "stage-0-replica-0" / "window-00000000000000000005" / "MANIFEST") << "m";
  watch_disk_windows(dir, 0.6, seen);
  std::ofstream(dir / "stage-1-replica-0" / "window-00000000000000000005" / "MANIFEST") << "m";
  watch_disk_windows(dir, 0.7, seen);
  watch_disk_windows(dir, 0.8, seen);  // first sight counts
  fs::remove_all(dir);
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_DOUBLE_EQ(seen.at("stage-0-replica-0").at(5), 0.6);
  EXPECT_DOUBLE_EQ(seen.at("stage-1-replica-0").at(5), 0.7);
  // Window 5 is the state after iteration 4, whose record came at 0.6 + 0.1 * 4 = 1.0 in
  // rollback_log(); a window one store never showed is left out.
  const run_result r = parse(rollback_log());
  // Window 7 follows iteration 6, which was recomputed after the rollback: left out too.
  disk_windows_seen s{{"a", {{5, 1.02}, {7, 1.3}, {10, 1.9}}}, {"b", {{5, 1.035}, {7, 1.31}}}};
  const auto lags = disk_persist_lags(r, s);
  ASSERT_EQ(lags.size(), 1u);
  EXPECT_NEAR(lags[0], 0.035, 1e-12);
}

TEST(sim_validation, a_measured_persist_lag_of_a_baseline_decides_its_rollback_point) {
  sim::failure_settings f;
  f.restart_s = 0.2;
  auto prof = tiny_profile();
  prof.policy_persist_lag_s = {{"dense-disk", 0.25}};
  const auto back = sim::parse_profile(profile_toml(prof));
  EXPECT_EQ(back.policy_persist_lag_s, prof.policy_persist_lag_s);
  const auto m = without_stall(sim_policy(tiny_job(), prof, "dense-disk", 5, f));
  EXPECT_EQ(m.persist_lag_s, 0.25);
  // The failure at 1.23 comes 0.23 s after the checkpoint of state 10: not on disk yet, back
  // to 5: resume at 1.48, then iterations 5..19.
  EXPECT_NEAR(predict_fixed_work(m, 20, f, {{1.23, 1}}).wall_s, 1.48 + 1.5, 1e-9);
  // dense-memory keeps its modelled lag (its snapshot time).
  EXPECT_EQ(sim_policy(tiny_job(), prof, "dense-memory", 5, f).persist_lag_s, 0.01);
}

}  // namespace

// The persist lag as a distribution: the measured lags travel in the profile, and the
// prediction is the expectation over them.
namespace {

TEST(sim_validation, persist_lag_samples_round_trip_and_older_profiles_still_load) {
  auto prof = tiny_profile();
  prof.policy_persist_lag_s = {{"dense-disk", 0.001}};
  prof.persist_lag_samples_s = {{"dense-disk", {0.001, 1.0 / 3.0, 0.001, 0.25}}};
  const auto back = sim::parse_profile(profile_toml(prof));
  EXPECT_EQ(back.persist_lag_samples_s, prof.persist_lag_samples_s);  // bit-exact, in order
  // A format 1 file written before the samples existed reads as before: no distribution.
  const auto old = sim::parse_profile(
      "[profile]\nformat_version = 1\niteration_s = 0.1\n"
      "[profile.policy_persist_lag_s]\ndense-disk = 0.007\n");
  EXPECT_TRUE(old.persist_lag_samples_s.empty());
  EXPECT_EQ(old.policy_persist_lag_s.at("dense-disk"), 0.007);
  EXPECT_THROW(sim::parse_profile("[profile]\nformat_version = 1\n"
                                  "[profile.persist_lag_samples_s]\ndense-disk = [0.1, -1.0]\n"),
               std::invalid_argument);
  sim::failure_settings f;
  const auto m = sim_policy(tiny_job(), prof, "dense-disk", 5, f);
  EXPECT_EQ(m.persist_lag_s, 0.001);  // the single value stays the given median
  EXPECT_EQ(m.persist_lag_samples_s, (std::vector<double>{0.001, 0.001, 0.25, 1.0 / 3.0}));
  // Without a single value, the samples' median.
  prof.policy_persist_lag_s.clear();
  EXPECT_EQ(sim_policy(tiny_job(), prof, "dense-disk", 5, f).persist_lag_s, 0.5 * (0.001 + 0.25));
  // Policies without samples keep their single lag.
  EXPECT_TRUE(sim_policy(tiny_job(), prof, "dense-memory", 5, f).persist_lag_samples_s.empty());
}

TEST(sim_validation, the_prediction_is_the_expectation_over_the_measured_lags) {
  sim::failure_settings f;
  f.restart_s = 0.2;
  auto prof = tiny_profile();
  // Three checkpoints on disk 1 ms after their iteration, one 0.25 s after.
  prof.persist_lag_samples_s = {{"dense-disk", {0.001, 0.25, 0.001, 0.001}}};
  const auto m = without_stall(sim_policy(tiny_job(), prof, "dense-disk", 5, f));
  const auto trace = [](const sim::policy_model&) {
    return std::vector<sim::failure_event>{{1.23, 1}};
  };
  // The failure at 1.23 comes 0.23 s after the checkpoint of state 10: on disk with probability
  // 3/4 (back to 10: resume at 1.48, then 10 iterations), else back to 5 (then 15 iterations).
  const auto p = predict_over_lags(m, 20, f, trace);
  EXPECT_NEAR(p.wall_s, 0.75 * (1.48 + 1.0) + 0.25 * (1.48 + 1.5), 1e-9);
  EXPECT_NEAR(p.ettr, 2.0 / p.wall_s, 1e-12);
  EXPECT_NEAR(p.time_lost_s, p.wall_s - 2.0, 1e-12);
  EXPECT_DOUBLE_EQ(p.failures, 1);
  // The median alone (1 ms) predicts the short rollback every time.
  auto median_only = m;
  median_only.persist_lag_samples_s.clear();
  EXPECT_NEAR(predict_over_lags(median_only, 20, f, trace).wall_s, 2.48, 1e-9);
  // The closed form's penalty is the same expectation: E[min(lag, k T)].
  EXPECT_NEAR(sim::expected_persist_penalty_s(m, 0.5), (3 * 0.001 + 0.25) / 4, 1e-15);
  EXPECT_NEAR(sim::expected_persist_penalty_s(m, 0.1), (3 * 0.001 + 0.1) / 4, 1e-15);
}

}  // namespace

// The coordinator's time between iterations: measured from the log, carried by the profile,
// wall time per iteration in the prediction.
namespace {

TEST(sim_validation, dispatch_gaps_are_the_time_between_iterations_outside_them) {
  const std::vector<stamped> log{
      {0.5, R"({"kind":"event","event":"job_start","pp":3,"dp":1,"spares":1,"iterations":4})"},
      {0.602, iter(0, 0.1)},  // 2 ms after job_start beyond its own 0.1 s
      {0.703, iter(1, 0.1)},  // 1 ms
      {0.75,
       R"({"kind":"event","event":"worker_lost","node":3,"stage":2,"replica":0,"how":"was lost","iteration":2})"},
      {0.9,
       R"({"kind":"event","event":"recovery_end","recovery":"rollback","policy":"dense-memory","stage":2,"replica":0,"target_iteration":2,"rollback_to":0,"seconds":0.1,"restore_s":0.08,"load_s":0.02})"},
      {1.0, iter(0, 0.095)},  // after a recovery: recovery time, not dispatch
      {1.104, iter(1, 0.1)},  // 4 ms
      {1.2, R"({"kind":"event","event":"job_end","iterations":2,"state_hash":"ab"})"},
  };
  const auto gaps = dispatch_gaps(parse(log));
  ASSERT_EQ(gaps.size(), 3u);
  EXPECT_NEAR(gaps[0], 0.002, 1e-12);
  EXPECT_NEAR(gaps[1], 0.001, 1e-12);
  EXPECT_NEAR(gaps[2], 0.004, 1e-12);

  auto prof = tiny_profile();
  prof.dispatch_s = 0.0005;
  EXPECT_EQ(sim::parse_profile(profile_toml(prof)).dispatch_s, 0.0005);
  EXPECT_LT(sim::parse_profile(profile_toml(tiny_profile())).dispatch_s, 0);  // not measured
  sim::failure_settings f;
  f.restart_s = 0.2;
  const auto m = without_stall(sim_policy(tiny_job(), prof, "dense-memory", 5, f));
  EXPECT_EQ(m.dispatch_s, 0.0005);
  // Every iteration takes 0.1 s of training and 0.5 ms of dispatch: 20 of them, no failure.
  const auto p = predict_fixed_work(m, 20, f, {});
  EXPECT_NEAR(p.wall_s, 20 * 0.1005, 1e-9);
  EXPECT_NEAR(p.ettr, 0.1 / 0.1005, 1e-9);
  // The closed form counts it as overhead per iteration.
  const auto cf = sim::evaluate_closed_form(m, 1e12, 3600);
  EXPECT_NEAR(cf.overhead_s_per_iter, 0.0005, 1e-15);
}

}  // namespace

namespace {

TEST(sim_validation, lost_time_splits_into_parts_that_add_up) {
  // rollback_log(): job_start at 0.5, iterations 0..6 seen at 0.6 + 0.1 i (0.1 s each: no
  // gap), the loss at 1.25, recovery_end at 1.5, iterations 5..9 redone, seen at 1.6 .. 2.0.
  const run_result r = parse(rollback_log());
  const auto sp = split_lost_time(r);
  EXPECT_NEAR(sp.dispatch_s, 0.0, 1e-9);
  EXPECT_NEAR(sp.aborted_s, 0.05, 1e-9);    // record 6 at 1.2, the loss at 1.25
  EXPECT_NEAR(sp.recovery_s, 0.25, 1e-9);   // to recovery_end at 1.5
  EXPECT_NEAR(sp.resume_gap_s, 0.0, 1e-9);  // record 5 at 1.6 after its 0.1 s
  EXPECT_NEAR(sp.lost_work_s, 0.2, 1e-9);   // first attempts of 5 and 6
  EXPECT_EQ(sp.lost_iterations, 2);
  double own = 0;
  for (const auto& [i, v] : own_times(r)) own += v;
  EXPECT_NEAR(sp.total(), (r.t_last_iteration - r.t_start) - own, 1e-9);
}

}  // namespace

namespace {

TEST(sim_validation, a_policys_own_restart_replaces_the_common_one) {
  auto prof = tiny_profile();
  prof.policy_restart_s = {{"dense-memory", 0.03}, {"moevement", 0.006}};
  const auto back = sim::parse_profile(profile_toml(prof));
  EXPECT_EQ(back.policy_restart_s, prof.policy_restart_s);
  sim::failure_settings f;
  f.restart_s = 0.2;
  EXPECT_EQ(sim_policy(tiny_job(), prof, "dense-memory", 5, f).restart_s, 0.03);
  EXPECT_EQ(sim_policy(tiny_job(), prof, "moevement", 0, f).restart_s, 0.006);
  EXPECT_EQ(sim_policy(tiny_job(), prof, "pec", 5, f).restart_s, 0.2);  // none of its own
}

}  // namespace

namespace {

TEST(sim_validation, a_measured_restart_per_failed_stage_replaces_the_common_one) {
  EXPECT_EQ(parse(rollback_log()).recoveries.at(0).stage, 2);
  sim::failure_settings f;
  f.restart_s = 0.2;
  auto m = without_stall(sim_policy(tiny_job(), tiny_profile(), "dense-memory", 5, f));
  m.stage_restart_s = {0.4, -1, 0.1};  // stage 1: not measured, the common 0.2
  // As in a_baseline_rolls_every_stage_back_to_its_newest_checkpoint: back to 10 at 1.23, then
  // restart, load 0.05 and the 10 iterations 10..19.
  EXPECT_NEAR(predict_fixed_work(m, 20, f, {{1.23, 0}}).wall_s, 1.23 + 0.4 + 0.05 + 1.0, 1e-9);
  EXPECT_NEAR(predict_fixed_work(m, 20, f, {{1.23, 1}}).wall_s, 1.23 + 0.2 + 0.05 + 1.0, 1e-9);
  EXPECT_NEAR(predict_fixed_work(m, 20, f, {{1.23, 2}}).wall_s, 1.23 + 0.1 + 0.05 + 1.0, 1e-9);
  EXPECT_EQ(sim::restart_for(m, 7), 0.2);
  // The closed form's failed stage is uniform: the mean restart over the stages.
  auto common = m;
  common.stage_restart_s.clear();
  EXPECT_NEAR(sim::evaluate_closed_form(m, 3600, 3600).expected_recovery_s -
                  sim::evaluate_closed_form(common, 3600, 3600).expected_recovery_s,
              (0.4 + 0.2 + 0.1) / 3 - 0.2, 1e-12);
}

}  // namespace
