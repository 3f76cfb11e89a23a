// The worker agent's rules for a Restore while it holds a role, and for a second Assign to a
// spare (linked into stage_actor_test).
#include "engine/worker_agent.hpp"

#include <gtest/gtest.h>

namespace moevement::engine {
namespace {

// A survivor that has held stage 1 replica 1 since the start (never restored: generation 0)
// takes a Restore of its own role under any generation: a group one, a durable one, or a plain
// one (its region grew, under ep > 1 without a pipelined replay, before its first Restore went
// out). It used to drop the plain one, and the recovery waited on it for ever.
TEST(worker_agent, a_survivor_takes_a_restore_of_its_own_role_under_a_newer_generation) {
  EXPECT_TRUE(worker_agent::takes_restore(1, 1, 0, 1, 1, 2));
  EXPECT_TRUE(worker_agent::takes_restore(1, 1, 3, 1, 1, 4));
  EXPECT_FALSE(worker_agent::takes_restore(1, 1, 3, 1, 1, 3)) << "the same generation again";
  EXPECT_FALSE(worker_agent::takes_restore(1, 1, 3, 1, 1, 2)) << "an older generation";
  EXPECT_FALSE(worker_agent::takes_restore(1, 1, 0, 2, 1, 2)) << "another stage's role";
  EXPECT_FALSE(worker_agent::takes_restore(1, 1, 0, 1, 0, 2)) << "another replica's role";
}

// A spare given the role of a worker lost before training started: only by its own head, only
// while it holds no role and no stage and was never restored (then it is a recovery's, and
// roles come by Restore).
TEST(worker_agent, a_spare_takes_a_role_from_its_own_head_before_training) {
  EXPECT_TRUE(worker_agent::takes_role_before_training(true, -1, false, false, 2));
  EXPECT_FALSE(worker_agent::takes_role_before_training(false, -1, false, false, 2))
      << "another head: a standby that took over (its own rule)";
  EXPECT_FALSE(worker_agent::takes_role_before_training(true, 1, false, false, 2))
      << "holds a role already";
  EXPECT_FALSE(worker_agent::takes_role_before_training(true, -1, true, false, 2))
      << "runs a stage";
  EXPECT_FALSE(worker_agent::takes_role_before_training(true, -1, false, true, 2))
      << "restored by a recovery";
  EXPECT_FALSE(worker_agent::takes_role_before_training(true, -1, false, false, -1))
      << "no role given";
}

}  // namespace
}  // namespace moevement::engine
