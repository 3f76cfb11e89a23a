#include "base/cores.hpp"

#include <gtest/gtest.h>
#include <sched.h>

#include <thread>

namespace moevement::base {
namespace {

// The affinity mask bounds the count, not the machine: pinned to one CPU, one core.
TEST(cores, usable_cores_follow_the_affinity_mask) {
  cpu_set_t saved;
  ASSERT_EQ(::sched_getaffinity(0, sizeof saved, &saved), 0);
  EXPECT_EQ(usable_cores(), CPU_COUNT(&saved));
  EXPECT_LE(usable_cores(), int(std::max(1u, std::thread::hardware_concurrency())));
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(::sched_getcpu(), &one);
  ASSERT_EQ(::sched_setaffinity(0, sizeof one, &one), 0);
  EXPECT_EQ(usable_cores(), 1);
  ASSERT_EQ(::sched_setaffinity(0, sizeof saved, &saved), 0);
}

}  // namespace
}  // namespace moevement::base
