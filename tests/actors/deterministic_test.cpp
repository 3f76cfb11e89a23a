// The deterministic scheduler: manual time governs deadlines, sleeps, heartbeats and restart
// intensities; work runs only when stepped; the same scenario takes the same path every run.
#include "actors/deterministic.hpp"

#include "actors/supervisor.hpp"
#include "tests/actors/harness.hpp"

namespace moevement::actors::testing {
namespace {

TEST(deterministic, a_tell_runs_only_when_stepped) {
  deterministic d;
  auto& sys = d.add(1);
  auto e = sys.spawn<echo>();
  d.run();  // on_start
  ASSERT_TRUE(e.tell<msg::Ping>([](msg::Ping::Builder b) { b.setSeq(7); }).ok());
  EXPECT_TRUE(sys.local_actor<echo>(e)->log.empty());
  EXPECT_GT(d.run(), 0u);
  EXPECT_EQ(sys.local_actor<echo>(e)->log, (std::vector<std::uint64_t>{7}));
  EXPECT_EQ(d.run(), 0u);  // nothing left; time stood still
}

TEST(deterministic, an_ask_times_out_at_its_deadline_exactly_in_manual_time) {
  deterministic d;
  auto& sys = d.add(1);
  const auto t0 = d.now();
  d.run_body([&]() -> awaitable<void> {
    auto e = sys.spawn<echo>();
    auto r = co_await e.ask<msg::Sleep>(20ms, [](msg::Sleep::Builder b) {
      b.setMs(500);
      b.setTag(1);
    });
    CO_ASSERT(!r.ok());
    EXPECT_NE(r.err().message.find("timed out"), std::string::npos) << r.err().message;
    EXPECT_EQ(d.now() - t0, 20ms);
    // The handler is still asleep; a second ask queued behind it expires unhandled.
    auto r2 = co_await e.ask<msg::Add>(10ms);
    EXPECT_FALSE(r2.ok());
    EXPECT_EQ(d.now() - t0, 30ms);
    co_await sys.sleep_for(1s);
    EXPECT_EQ(sys.stats().expired, 1u);
    EXPECT_EQ(sys.local_actor<echo>(e)->log, (std::vector<std::uint64_t>{10, 11}));
  });
}

TEST(deterministic, a_hung_node_is_declared_lost_within_timeout_plus_interval) {
  deterministic d;
  system_config cfg;
  cfg.heartbeat_interval = 100ms;
  cfg.heartbeat_timeout = 1000ms;
  auto& head = d.add(0, cfg);
  cfg.head = 0;
  auto& worker = d.add(1, cfg);
  std::optional<clock::time_point> lost_at;
  head.on_membership([&](node_id n, member_event e) {
    if (n == 1 && e == member_event::lost) lost_at = d.now();
  });
  d.run_body([&]() -> awaitable<void> {
    auto joined = co_await worker.join(1s);
    CO_ASSERT(joined.ok());
    co_await head.sleep_for(3s);  // steady state: heartbeats both ways, nothing lost
    EXPECT_FALSE(lost_at.has_value());
    const auto hung_at = d.now();
    d.hub().hang(1);
    co_await head.sleep_for(5s);
    CO_ASSERT(lost_at.has_value());
    EXPECT_GE(*lost_at - hung_at, cfg.heartbeat_timeout);
    EXPECT_LE(*lost_at - hung_at, cfg.heartbeat_timeout + 2 * cfg.heartbeat_interval);
  });
}

// A member never heard from since it joined gets the join grace, not the heartbeat timeout:
// its first messages may wait for a connection whose SYN was dropped (1 s, 3 s, 7 s on Linux).
// Once heard from, the heartbeat timeout applies (the test above).
TEST(deterministic, a_member_never_heard_from_gets_the_join_grace) {
  deterministic d;
  system_config cfg;
  cfg.heartbeat_interval = 100ms;
  cfg.heartbeat_timeout = 1000ms;
  cfg.join_grace = 7000ms;
  auto& head = d.add(0, cfg);
  cfg.head = 0;
  auto& worker = d.add(1, cfg);
  std::optional<clock::time_point> up_at, lost_at;
  head.on_membership([&](node_id n, member_event e) {
    if (n == 1 && e == member_event::up) {
      up_at = d.now();
      d.hub().hang(1);  // nothing from it after its join request
    }
    if (n == 1 && e == member_event::lost) lost_at = d.now();
  });
  d.run_body([&]() -> awaitable<void> {
    (void)co_await worker.join(1s);
    co_await head.sleep_for(10s);
    CO_ASSERT(up_at.has_value());
    CO_ASSERT(lost_at.has_value());
    EXPECT_GE(*lost_at - *up_at, cfg.join_grace);
    EXPECT_LE(*lost_at - *up_at, cfg.join_grace + 2 * cfg.heartbeat_interval);
  });
}

TEST(deterministic, restart_intensity_counts_manual_time) {
  deterministic d;
  auto& sys = d.add(1);
  d.run_body([&]() -> awaitable<void> {
    std::vector<child_spec> kids{child_spec::local<echo>("a", restart_type::permanent)};
    auto sup = sys.spawn<supervisor>(strategy::one_for_one, restart_intensity{1, 5s}, kids);
    auto crash_child = [&]() -> awaitable<void> {
      auto list = co_await supervisor::which_children(sys, sup, 1s);
      EXPECT_TRUE(list.ok());
      if (!list.ok()) co_return;
      (void)sys.tell<msg::Crash>((*list)[0].second,
                                 [](msg::Crash::Builder b) { b.setWhy("test crash"); });
      co_await sys.sleep_for(1ms);
    };
    co_await crash_child();  // restart 1 of 1 in 5 s
    EXPECT_TRUE(sys.alive(sup));
    co_await sys.sleep_for(6s);  // the first restart leaves the period
    co_await crash_child();
    EXPECT_TRUE(sys.alive(sup));
    co_await sys.sleep_for(1s);
    co_await crash_child();  // two restarts within 5 s: the supervisor gives up
    EXPECT_FALSE(sys.alive(sup));
  });
}

// A little protocol with timers and several nodes; its trace must not depend on the run.
std::vector<std::uint64_t> scenario_trace() {
  deterministic d;
  auto& a = d.add(1);
  auto& b = d.add(2);
  std::vector<std::uint64_t> trace;
  d.run_body([&]() -> awaitable<void> {
    auto x = a.spawn<echo>();
    auto y = b.spawn<echo>();
    auto sleeper = [&](typed_ref<echo> who, std::uint32_t ms,
                       std::uint64_t tag) -> awaitable<void> {
      auto r = co_await who.ask<msg::Sleep>(10s, [&](msg::Sleep::Builder m) {
        m.setMs(ms);
        m.setTag(tag);
      });
      trace.push_back(r.ok() ? r->get().getTag() : 0);
    };
    asio::co_spawn(d.io(), sleeper(x, 30, 1), asio::detached);
    asio::co_spawn(d.io(), sleeper(y, 10, 2), asio::detached);
    asio::co_spawn(d.io(), sleeper(x, 5, 3), asio::detached);
    asio::co_spawn(d.io(), sleeper(y, 30, 4), asio::detached);
    co_await a.sleep_for(1s);
    for (auto v : a.local_actor<echo>(x)->log) trace.push_back(1000 + v);
    for (auto v : b.local_actor<echo>(y)->log) trace.push_back(2000 + v);
  });
  return trace;
}

TEST(deterministic, the_same_scenario_takes_the_same_path) {
  const auto first = scenario_trace();
  // x: 1 (0..30 ms), then 3 (30..35); y: 2 (0..10), then 4 (10..40).
  EXPECT_EQ(first, (std::vector<std::uint64_t>{2, 1, 3, 4, 1010, 1011, 1030, 1031, 2020, 2021, 2040,
                                               2041}));
  for (int i = 0; i < 5; ++i) EXPECT_EQ(scenario_trace(), first);
}

TEST(deterministic, a_body_that_can_never_finish_is_reported) {
  deterministic d;
  auto& sys = d.add(1);
  EXPECT_THROW(d.run_body(
                   [&]() -> awaitable<void> {
                     auto e = sys.spawn<echo>();
                     (void)co_await e.ask<msg::Sleep>(3h, [](msg::Sleep::Builder b) {
                       b.setMs(2 * 3600 * 1000);
                       b.setTag(1);
                     });
                   },
                   1h),
               std::runtime_error);
}

// The production time source: a cancelled timer's callback never runs, even when it was
// already due (Asio runs a handler it queued, whatever cancel() says).
TEST(steady_time, a_timer_cancelled_when_already_due_does_not_run) {
  asio::io_context io;
  steady_time t(io);
  const auto at = clock::now() + 5ms;
  bool b_ran = false;
  time_source::timer_id b = 0;
  t.call_at(at, [&] { t.cancel(b); });  // due with b, runs first, cancels it
  b = t.call_at(at, [&] { b_ran = true; });
  bool c_ran = false;
  t.call_at(at + 1ms, [&] { c_ran = true; });
  io.run();
  EXPECT_FALSE(b_ran);
  EXPECT_TRUE(c_ran);
}

}  // namespace
}  // namespace moevement::actors::testing
