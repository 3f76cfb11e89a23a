// The head's comparison of a stage's replicas (engine/replica_check.hpp): equal digests pass,
// a strict majority names the replicas outside it, two copies (or a tie) name none, and under
// expert parallelism an expert is compared only among the replicas holding its shard.
#include "engine/replica_check.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace {

using moevement::engine::bad_replicas;
using moevement::engine::compare_replicas;
using moevement::engine::describe;
using moevement::engine::divergence;
using moevement::engine::replica_report;

// reports[d * pp + s]
std::vector<replica_report> same(int pp, int dp, std::size_t ops) {
  std::vector<replica_report> r(std::size_t(pp * dp));
  for (int d = 0; d < dp; ++d) {
    for (int s = 0; s < pp; ++s) {
      for (std::size_t i = 0; i < ops; ++i)
        r[std::size_t(d * pp + s)].digests.push_back(100 * s + i);
    }
  }
  return r;
}

TEST(replica_check, equal_replicas_pass) {
  const auto r = same(2, 3, 4);
  EXPECT_TRUE(compare_replicas(2, 3, 1, r).empty());
}

TEST(replica_check, a_majority_names_the_replica_outside_it) {
  auto r = same(2, 3, 4);
  r[std::size_t(2 * 2 + 1)].digests[3] ^= 1;  // stage 1, replica 2, operator 3
  const auto found = compare_replicas(2, 3, 1, r);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].stage, 1);
  EXPECT_EQ(found[0].op, 3u);
  EXPECT_EQ(found[0].replicas, (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(found[0].bad, (std::vector<int>{2}));
  EXPECT_EQ(bad_replicas(found), (std::vector<std::pair<int, int>>{{1, 2}}));
  const std::vector<std::string> names{"a", "b", "c", "layer2.attention"};
  EXPECT_EQ(describe(found[0], names),
            "stage 1 operator 3 (layer2.attention): copies on replicas 0, 1, 2; replica 2 differs "
            "from the majority");
}

TEST(replica_check, two_copies_or_a_tie_name_nobody) {
  auto two = same(1, 2, 3);
  two[1].digests[0] ^= 1;
  auto found = compare_replicas(1, 2, 1, two);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_TRUE(found[0].bad.empty());
  EXPECT_TRUE(bad_replicas(found).empty()) << "two copies need a judge";
  auto four = same(1, 4, 3);
  four[2].digests[1] ^= 1;
  four[3].digests[1] ^= 1;  // two against two
  found = compare_replicas(1, 4, 1, four);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_TRUE(found[0].bad.empty());
  // Where one operator has a majority and another has none, nobody is replaced on a guess.
  auto mixed = same(1, 3, 3);
  mixed[0].digests[0] ^= 1;
  mixed[1].digests[2] ^= 1;
  mixed[2].digests[2] ^= 2;
  found = compare_replicas(1, 3, 1, mixed);
  ASSERT_EQ(found.size(), 2u);
  EXPECT_TRUE(bad_replicas(found).empty());
}

TEST(replica_check, several_bad_replicas_and_stages) {
  auto r = same(2, 5, 2);
  r[std::size_t(1 * 2 + 0)].digests[0] ^= 1;  // stage 0 replica 1
  r[std::size_t(4 * 2 + 0)].digests[0] ^= 2;  // stage 0 replica 4
  r[std::size_t(3 * 2 + 1)].digests[1] ^= 1;  // stage 1 replica 3
  const auto found = compare_replicas(2, 5, 1, r);
  EXPECT_EQ(bad_replicas(found), (std::vector<std::pair<int, int>>{{0, 1}, {0, 4}, {1, 3}}));
}

TEST(replica_check, missing_or_misfit_reports_are_left_out) {
  auto r = same(1, 3, 3);
  r[2].digests.clear();  // a GPU stage, or none asked
  EXPECT_TRUE(compare_replicas(1, 3, 1, r).empty());
  r[1].digests[0] ^= 1;
  const auto found = compare_replicas(1, 3, 1, r);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0].replicas, (std::vector<int>{0, 1}));
  auto misfit = same(1, 3, 3);
  misfit[2].digests.push_back(7);  // another length than the first report's
  misfit[2].digests[0] ^= 1;
  EXPECT_TRUE(compare_replicas(1, 3, 1, misfit).empty());
  EXPECT_TRUE(compare_replicas(1, 3, 1, std::vector<replica_report>(2)).empty())
      << "reports of another shape";
}

// ep = 2, dp = 4: replicas 0 and 2 hold shard 0, replicas 1 and 3 shard 1. Each list: two
// non-experts then two experts of its shard.
TEST(replica_check, experts_are_compared_within_their_shard) {
  std::vector<replica_report> r(4);
  for (int d = 0; d < 4; ++d) {
    r[std::size_t(d)].digests = {1, 2, 10u + std::uint64_t(d % 2), 20u + std::uint64_t(d % 2)};
    r[std::size_t(d)].experts = {false, false, true, true};
  }
  EXPECT_TRUE(compare_replicas(1, 4, 2, r).empty()) << "different shards hold other experts";
  r[3].digests[3] ^= 1;  // shard 1's second expert on replica 3
  auto found = compare_replicas(1, 4, 2, r);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_TRUE(found[0].expert);
  EXPECT_EQ(found[0].replicas, (std::vector<int>{1, 3}));
  r[3].digests[3] ^= 1;
  r[2].digests[1] ^= 1;  // a non-expert: compared over all four
  found = compare_replicas(1, 4, 2, r);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_FALSE(found[0].expert);
  EXPECT_EQ(found[0].replicas, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(found[0].bad, (std::vector<int>{2}));
}

}  // namespace
