// bench/run_log_stats.hpp: the run log records the policies/recovery benchmark reads, and its
// ETTR definition, on hand-written logs.
#include "bench/run_log_stats.hpp"

#include <gtest/gtest.h>

#include <map>
#include <stdexcept>
#include <vector>

namespace {

using namespace moevement::bench;

std::string iter(long i, double s) {
  return fmt::format(
      "{{\"kind\":\"iteration\",\"iteration\":{},\"loss\":2.5,\"iteration_s\":{},"
      "\"snapshot_bytes\":1000,\"stall_s\":0.001,\"snapshot_host_bytes\":300,"
      "\"log_host_bytes\":40,\"replication_lag\":1}}",
      i, s);
}

TEST(run_log_stats, parses_the_records_the_benchmark_needs) {
  const std::vector<stamped> log{
      {0.1, R"({"kind":"event","event":"job_start","pp":3,"dp":1,"spares":1,"iterations":3})"},
      {0.2, iter(0, 0.5)},
      {0.2,
       R"({"kind":"event","event":"window_chosen","w_sparse":2,"profile_iteration_s":0.5,"profile_bandwidth":1e9,"iteration":1})"},
      {0.3, iter(1, 0.25)},
      {0.4,
       R"({"kind":"event","event":"recovery_start","stage":1,"replica":0,"lost_node":2,"spare_node":4,"target_iteration":2,"window":0,"replay_from":1})"},
      {0.5,
       R"({"kind":"event","event":"recovery_end","stage":1,"replica":0,"spare_node":4,"target_iteration":2,"seconds":0.125})"},
      {0.6, iter(2, 0.25)},
      {0.7, R"({"kind":"event","event":"job_end","iterations":3,"state_hash":"00ff00ff00ff00ff"})"},
  };
  const run_result r = parse(log);
  ASSERT_EQ(r.iterations.size(), 3u);
  EXPECT_EQ(r.iterations[1].iteration, 1);
  EXPECT_DOUBLE_EQ(r.iterations[1].seconds, 0.25);
  EXPECT_DOUBLE_EQ(r.iterations[1].snapshot_bytes, 1000);
  EXPECT_DOUBLE_EQ(r.iterations[1].host_bytes, 340);
  EXPECT_DOUBLE_EQ(r.iterations[1].stall_s, 0.001);
  EXPECT_EQ(r.w_sparse, 2);
  EXPECT_EQ(r.window_chosen_at, 1);
  EXPECT_EQ(counted_from({r}), 5);  // the first two windows (the warm-up): iterations 1..4
  EXPECT_TRUE(r.recovered);
  EXPECT_DOUBLE_EQ(r.recovery_s, 0.125);
  EXPECT_EQ(r.target - r.replay_from, 1);
  EXPECT_EQ(r.window, 0);
  EXPECT_EQ(r.state_hash, "00ff00ff00ff00ff");
  EXPECT_DOUBLE_EQ(r.t_end - r.t_start, 0.6);
  EXPECT_DOUBLE_EQ(r.t_recovery_end - r.t_recovery_start, 0.1);
  // W re-chosen mid-run: the run's W is the last, counted from a window of it after the change.
  auto tuned = log;
  tuned.insert(
      tuned.begin() + 4,
      {0.35, R"({"kind":"event","event":"window_tuned","w_sparse":8,"previous":2,"iteration":5})"});
  tuned.insert(
      tuned.begin() + 5,
      {0.36,
       R"({"kind":"event","event":"window_tuned","w_sparse":8,"previous":8,"iteration":13})"});
  const run_result t = parse(tuned);
  EXPECT_EQ(t.w_first, 2);
  EXPECT_EQ(t.w_sparse, 8);
  EXPECT_EQ(t.w_changed_at, 5) << "a decision that kept W changes nothing";
  EXPECT_EQ(counted_from({t}), 13);
  // Iteration 2's record came 0.3 s after iteration 1's; fault-free it takes 0.25 s.
  EXPECT_NEAR(time_lost(r, {{0, 0.5}, {1, 0.25}, {2, 0.25}}), 0.05, 1e-12);
}

TEST(run_log_stats, a_failed_or_unfinished_job_is_an_error) {
  EXPECT_THROW(parse({{0.1, R"({"kind":"event","event":"job_start"})"}, {0.2, iter(0, 1)}}),
               std::runtime_error);
  EXPECT_THROW(parse({{0.1, R"({"kind":"event","event":"job_start"})"},
                      {0.2, R"({"kind":"event","event":"job_failed","message":"x"})"}}),
               std::runtime_error);
}

TEST(run_log_stats, ettr_counts_each_committed_iteration_once_at_its_fault_free_time) {
  run_result a, b;
  for (long i = 0; i < 3; ++i) {
    a.iterations.push_back({i, 1.0 + double(i), 0, 0, 0, 0});
    b.iterations.push_back({i, 3.0 + double(i), 0, 0, 0, 0});
  }
  const auto ff = per_index({a, b, a});  // median per index: 1, 2, 3
  EXPECT_DOUBLE_EQ(ff.at(0), 1.0);
  EXPECT_DOUBLE_EQ(ff.at(2), 3.0);
  run_result faulty;
  faulty.t_start = 10;
  faulty.t_end = 22;
  // Iteration 1 recorded twice (attempted again after a failure): it counts once.
  for (long i : {0L, 1L, 1L, 2L}) faulty.iterations.push_back({i, 100.0, 0, 0, 0, 0});
  EXPECT_DOUBLE_EQ(ettr(faulty, ff), 6.0 / 12.0);
  faulty.iterations.push_back({7, 1.0, 0, 0, 0, 0});  // no fault-free time for it
  EXPECT_THROW(ettr(faulty, ff), std::runtime_error);
}

TEST(run_log_stats, median_and_mean) {
  EXPECT_DOUBLE_EQ(median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(median({4, 1, 3, 2}), 2.5);
  EXPECT_DOUBLE_EQ(median({}), 0);
  EXPECT_DOUBLE_EQ(mean({1, 2, 6}), 3);
}

}  // namespace
