#include "actors/actor_ref.hpp"

#include <gtest/gtest.h>

namespace moevement::actors {
namespace {

TEST(actor_ref, incarnation_distinguishes_refs) {
  const actor_ref old_ref{3, 1, 42};
  const actor_ref new_ref{3, 2, 42};
  EXPECT_NE(old_ref, new_ref);
  EXPECT_TRUE(old_ref.same_slot(new_ref));
  EXPECT_EQ(old_ref.to_string(), "3.1/42");
}

TEST(actor_ref, round_trips_through_the_wire_address) {
  const actor_ref r{7, 9, 1234567890123ull};
  EXPECT_EQ(actor_ref::from(r.address()), r);
  EXPECT_FALSE(actor_ref{}.valid());
  EXPECT_TRUE(r.valid());
}

}  // namespace
}  // namespace moevement::actors
