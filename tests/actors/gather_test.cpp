// ask_all: one deadline for many asks, replies in target order, lost and missing targets as
// errors, the asking actor stopping mid-gather. Under the deterministic scheduler.
#include "actors/gather.hpp"

#include <array>

#include "actors/deterministic.hpp"
#include "tests/actors/harness.hpp"

namespace moevement::actors::testing {
namespace {

TEST(ask_all, replies_come_in_target_order_from_every_node) {
  deterministic d;
  auto& head = d.add(0);
  d.add(1, {.head = 0});
  d.add(2, {.head = 0});
  d.run_body([&]() -> awaitable<void> {
    CO_ASSERT((co_await d[1].join(1s)).ok());
    CO_ASSERT((co_await d[2].join(1s)).ok());
    std::vector<actor_ref> to{d[2].spawn<echo>(), head.spawn<echo>(), d[1].spawn<echo>()};
    auto replies =
        co_await ask_all<msg::Add, msg::Sum>(head, to, 1s, [](std::size_t i, msg::Add::Builder b) {
          b.setA(std::int64_t(i));
          b.setB(100);
        });
    CO_ASSERT(replies.size() == 3);
    for (std::size_t i = 0; i < 3; ++i) {
      CO_ASSERT(replies[i].ok());
      EXPECT_EQ(replies[i]->get().getValue(), std::int64_t(100 + i));
    }
  });
}

TEST(ask_all, the_slowest_target_sets_the_wait_not_the_sum) {
  deterministic d;
  auto& sys = d.add(1);
  d.run_body([&]() -> awaitable<void> {
    std::vector<actor_ref> to;
    for (int i = 0; i < 4; ++i) to.push_back(sys.spawn<echo>());
    const auto t0 = d.now();
    // Three answer after 300, 100 and 200 ms; the fourth sleeps past the 1 s deadline.
    const std::array<std::uint32_t, 4> ms{300, 100, 200, 5000};
    auto replies = co_await ask_all<msg::Sleep, msg::Done>(
        sys, to, 1s, [&](std::size_t i, msg::Sleep::Builder b) {
          b.setMs(ms[i]);
          b.setTag(i + 1);
        });
    EXPECT_EQ(d.now() - t0, 1s);  // one deadline, not four
    for (std::size_t i = 0; i < 3; ++i) {
      CO_ASSERT(replies[i].ok());
      EXPECT_EQ(replies[i]->get().getTag(), i + 1);
    }
    CO_ASSERT(!replies[3].ok());
    EXPECT_NE(replies[3].err().message.find("timed out"), std::string::npos);
    // All answered: the wait is the slowest answer.
    const auto t1 = d.now();
    auto again = co_await ask_all<msg::Sleep, msg::Done>(
        sys, std::vector<actor_ref>(to.begin(), to.begin() + 3), 10s,
        [&](std::size_t i, msg::Sleep::Builder b) { b.setMs(ms[i]); });
    for (auto& r : again) EXPECT_TRUE(r.ok());
    EXPECT_EQ(d.now() - t1, 300ms);
  });
}

TEST(ask_all, lost_and_missing_targets_are_errors_without_waiting_the_deadline) {
  deterministic d;
  auto& head = d.add(0);
  d.add(1, {.head = 0});
  d.run_body([&]() -> awaitable<void> {
    CO_ASSERT((co_await d[1].join(1s)).ok());
    const actor_ref remote = d[1].spawn<echo>();
    const actor_ref local = head.spawn<echo>();
    d.hub().crash(1);
    co_await head.sleep_for(1ms);
    const auto t0 = d.now();
    std::vector<actor_ref> targets{remote, actor_ref{}, local};
    auto replies = co_await ask_all<msg::Add, msg::Sum>(head, targets, 30s,
                                                        [](std::size_t, msg::Add::Builder b) {
                                                          b.setA(1);
                                                          b.setB(2);
                                                        });
    EXPECT_LT(d.now() - t0, 30s);
    EXPECT_FALSE(replies[0].ok());
    CO_ASSERT(!replies[1].ok());
    EXPECT_NE(replies[1].err().message.find("no actor"), std::string::npos);
    CO_ASSERT(replies[2].ok());
    EXPECT_EQ(replies[2]->get().getValue(), 3);
    // No targets: done at once.
    std::vector<actor_ref> nobody;
    auto none = co_await ask_all<msg::Add, msg::Sum>(head, nobody, 1s,
                                                     [](std::size_t, msg::Add::Builder) {});
    EXPECT_TRUE(none.empty());
  });
}

TEST(ask_all, the_asking_actor_stopping_ends_the_gather) {
  deterministic d;
  auto& sys = d.add(1);
  d.run_body([&]() -> awaitable<void> {
    auto asker = sys.spawn<echo>();
    std::vector<actor_ref> to{sys.spawn<echo>(), sys.spawn<echo>()};
    bool returned = false;
    std::size_t errors = 0;
    auto turn = [&](actor& self) -> awaitable<void> {
      auto replies = co_await ask_all<msg::Sleep, msg::Done>(
          self, to, 1h, [](std::size_t, msg::Sleep::Builder b) { b.setMs(60'000); });
      returned = true;
      for (auto& r : replies) errors += r.ok() ? 0 : 1;
    };
    CO_ASSERT(sys.post_call(asker, turn).ok());
    co_await sys.sleep_for(1s);
    EXPECT_FALSE(returned);
    sys.stop(asker);
    co_await sys.sleep_for(1ms);
    EXPECT_TRUE(returned);
    EXPECT_EQ(errors, 2u);
    co_await sys.sleep_for(2min);  // the sleepers answer into the void
  });
}

}  // namespace
}  // namespace moevement::actors::testing
