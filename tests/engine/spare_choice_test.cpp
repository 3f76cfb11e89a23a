// Which spare takes a lost worker's role (engine/spare_choice.hpp; linked into
// snapshot_placement_test).
#include "engine/spare_choice.hpp"

#include <gtest/gtest.h>

namespace moevement::engine {
namespace {

std::map<transport::node_id, worker_info> cluster() {
  // Workers 1-2 hold roles; spares 3 and 4 share host a with worker 1, spare 5 is on host b.
  std::map<transport::node_id, worker_info> w;
  const auto add = [&](transport::node_id n, const char* domain, int stage) {
    w[n].node = n;
    w[n].domain = domain;
    w[n].stage = stage;
    w[n].replica = stage < 0 ? -1 : 0;
  };
  add(1, "a", 0);
  add(2, "b", 1);
  add(3, "a", -1);
  add(4, "a", -1);
  add(5, "b", -1);
  return w;
}

const auto anyone = [](transport::node_id) { return true; };

TEST(spare_choice, a_spare_on_another_host_than_the_lost_worker_comes_first) {
  EXPECT_EQ(choose_spare(cluster(), "a", anyone), 5u) << "not 3: the host that lost worker 1";
  EXPECT_EQ(choose_spare(cluster(), "b", anyone), 3u);
  EXPECT_EQ(choose_spare(cluster(), "", anyone), 3u) << "no domain known: the lowest";
}

TEST(spare_choice, the_same_host_when_no_other_is_usable_and_none_when_no_spare_is) {
  const auto not_5 = [](transport::node_id n) { return n != 5; };
  EXPECT_EQ(choose_spare(cluster(), "a", not_5), 3u);
  EXPECT_EQ(choose_spare(cluster(), "a", [](transport::node_id n) { return n == 4; }), 4u);
  EXPECT_EQ(choose_spare(cluster(), "a", [](transport::node_id) { return false; }), 0u);
  auto busy = cluster();
  for (auto& [n, w] : busy) w.stage = std::max(w.stage, 0);
  EXPECT_EQ(choose_spare(busy, "a", anyone), 0u) << "every worker holds a role";
}

}  // namespace
}  // namespace moevement::engine
