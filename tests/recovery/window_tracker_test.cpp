#include "recovery/window_tracker.hpp"

#include <gtest/gtest.h>

namespace moevement::recovery {
namespace {

// Two owners (workers 0 and 1), three slots, r = 2, replicators on nodes 0..3.
void replicate_all(window_tracker& t, std::uint64_t window, std::uint32_t slots,
                   std::optional<window_tracker::persisted_event>* last) {
  for (std::uint32_t s = 0; s < slots; ++s) {
    for (std::uint32_t owner : {0u, 1u}) {
      for (std::uint32_t holder : {2u, 3u}) {
        auto ev = t.record_copy({window, s, owner}, holder);
        if (ev) *last = ev;
      }
    }
  }
}

TEST(window_tracker, persisted_only_when_every_slot_has_every_copy) {
  window_tracker t(2);
  t.open_window(0, 100, 3, {0, 1});
  for (std::uint32_t s = 0; s < 3; ++s) {
    EXPECT_FALSE(t.record_copy({0, s, 0}, 2));
    EXPECT_FALSE(t.record_copy({0, s, 0}, 3));
    EXPECT_FALSE(t.record_copy({0, s, 1}, 2));
  }
  EXPECT_FALSE(t.persisted());
  EXPECT_FALSE(t.record_copy({0, 0, 1}, 1)) << "a copy on the owner itself must not count";
  EXPECT_FALSE(t.record_copy({0, 0, 1}, 3));
  EXPECT_FALSE(t.record_copy({0, 1, 1}, 3));
  auto ev = t.record_copy({0, 2, 1}, 3);
  ASSERT_TRUE(ev.has_value());
  EXPECT_EQ(ev->window, 0u);
  EXPECT_EQ(ev->log_cutoff, 100u);
  EXPECT_TRUE(ev->collectable.empty());
}

TEST(window_tracker, keeps_one_persisted_and_one_in_flight) {
  window_tracker t(2);
  std::optional<window_tracker::persisted_event> last;
  for (std::uint64_t w = 0; w < 20; ++w) {
    t.open_window(w, w * 3, 3, {0, 1});
    EXPECT_LE(t.windows_tracked(), 2u) << "windows pile up at " << w;
    replicate_all(t, w, 3, &last);
    ASSERT_TRUE(last.has_value());
    EXPECT_EQ(last->window, w);
    EXPECT_EQ(last->log_cutoff, w * 3);
    if (w > 0) {
      EXPECT_EQ(last->collectable, std::vector<std::uint64_t>{w - 1});
    }
  }
}

TEST(window_tracker, losing_one_holder_keeps_the_window_losing_both_reports_the_slots) {
  window_tracker t(2);
  std::optional<window_tracker::persisted_event> last;
  t.open_window(7, 21, 2, {0, 1});
  replicate_all(t, 7, 2, &last);
  ASSERT_EQ(t.persisted(), 7u);
  EXPECT_TRUE(t.holder_lost(2).empty());
  EXPECT_EQ(t.holders({7, 0, 0}), std::vector<std::uint32_t>{3});
  const auto lost = t.holder_lost(3);
  EXPECT_EQ(lost.size(), 4u);  // 2 slots x 2 owners, no copy left
}

TEST(window_tracker, bad_shapes_are_refused) {
  EXPECT_THROW(window_tracker(0), std::invalid_argument);
  window_tracker t(1);
  t.open_window(5, 0, 1, {0});
  EXPECT_THROW(t.open_window(5, 0, 1, {0}), std::invalid_argument);
  EXPECT_THROW(t.open_window(6, 0, 0, {0}), std::invalid_argument);
  EXPECT_FALSE(t.record_copy({99, 0, 0}, 1)) << "unknown windows are ignored";
}

}  // namespace
}  // namespace moevement::recovery
