// Algorithm 1's inputs: on the CPU the snapshot copies get the host's idle core time, on a
// device the whole iteration; the slowest host and copy decide.
#include "engine/window_budget.hpp"

#include <gtest/gtest.h>

namespace moevement::engine {
namespace {

TEST(window_budget, on_the_cpu_the_copies_get_the_idle_core_time) {
  // 2 cores x 0.4 s, three stages computed 0.2 s each: 0.2 core-s idle over 4 processes.
  const std::vector<host_load> hosts = {{2, 4, {0.2, 0.2, 0.2}, 3e9}};
  const auto in = window_budget(hosts, 0.4, 2, true);
  EXPECT_DOUBLE_EQ(in.seconds, 0.05);
  EXPECT_DOUBLE_EQ(in.bandwidth, 1e9);  // each byte copied 1 + r = 3 times
}

TEST(window_budget, on_a_device_the_iteration_is_the_budget) {
  const std::vector<host_load> hosts = {{2, 4, {0.2, 0.2, 0.2}, 3e9}};
  const auto in = window_budget(hosts, 0.4, 2, false);
  EXPECT_DOUBLE_EQ(in.seconds, 0.4);
  EXPECT_DOUBLE_EQ(in.bandwidth, 0.5e9);  // 4 processes take turns on 2 cores
}

TEST(window_budget, a_busy_host_leaves_no_time_and_the_slowest_host_decides) {
  const std::vector<host_load> hosts = {{8, 2, {0.1, 0.1}, 4e9}, {2, 3, {0.3, 0.3, 0.3}, 2e9}};
  const auto in = window_budget(hosts, 0.4, 1, true);
  EXPECT_DOUBLE_EQ(in.seconds, 0.0);  // 0.8 core-s, 0.9 computed
  EXPECT_DOUBLE_EQ(in.bandwidth, 1e9);
  const std::vector<host_load> idle = {{8, 2, {0.1, 0.1}, 4e9}, {4, 3, {0.3, 0.3, 0.3}, 2e9}};
  EXPECT_DOUBLE_EQ(window_budget(idle, 0.4, 1, true).seconds, (1.6 - 0.9) / 3);
}

TEST(window_budget, hosts_without_stages_or_measurements_are_ignored) {
  EXPECT_DOUBLE_EQ(window_budget({}, 0.4, 2, true).bandwidth, 0.0);
  const std::vector<host_load> spare_only = {{2, 1, {}, 3e9}, {2, 1, {0.1}, 0}};
  const auto in = window_budget(spare_only, 0.4, 2, true);
  EXPECT_DOUBLE_EQ(in.bandwidth, 0.0);
  EXPECT_DOUBLE_EQ(in.seconds, 0.0);
}

}  // namespace
}  // namespace moevement::engine
