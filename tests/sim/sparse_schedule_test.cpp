#include "sim/sparse_schedule.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <stdexcept>

namespace moevement::sim {
namespace {

// Per-parameter sizes of FP16-FP32 mixed precision with Adam: 2 + 4 + 8 bytes.
constexpr double compute = 2, master = 4, optim = 8;

std::vector<sparse_op> uniform_ops(std::size_t n, double params = 1) {
  std::vector<sparse_op> ops(n);
  for (std::size_t i = 0; i < n; ++i) {
    ops[i] = {static_cast<std::uint64_t>(compute * params),
              static_cast<std::uint64_t>(master * params),
              static_cast<std::uint64_t>(optim * params), static_cast<double>(i)};
  }
  return ops;
}

// Section 3.2 / Figure 6: E1..E4, NE, G over three iterations. Slot 0 snapshots E1, E2 in FP32
// and E3, E4, NE, G in FP16; slot 1 E3, E4 in FP32 and NE, G in FP16; slot 2 NE, G in FP32.
TEST(sparse_schedule, papers_three_iteration_example) {
  enum { e1, e2, e3, e4, ne, g };
  std::vector<sparse_op> ops(6);
  const double popularity[] = {0.10, 0.15, 0.20, 0.30, 1.0, 1.0};  // NE and G see every token
  for (int i = 0; i < 6; ++i) ops[static_cast<std::size_t>(i)] = {2, 4, 8, popularity[i]};
  const auto order = order_by_popularity(ops);
  EXPECT_EQ(order, (std::vector<std::size_t>{e1, e2, e3, e4, ne, g}));
  // Slot bytes for A active of 6: 12 A + 2 (6 - A) = 10 A + 12. A = 3 needs 42, A = 2 needs 32.
  const auto w = find_window_size(6, /*t_iter=*/35, compute, master, optim, /*bw=*/1);
  EXPECT_EQ(w.o_active, 2);
  EXPECT_EQ(w.w_sparse, 3);
  EXPECT_TRUE(w.fits);
  EXPECT_DOUBLE_EQ(w.slot_bytes, 32);
  const auto s = generate_schedule(order, w.w_sparse, w.o_active);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].active, (std::vector<std::size_t>{e1, e2}));
  EXPECT_EQ(s[0].frozen, (std::vector<std::size_t>{e3, e4, ne, g}));
  EXPECT_EQ(s[1].active, (std::vector<std::size_t>{e3, e4}));
  EXPECT_EQ(s[1].frozen, (std::vector<std::size_t>{ne, g}));
  EXPECT_EQ(s[2].active, (std::vector<std::size_t>{ne, g}));
  EXPECT_TRUE(s[2].frozen.empty());
  EXPECT_EQ(check_schedule(s, 6), "");
  // Figure 8: after loading SS10 only E1, E2 are active; after SS11 also E3, E4; then all.
  EXPECT_EQ(active_after_slot(s, 6, 0),
            (std::vector<bool>{true, true, false, false, false, false}));
  EXPECT_EQ(active_after_slot(s, 6, 1), (std::vector<bool>{true, true, true, true, false, false}));
  EXPECT_EQ(active_after_slot(s, 6, 2), std::vector<bool>(6, true));
  EXPECT_DOUBLE_EQ(slot_bytes(s[0], ops), 2 * 12 + 4 * 2);
  EXPECT_DOUBLE_EQ(slot_bytes(s[1], ops), 2 * 12 + 2 * 2);
  EXPECT_DOUBLE_EQ(slot_bytes(s[2], ops), 2 * 12);
}

TEST(sparse_schedule, hand_computed_window_sizes) {
  // 10 operators, bandwidth 10 B/s: slot 0 = 12 A + 2 (10 - A) = 10 A + 20 bytes.
  EXPECT_EQ(find_window_size(10, 7.0, compute, master, optim, 10).o_active, 5);  // 70 <= 70
  EXPECT_EQ(find_window_size(10, 7.0, compute, master, optim, 10).w_sparse, 2);
  EXPECT_EQ(find_window_size(10, 6.9, compute, master, optim, 10).o_active, 4);  // 60 <= 69
  EXPECT_EQ(find_window_size(10, 6.9, compute, master, optim, 10).w_sparse, 3);  // ceil(10/4)
  // Everything fits: dense (W = 1).
  const auto dense = find_window_size(10, 100, compute, master, optim, 10);
  EXPECT_EQ(dense.w_sparse, 1);
  EXPECT_EQ(dense.o_active, 10);
  // Nothing fits: the loop stops at 2 active operators and reports the stall.
  const auto tight = find_window_size(10, 0.01, compute, master, optim, 10);
  EXPECT_EQ(tight.o_active, 2);
  EXPECT_EQ(tight.w_sparse, 5);
  EXPECT_FALSE(tight.fits);
  // One or two operators: the loop never runs (Algorithm 1 line 10).
  EXPECT_EQ(find_window_size(1, 0.01, compute, master, optim, 1).w_sparse, 1);
  EXPECT_EQ(find_window_size(2, 0.01, compute, master, optim, 1).w_sparse, 1);
  // 64 experts, 7 operators worth of FP32 state fit: W = ceil(64 / 7) = 10.
  // Slot = 12 A + 2 (64 - A) = 10 A + 128 <= 200  ->  A = 7.
  const auto w = find_window_size(64, 200, compute, master, optim, 1);
  EXPECT_EQ(w.o_active, 7);
  EXPECT_EQ(w.w_sparse, 10);
}

