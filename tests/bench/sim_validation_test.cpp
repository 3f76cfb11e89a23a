// bench/sim_validation.hpp: what `moevement bench simvalidate` hands the simulator. The profile it
// writes reads back through the simulator's own parser with the same values, the failure trace
// built from a run log has the failures' times and stages, and the fixed-work prediction agrees
// with hand-computed runs. No timing of this machine is involved.
#include "bench/sim_validation.hpp"

#include <gtest/gtest.h>

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
  p.snapshot_s = {{"dense-memory", 0.5}, {"pec", 0.0625}};
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
  EXPECT_EQ(q.snapshot_s, p.snapshot_s);
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
