// The compute thread's state as the head's stuck-stage probe reads it (engine/compute_watch.hpp).
#include "engine/compute_watch.hpp"

#include <gtest/gtest.h>

#include <thread>

namespace moevement::engine {
namespace {

using state = compute_watch::state;

TEST(compute_watch, a_task_computes_and_a_wait_for_peers_within_it_is_told_apart) {
  compute_watch w;
  EXPECT_EQ(w.read().now, state::idle);
  w.set_epoch(7);
  {
    const compute_watch::task busy(&w);
    EXPECT_EQ(w.read().now, state::computing);
    {
      const compute_watch::peer_wait waiting(&w);
      EXPECT_EQ(w.read().now, state::waiting);
    }
    // Back to its own work: the time counts from the wait's end, not the task's start.
    std::this_thread::sleep_for(std::chrono::milliseconds(30));
    const auto v = w.read();
    EXPECT_EQ(v.now, state::computing);
    EXPECT_GE(v.for_s, 0.02);
    EXPECT_EQ(v.epoch, 7u);
  }
  EXPECT_EQ(w.read().now, state::idle);
  EXPECT_LT(w.read().for_s, 1.0);
  // No watch: the scopes do nothing.
  const compute_watch::task none(nullptr);
  const compute_watch::peer_wait none_waiting(nullptr);
}

TEST(compute_watch, a_task_that_never_returns_keeps_computing_from_its_last_wait) {
  compute_watch w;
  {
    const compute_watch::task busy(&w);
    { const compute_watch::peer_wait waiting(&w); }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const auto first = w.read();
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    const auto later = w.read();
    EXPECT_EQ(later.now, state::computing);
    EXPECT_GT(later.for_s, first.for_s) << "its time grows while it runs";
  }
}

}  // namespace
}  // namespace moevement::engine
