// Snapshot copies survive a lost host and any contiguous run of up to half the pipeline, on
// every small shape; placement is deterministic and spreads the copies.
#include "engine/snapshot_placement.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <string>

namespace moevement::engine {
namespace {

// Workers 1..pp*dp (node n: stage (n-1) % pp, replica (n-1) / pp, as the coordinator numbers
// them), then spares; `per_domain` consecutive nodes share a domain (0: one domain for all).
std::vector<placement_candidate> shape(int pp, int dp, int spares, int per_domain) {
  std::vector<placement_candidate> w;
  const int total = pp * dp + spares;
  for (int i = 0; i < total; ++i) {
    placement_candidate c;
    c.node = transport::node_id(i + 1);
    c.stage = i < pp * dp ? i % pp : -1;
    c.domain = per_domain == 0 ? "host" : "node" + std::to_string(i / per_domain);
    w.push_back(c);
  }
  return w;
}

void check(int pp, int dp, int spares, int per_domain, int copies) {
  SCOPED_TRACE(testing::Message() << "pp=" << pp << " dp=" << dp << " spares=" << spares
                                  << " per_domain=" << per_domain << " copies=" << copies);
  const auto workers = shape(pp, dp, spares, per_domain);
  const auto placed = place_snapshot_copies(workers, pp, copies);
  std::map<transport::node_id, placement_candidate> by_node;
  for (const auto& w : workers) by_node[w.node] = w;
  std::map<transport::node_id, int> load;
  for (const auto& owner : workers) {
    if (owner.stage < 0) {
      EXPECT_FALSE(placed.contains(owner.node)) << "a spare has nothing to copy";
      continue;
    }
    ASSERT_TRUE(placed.contains(owner.node));
    const auto& holders = placed.at(owner.node);
    const int others = int(workers.size()) - 1;
    ASSERT_EQ(int(holders.size()), std::min(copies, others));
    std::set<transport::node_id> distinct(holders.begin(), holders.end());
    EXPECT_EQ(distinct.size(), holders.size());
    EXPECT_FALSE(distinct.contains(owner.node));
    for (auto h : holders) ++load[h];
    if (holders.empty()) continue;

    bool any_both = false, any_other_domain = false;
    for (const auto& c : workers) {
      if (c.node == owner.node) continue;
      const bool other = c.domain != owner.domain, safe = run_safe(owner.stage, c.stage, pp);
      any_both = any_both || (other && safe);
      any_other_domain = any_other_domain || other;
    }
    // A lost host: the owner's domain goes; some copy is elsewhere.
    if (any_other_domain && (copies >= 2 || any_both)) {
      EXPECT_TRUE(std::any_of(holders.begin(), holders.end(),
                              [&](auto h) { return by_node[h].domain != owner.domain; }))
          << "stage " << owner.stage << " on node " << owner.node << ": every copy on its host";
    }
    // Every contiguous run of up to floor(pp/2) stages containing the owner's (in every
    // replica at once): some copy outlives it.
    if (copies >= 2 || per_domain == 0 || any_both) {
      for (int len = 1; len <= pp / 2; ++len) {
        for (int a = std::max(0, owner.stage - len + 1); a <= owner.stage && a + len <= pp; ++a) {
          EXPECT_TRUE(std::any_of(holders.begin(), holders.end(),
                                  [&](auto h) {
                                    const int t = by_node[h].stage;
                                    return t < a || t >= a + len;
                                  }))
              << "stages " << a << ".." << a + len - 1 << " take every copy of stage "
              << owner.stage << " on node " << owner.node;
        }
      }
    }
  }
  // Spread: on one host nobody holds more than 2 x copies.
  if (per_domain == 0) {
    for (const auto& [node, n] : load) EXPECT_LE(n, 2 * copies) << "node " << node;
  }
  // Deterministic, whatever order the workers are given in.
  auto shuffled = workers;
  std::mt19937 rng(7);
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  EXPECT_EQ(place_snapshot_copies(shuffled, pp, copies), placed);
}

TEST(snapshot_placement, copies_survive_a_host_and_half_the_pipeline_on_every_small_shape) {
  int checked = 0;
  for (int pp = 1; pp <= 8; ++pp) {
    for (int dp = 1; dp <= 3; ++dp) {
      for (int spares = 0; spares <= 2; ++spares) {
        for (int per_domain : {0, 1, 2, 3, 4}) {
          for (int copies = 1; copies <= 3; ++copies) {
            check(pp, dp, spares, per_domain, copies);
            ++checked;
            if (::testing::Test::HasFailure()) return;
          }
        }
      }
    }
  }
  EXPECT_EQ(checked, 8 * 3 * 3 * 5 * 3);
}

TEST(snapshot_placement, half_of_six_stages_lost_leaves_a_copy_of_each) {
  // pp = 6, r = 2: the copies of stage 1 are not both on stages 2 and 3 (the next workers),
  // which a loss of stages 1..3 would take with it.
  const auto placed = place_snapshot_copies(shape(6, 1, 3, 0), 6, 2);
  for (transport::node_id owner = 1; owner <= 6; ++owner) {
    const int s = int(owner) - 1;
    const auto& h = placed.at(owner);
    ASSERT_EQ(h.size(), 2u);
    EXPECT_TRUE(std::any_of(h.begin(), h.end(),
                            [&](auto n) { return n > 6 || std::abs(int(n) - 1 - s) >= 3; }))
        << "stage " << s;
  }
}

TEST(snapshot_placement, run_safety) {
  EXPECT_TRUE(run_safe(0, -1, 4));  // spares are in no run
  EXPECT_FALSE(run_safe(1, 2, 4));
  EXPECT_TRUE(run_safe(1, 3, 4));
  EXPECT_TRUE(run_safe(0, 0, 1));  // one stage: a run of 0
  EXPECT_FALSE(run_safe(2, 2, 2));
  EXPECT_TRUE(run_safe(0, 1, 3));
}

TEST(snapshot_placement, fewer_workers_than_copies) {
  const auto placed = place_snapshot_copies(shape(1, 1, 1, 0), 1, 3);
  EXPECT_EQ(placed.at(1), (std::vector<transport::node_id>{2}));
  EXPECT_TRUE(place_snapshot_copies(shape(1, 1, 0, 0), 1, 2).at(1).empty());
}

}  // namespace
}  // namespace moevement::engine