TEST(sparse_schedule, general_search_equals_the_papers_for_equal_sizes) {
  for (std::size_t n : {1u, 2u, 3u, 6u, 17u, 64u, 130u}) {
    const auto ops = uniform_ops(n, 1000);
    for (double t : {0.001, 0.5, 1.0, 2.0, 5.0, 50.0}) {
      const auto a = find_window_size(n, t, compute * 1000, master * 1000, optim * 1000, 8000);
      const auto b = find_window_size(ops, t, 8000);
      EXPECT_EQ(a.o_active, b.o_active) << n << " " << t;
      EXPECT_EQ(a.w_sparse, b.w_sparse) << n << " " << t;
      EXPECT_EQ(a.fits, b.fits) << n << " " << t;
      EXPECT_DOUBLE_EQ(a.slot_bytes, b.slot_bytes) << n << " " << t;
    }
  }
}

TEST(sparse_schedule, unequal_sizes_use_the_largest_slot) {
  // Ordered: two small operators, then a big one. With A = 2 the first slot is small (the big
  // one only contributes compute weights) but the second slot holds the big one's FP32 state.
  std::vector<sparse_op> ops{{2, 4, 8, 0}, {2, 4, 8, 0}, {200, 400, 800, 0}};
  // A = 3: 3 x 12 + 1188 = 1224... all in one slot: 12 + 12 + 1200 = 1224 bytes.
  EXPECT_EQ(find_window_size(ops, 1224, 1).o_active, 3);
  // Below that the loop reaches 2 without testing it: slot 0 = 24 + 200, slot 1 = 1200.
  const auto w = find_window_size(ops, 1000, 1);
  EXPECT_EQ(w.o_active, 2);
  EXPECT_DOUBLE_EQ(w.slot_bytes, 1200);
  EXPECT_FALSE(w.fits);
}

TEST(sparse_schedule, every_operator_exactly_once_per_window) {
  for (std::size_t n = 1; n <= 40; ++n) {
    std::vector<std::size_t> order(n);
    for (std::size_t i = 0; i < n; ++i) order[i] = n - 1 - i;  // any permutation will do
    for (int a = 1; a <= static_cast<int>(n); ++a) {
      const int w = static_cast<int>((n + a - 1) / a);
      const auto s = generate_schedule(order, w, a);
      ASSERT_EQ(check_schedule(s, n), "") << "n=" << n << " a=" << a;
      std::vector<int> seen(n, 0);
      for (const auto& slot : s)
        for (auto i : slot.active) ++seen[i];
      EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
    }
  }
}

TEST(sparse_schedule, check_schedule_finds_mistakes) {
  const std::vector<std::size_t> order{0, 1, 2, 3};
  auto s = generate_schedule(order, 2, 2);
  ASSERT_EQ(check_schedule(s, 4), "");
  auto twice = s;
  twice[1].active.push_back(0);
  EXPECT_NE(check_schedule(twice, 4).find("operator 0 active in slots 0 and 1"), std::string::npos);
  auto missing = s;
  missing[1].active.pop_back();
  EXPECT_NE(check_schedule(missing, 4).find("operator 3 is never active"), std::string::npos);
  auto not_frozen = s;
  not_frozen[0].frozen.clear();
  EXPECT_NE(check_schedule(not_frozen, 4).find("missing from the frozen set of slot 0"),
            std::string::npos);
  EXPECT_THROW(generate_schedule(order, 1, 2), std::invalid_argument);  // 2 < 4 operators
}

TEST(sparse_schedule, ordering_is_ascending_popularity_with_stable_ties) {
  std::vector<sparse_op> ops(5);
  const double pop[] = {5, 1, 3, 1, 0};
  for (int i = 0; i < 5; ++i) ops[static_cast<std::size_t>(i)].popularity = pop[i];
  EXPECT_EQ(order_by_popularity(ops), (std::vector<std::size_t>{4, 1, 3, 2, 0}));
  EXPECT_DOUBLE_EQ(time_decayed_popularity(100, 0, 0.9), 90);
  EXPECT_DOUBLE_EQ(time_decayed_popularity(100, 200, 0.5), 150);
  EXPECT_DOUBLE_EQ(capacity_normalized_popularity(30, 60), 0.5);
  EXPECT_THROW(capacity_normalized_popularity(1, 0), std::invalid_argument);
}

TEST(sparse_schedule, reorder_when_a_quarter_changed_by_more_than_ten_percent) {
  const std::vector<double> before{100, 100, 100, 100, 100, 100, 100, 100};
  auto after = before;
  after[0] = 111;  // 1 of 8 changed: 12.5% < 25%
  EXPECT_FALSE(should_reorder(before, after));
  after[1] = 85;  // 2 of 8 = 25%
  EXPECT_TRUE(should_reorder(before, after));
  after[1] = 95;  // a 5% change does not count
  EXPECT_FALSE(should_reorder(before, after));
  EXPECT_TRUE(should_reorder(before, after, {0.10, 0.125}));
  EXPECT_THROW(should_reorder(before, std::vector<double>(3)), std::invalid_argument);
}

TEST(sparse_schedule, rejects_bad_inputs) {
  EXPECT_THROW(find_window_size(0, 1, 2, 4, 8, 1), std::invalid_argument);
  EXPECT_THROW(find_window_size(4, 0, 2, 4, 8, 1), std::invalid_argument);
  EXPECT_THROW(find_window_size(4, 1, 2, 4, 8, 0), std::invalid_argument);
  EXPECT_THROW(find_window_size(std::vector<sparse_op>{}, 1, 1), std::invalid_argument);
}

}  // namespace
}  // namespace moevement::sim
