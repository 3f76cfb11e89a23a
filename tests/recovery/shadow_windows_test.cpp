// Which window dp = 1's shadow checks replay from (recovery/shadow_windows.hpp): a window a
// check of every stage vouched for, the job's start before any, one taken on trust after a
// restart; what is retained for them; how far back a corruption found is clean.
#include "recovery/shadow_windows.hpp"

#include <gtest/gtest.h>

namespace {

using moevement::recovery::shadow_windows;
using window_at = shadow_windows::window_at;

TEST(shadow_windows, the_first_round_replays_from_the_start_then_from_a_window_all_vouched) {
  shadow_windows s(2, true);
  EXPECT_FALSE(s.base(window_at{1, 2}).has_value()) << "from the job's start";
  EXPECT_TRUE(s.vouched());
  EXPECT_EQ(s.retained_from(), 0) << "logs and plans from iteration 0";
  s.agreed(0, 3, window_at{1, 2});  // window 1's captures precede this check
  EXPECT_EQ(s.retained(), (std::vector<std::uint64_t>{1})) << "the candidate";
  EXPECT_FALSE(s.base(window_at{3, 6}).has_value()) << "stage 1 has not vouched for it yet";
  s.agreed(1, 7, window_at{3, 6});
  const auto b = s.base(window_at{3, 6});
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->window, 1u);
  EXPECT_EQ(b->first, 2);
  EXPECT_TRUE(s.vouched());
  EXPECT_EQ(s.retained_from(), 2);
  EXPECT_EQ(s.retained(), (std::vector<std::uint64_t>{1}));
  // The next round: the window persisted at its first check is the next base.
  s.agreed(0, 11, window_at{5, 10});
  EXPECT_EQ(s.retained(), (std::vector<std::uint64_t>{1, 5}));
  EXPECT_EQ(s.retained_firsts(), (std::vector<std::int64_t>{2, 10}));
  s.agreed(1, 15, window_at{7, 14});
  EXPECT_EQ(s.base(window_at{7, 14})->window, 5u);
  EXPECT_EQ(s.retained(), (std::vector<std::uint64_t>{5}));
}

TEST(shadow_windows, a_candidate_is_only_a_window_newer_than_the_base) {
  shadow_windows s(1, true);
  s.agreed(0, 3, std::nullopt);  // nothing persisted yet: no candidate
  EXPECT_TRUE(s.retained().empty());
  EXPECT_FALSE(s.base(std::nullopt).has_value());
  s.agreed(0, 7, window_at{2, 4});  // one stage: vouched at once
  EXPECT_EQ(s.base(window_at{2, 4})->window, 2u);
  s.agreed(0, 11, window_at{2, 4});  // the same window still persisted: stays the base
  EXPECT_EQ(s.base(window_at{2, 4})->window, 2u);
  EXPECT_EQ(s.retained(), (std::vector<std::uint64_t>{2}));
}

TEST(shadow_windows, clean_before_is_past_the_stages_last_check_that_agreed) {
  shadow_windows s(2, true);
  EXPECT_EQ(s.clean_before(1), 0) << "nothing known past the start";
  s.agreed(1, 7, window_at{3, 6});
  EXPECT_EQ(s.clean_before(1), 8);
  EXPECT_EQ(s.clean_before(0), 0);
  s.agreed(0, 11, window_at{5, 10});  // window 3 vouched by both: the base
  EXPECT_EQ(s.clean_before(0), 12);
  EXPECT_EQ(s.clean_before(1), 8);
  s.restart();
  EXPECT_EQ(s.base(window_at{9, 18})->first, 18);
  EXPECT_EQ(s.clean_before(1), 18) << "only the window taken on trust";
}

TEST(shadow_windows, a_restart_takes_the_persisted_window_on_trust_and_retains_it) {
  shadow_windows s(2, true);
  s.agreed(0, 3, window_at{1, 2});
  s.restart();
  EXPECT_TRUE(s.retained().empty());
  EXPECT_EQ(s.retained_from(), -1) << "nothing past the persisted window until the next check";
  const auto b = s.base(window_at{4, 8});
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->window, 4u);
  EXPECT_FALSE(s.vouched());
  EXPECT_EQ(s.retained(), (std::vector<std::uint64_t>{4}));
  EXPECT_EQ(s.retained_from(), 8);
  s.agreed(0, 11, window_at{5, 10});
  s.agreed(1, 15, window_at{6, 12});
  EXPECT_EQ(s.base(window_at{6, 12})->window, 5u);
  EXPECT_FALSE(s.vouched()) << "vouched for from a window taken on trust";
}

TEST(shadow_windows, off_it_retains_nothing) {
  shadow_windows s(2, false);
  EXPECT_TRUE(s.retained().empty());
  EXPECT_EQ(s.retained_from(), -1);
  s.restart();
  EXPECT_TRUE(s.retained().empty());
}

}  // namespace
