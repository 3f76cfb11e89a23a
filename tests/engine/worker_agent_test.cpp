// The worker agent's rule for a Restore while it holds a role (linked into stage_actor_test).
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

}  // namespace
}  // namespace moevement::engine
