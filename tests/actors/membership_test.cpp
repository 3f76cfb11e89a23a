// Membership and failure detection over loopback links: join through the head, heartbeats,
// crash, hang (no transport signal: heartbeats must find it) and goodbye. The same checks are
// written against transport::link so that they can run over ucx_link between processes.
#include <algorithm>
#include <thread>

#include "tests/actors/harness.hpp"

namespace moevement::actors::testing {
namespace {

system_config fast(std::uint32_t incarnation = 1) {
  system_config cfg;
  cfg.incarnation = incarnation;
  cfg.heartbeat_interval = 10ms;
  cfg.heartbeat_timeout = 100ms;
  return cfg;
}

struct events {
  std::vector<std::pair<node_id, member_event>> seen;
  clock::time_point lost_at{};
};

TEST(membership, nodes_join_through_the_head_and_see_each_other) {
  cluster c;
  auto& head = c.add(0, fast());
  auto& n1 = c.add(1, fast());
  auto& n2 = c.add(2, fast());
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n1.join(1s)).ok());
    CO_ASSERT((co_await n2.join(1s)).ok());
    co_await sleep_for(5ms);
    EXPECT_EQ(head.members().size(), 2u);
    EXPECT_EQ(n1.members().size(), 2u);  // head and node 2 (told by the head)
    EXPECT_EQ(n2.members().size(), 2u);
    // Members know each other's incarnation: a ref of an older one fails without a message.
    auto e = n2.spawn<echo>();
    actor_ref stale = e;
    stale.incarnation = 0xdead;
    const auto sent_before = c.link(1).stats().sent;
    EXPECT_FALSE(n1.tell<msg::Ping>(stale).ok());
    EXPECT_EQ(c.link(1).stats().sent, sent_before);
    // Heartbeats keep an idle cluster alive well past the timeout.
    co_await sleep_for(300ms);
    EXPECT_EQ(head.members().size(), 2u);
    EXPECT_EQ(n1.members().size(), 2u);
  });
}

// Detection of a hung node: no transport signal at all, only missing heartbeats.
// fence(): a node that has not joined yet (a worker hung as it started, replaced before it
// joined) is refused when it comes, that incarnation; a member is declared lost at once.
TEST(membership, a_fenced_node_cannot_join_and_a_fenced_member_is_lost) {
  cluster c;
  auto& head = c.add(0, fast());
  auto& n1 = c.add(1, fast(7));
  auto& n2 = c.add(2, fast());
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n2.join(1s)).ok());
    head.fence(1, 7, "did not report its stage within cluster.start_timeout_ms");
    EXPECT_FALSE((co_await n1.join(300ms)).ok()) << "that incarnation joins no more";
    head.fence(2, 1, "late");
    co_await sleep_for(5ms);
    EXPECT_TRUE(head.members().empty());
    EXPECT_FALSE(head.last_heard(2).has_value());
    EXPECT_GE(head.stats().fenced, 1u);
  });
}

TEST(membership, a_hung_node_is_detected_by_heartbeat_timeout_and_its_monitors_fire) {
  cluster c;
  auto& head = c.add(0, fast());
  auto& n1 = c.add(1, fast());
  auto& n2 = c.add(2, fast());
  events ev;
  head.on_membership([&](node_id n, member_event e) {
    ev.seen.emplace_back(n, e);
    if (e == member_event::lost) ev.lost_at = clock::now();
  });
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n1.join(1s)).ok());
    CO_ASSERT((co_await n2.join(1s)).ok());
    auto w = head.spawn<watcher>();
    auto w1 = n1.spawn<watcher>();
    std::vector<actor_ref> on2;
    for (int i = 0; i < 3; ++i) on2.push_back(n2.spawn<echo>());
    co_await sleep_for(1ms);
    for (auto& a : on2) {
      head.local_actor<watcher>(w)->monitor(a);
      n1.local_actor<watcher>(w1)->monitor(a);
    }
    co_await sleep_for(20ms);
    const auto hung_at = clock::now();
    const auto heard_before = head.last_heard(2);
    CO_ASSERT(heard_before.has_value());
    c.hub().hang(2);
    // An ask in flight to the hung node ends at its deadline, never hangs.
    typed_ref<echo> e{&head, on2[0]};
    auto r = co_await e.ask<msg::Add>(50ms);
    EXPECT_FALSE(r.ok());
    co_await sleep_for(250ms);
    CO_ASSERT(ev.lost_at != clock::time_point{});
    const auto took = ev.lost_at - hung_at;
    EXPECT_GE(ev.lost_at - *heard_before, 100ms);  // never before the configured silence
    // Upper bound: timeout + one interval, plus generous slack for a loaded 2-core machine.
    EXPECT_LT(took, 100ms + 10ms + 150ms);
    // Every monitor of every actor on the lost node fired, on both surviving nodes.
    auto* hw = head.local_actor<watcher>(w);
    auto* nw = n1.local_actor<watcher>(w1);
    EXPECT_EQ(hw->events.size(), 3u);
    EXPECT_EQ(nw->events.size(), 3u);
    for (auto& x : hw->events) EXPECT_EQ(x.why.kind, exit_kind::node_lost);
    for (auto& x : nw->events) EXPECT_EQ(x.why.kind, exit_kind::node_lost);
    EXPECT_EQ(head.members().size(), 1u);
    // Forgotten by the link: sends to it fail fast now.
    EXPECT_FALSE(e.tell<msg::Ping>().ok());
  });
}

TEST(membership, a_crashed_node_is_detected_by_the_transport_at_once) {
  cluster c;
  auto& head = c.add(0, fast());
  auto& n1 = c.add(1, fast());
  events ev;
  head.on_membership([&](node_id n, member_event e) { ev.seen.emplace_back(n, e); });
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n1.join(1s)).ok());
    auto w = head.spawn<watcher>();
    auto a = n1.spawn<echo>();
    co_await sleep_for(1ms);
    head.local_actor<watcher>(w)->monitor(a);
    co_await sleep_for(2ms);
    c.hub().crash(1);
    co_await sleep_for(5ms);  // far below the heartbeat timeout
    CO_ASSERT(ev.seen.size() == 2);
    EXPECT_EQ(ev.seen[1], std::make_pair(node_id{1}, member_event::lost));
    auto* hw = head.local_actor<watcher>(w);
    CO_ASSERT(hw->events.size() == 1);
    EXPECT_EQ(hw->events[0].why.kind, exit_kind::node_lost);
  });
}

// A connection reset between the head and a live member (an endpoint error on both sides) is
// no verdict: each side redials and asks go on; only a redial the peer refuses (its process
// is gone) is one, found at once on either side.
TEST(membership, a_reset_connection_to_a_live_member_is_redialled_and_a_refused_redial_is_a_loss) {
  cluster c;
  auto& head = c.add(0, fast());
  auto& n1 = c.add(1, fast());
  events ev, ev1;
  head.on_membership([&](node_id n, member_event e) { ev.seen.emplace_back(n, e); });
  n1.on_membership([&](node_id n, member_event e) { ev1.seen.emplace_back(n, e); });
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n1.join(1s)).ok());
    auto a = n1.spawn<echo>();
    co_await sleep_for(2ms);
    c.hub().drop_connection(0, 1);
    co_await sleep_for(5ms);  // far below the heartbeat timeout
    auto fill = [](msg::Add::Builder b) {
      b.setA(2);
      b.setB(3);
    };
    auto r = co_await head.ask<msg::Add, msg::Sum>(a, 1s, fill);
    CO_ASSERT(r.ok());
    EXPECT_EQ(r->get().getValue(), 5);
    EXPECT_EQ(ev.seen.size(), 1u);  // only its joining: no loss on either side
    EXPECT_TRUE(ev1.seen.empty() || ev1.seen.back().second == member_event::up);
    EXPECT_GE(head.stats().reconnects, 1u);
    EXPECT_GE(n1.stats().reconnects, 1u);
    // A crash: the head's redial is refused, a verdict at once.
    c.hub().crash(1);
    co_await sleep_for(5ms);
    CO_ASSERT(ev.seen.size() == 2);
    EXPECT_EQ(ev.seen[1], std::make_pair(node_id{1}, member_event::lost));
  });
}

TEST(membership, a_member_whose_head_crashed_finds_it_at_once) {
  cluster c;
  auto& head = c.add(0, fast());
  auto& n1 = c.add(1, fast());
  events ev1;
  n1.on_membership([&](node_id n, member_event e) { ev1.seen.emplace_back(n, e); });
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n1.join(1s)).ok());
    co_await sleep_for(2ms);
    (void)head;
    c.hub().crash(0);
    co_await sleep_for(5ms);  // far below the heartbeat timeout
    bool lost = false;
    for (const auto& [n, e] : ev1.seen) lost = lost || (n == 0 && e == member_event::lost);
    EXPECT_TRUE(lost);
  });
}

system_config with_standby(node_id standby) {
  system_config cfg = fast();
  cfg.standby = standby;
  return cfg;
}

// Keeps every membership event `s` reports in `ev`.
void record(actor_system& s, events& ev) {
  s.on_membership([&ev](node_id n, member_event e) { ev.seen.emplace_back(n, e); });
}

bool saw(const events& ev, node_id n, member_event e) {
  return std::find(ev.seen.begin(), ev.seen.end(), std::make_pair(n, e)) != ev.seen.end();
}

// The cut tests' cluster: a head (0) with a standby (3) and two members (1, 2).
struct head_with_standby {
  cluster c;
  actor_system& head = c.add(0, with_standby(3));
  actor_system& n1 = c.add(1, fast());
  actor_system& n2 = c.add(2, fast());
  actor_system& standby = c.add(3, with_standby(3));
  // Every one joined, and heard for a few heartbeats.
  awaitable<bool> joined() {
    for (auto* n : {&n1, &n2, &standby}) {
      if (!(co_await n->join(1s)).ok()) co_return false;
    }
    co_await sleep_for(20ms);
    co_return true;
  }
};

// The head crashes; the standby (node 2) takes its place at once: every member follows it,
// names registered cluster-wide are found there, and its verdicts count from then on.
TEST(membership, a_standby_takes_the_place_of_a_crashed_head) {
  cluster c;
  c.add(0, with_standby(2));
  auto& n1 = c.add(1, fast());
  auto& standby = c.add(2, with_standby(2));
  auto& n3 = c.add(3, fast());
  events ev1, ev2;
  record(n1, ev1);
  record(standby, ev2);
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n1.join(1s)).ok());
    CO_ASSERT((co_await standby.join(1s)).ok());
    CO_ASSERT((co_await n3.join(1s)).ok());
    EXPECT_EQ(n1.standby(), std::optional<node_id>(2));  // learnt when it joined
    auto a = n1.spawn<echo>();
    CO_ASSERT((co_await n1.register_global("the-echo", a, 1s)).ok());
    auto w = standby.spawn<watcher>();
    auto on3 = n3.spawn<echo>();
    co_await sleep_for(2ms);
    standby.local_actor<watcher>(w)->monitor(on3);
    c.hub().crash(0);
    co_await sleep_for(5ms);  // far below the heartbeat timeout
    EXPECT_EQ(standby.head(), 2u);
    EXPECT_EQ(n1.head(), 2u);
    EXPECT_EQ(n3.head(), 2u);
    EXPECT_FALSE(n1.standby().has_value());  // one standby, used
    EXPECT_TRUE(saw(ev1, 0, member_event::lost));
    EXPECT_TRUE(saw(ev1, 2, member_event::head_changed));
    EXPECT_TRUE(saw(ev2, 2, member_event::head_changed));
    // Names come back to the new head; lookups and registrations go there.
    auto found = co_await n3.whereis_global("the-echo", 1s);
    CO_ASSERT(found.ok());
    EXPECT_EQ(*found, a);
    // The new head judges: a member's crash is its verdict, sent to the others.
    c.hub().crash(3);
    co_await sleep_for(5ms);
    EXPECT_TRUE(saw(ev1, 3, member_event::lost));
    auto* sw = standby.local_actor<watcher>(w);
    CO_ASSERT(sw->events.size() == 1);
    EXPECT_EQ(sw->events[0].why.kind, exit_kind::node_lost);
    EXPECT_EQ(n1.members().size(), 1u);  // the standby, now head
  });
}

// A head that hangs (no transport signal) is replaced after the heartbeat timeout: the
// standby's own silence rule is the verdict, and the members that judged it themselves follow.
TEST(membership, a_hung_head_is_replaced_by_the_standby) {
  cluster c;
  auto& head = c.add(0, with_standby(2));
  auto& n1 = c.add(1, fast());
  auto& standby = c.add(2, with_standby(2));
  events ev1, ev2;
  record(n1, ev1);
  record(standby, ev2);
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n1.join(1s)).ok());
    CO_ASSERT((co_await standby.join(1s)).ok());
    co_await sleep_for(20ms);
    const auto hung_at = clock::now();
    const auto heard_before = standby.last_heard(0);
    CO_ASSERT(heard_before.has_value());
    c.hub().hang(0);
    while (standby.head() != 2 && clock::now() - hung_at < 2s) co_await sleep_for(1ms);
    EXPECT_GE(clock::now() - *heard_before, 100ms);  // never before the configured silence
    EXPECT_EQ(standby.head(), 2u);
    co_await sleep_for(20ms);
    EXPECT_EQ(n1.head(), 2u);
    EXPECT_TRUE(saw(ev1, 0, member_event::lost));
    EXPECT_TRUE(saw(ev1, 2, member_event::head_changed));
    EXPECT_TRUE(saw(ev2, 2, member_event::head_changed));
    EXPECT_EQ(n1.members().size(), 1u);
    (void)head;
  });
}

// The head hangs right after the standby joined, before any heartbeat of it reached the
// standby: its welcome was heard, so its silence is judged by the heartbeat timeout, not the
// join grace that a member never heard from gets (the standby once waited out that grace, 10 s
// by default, while the workers had already turned to it).
TEST(membership, a_head_hung_right_after_the_join_is_replaced_within_the_timeout) {
  cluster c;
  system_config slow_grace = with_standby(2);
  slow_grace.join_grace = 5s;
  auto& head = c.add(0, slow_grace);
  auto& standby = c.add(2, slow_grace);
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await standby.join(1s)).ok());
    const auto hung_at = clock::now();
    c.hub().hang(0);
    while (standby.head() != 2 && clock::now() - hung_at < 4s) co_await sleep_for(1ms);
    EXPECT_EQ(standby.head(), 2u);
    EXPECT_LT(clock::now() - hung_at, 2s) << "taken over on the timeout, not the join grace";
    (void)head;
  });
}

// A head that did not run for longer than the heartbeat timeout (here the whole loop blocks,
// as a SIGSTOP would stop one process) may have been replaced meanwhile: with a standby waiting
// it yields at once (reports itself lost, judges nobody, falls silent), and the standby then
// takes over on that silence. Without a standby the same stall changes nothing.
TEST(membership, a_head_that_stalled_past_the_timeout_yields_to_its_standby) {
  for (const bool with : {true, false}) {
    cluster c;
    auto& head = c.add(0, with ? with_standby(2) : fast());
    auto& n1 = c.add(1, fast());
    auto& standby = c.add(2, with ? with_standby(2) : fast());
    events ev0;
    record(head, ev0);
    c.run([&]() -> awaitable<void> {
      CO_ASSERT((co_await n1.join(1s)).ok());
      CO_ASSERT((co_await standby.join(1s)).ok());
      co_await sleep_for(20ms);
      std::this_thread::sleep_for(150ms);  // every node stalls past the 100 ms timeout
      co_await sleep_for(20ms);
      EXPECT_EQ(saw(ev0, 0, member_event::lost), with) << "with a standby: " << with;
      EXPECT_EQ(head.members().size(), 2u) << "it declared nobody lost for its own stall";
      co_await sleep_for(250ms);  // the yielded head is silent: the standby takes over
      EXPECT_EQ(standby.head(), with ? 2u : 0u);
      EXPECT_EQ(n1.head(), with ? 2u : 0u);
    });
  }
}

// A cut link between the head and the standby only: the members still hear the head, so the
// standby does not take its place (two heads would drive one job), and the head, which hears
// every member but the standby, declares the standby lost and goes on.
TEST(membership, a_standby_cut_off_from_the_head_alone_does_not_take_over) {
  head_with_standby s;
  auto& [c, head, n1, n2, standby] = s;
  events ev0, ev3;
  record(head, ev0);
  record(standby, ev3);
  c.run([&]() -> awaitable<void> {
    CO_ASSERT(co_await s.joined());
    c.hub().cut(0, 3);
    co_await sleep_for(400ms);
    EXPECT_EQ(standby.head(), 0u);
    EXPECT_EQ(n1.head(), 0u);
    EXPECT_EQ(n2.head(), 0u);
    EXPECT_TRUE(saw(ev0, 3, member_event::lost)) << "the head judged the standby";
    EXPECT_FALSE(saw(ev0, 0, member_event::lost)) << "the head did not yield";
    EXPECT_FALSE(saw(ev0, 1, member_event::lost));
    EXPECT_EQ(head.members().size(), 2u);
    EXPECT_FALSE(saw(ev3, 3, member_event::head_changed));
  });
}

// The head cut off from everyone: it yields (reports itself lost, judges nobody: its
// launcher ends no worker), and the standby, which every member tells that the head is
// silent, takes its place.
TEST(membership, a_head_cut_off_from_everyone_yields_and_the_standby_takes_over) {
  head_with_standby s;
  auto& [c, head, n1, n2, standby] = s;
  events ev0, ev1;
  record(head, ev0);
  record(n1, ev1);
  c.run([&]() -> awaitable<void> {
    CO_ASSERT(co_await s.joined());
    for (node_id n : {1u, 2u, 3u}) c.hub().cut(0, n);
    co_await sleep_for(400ms);
    EXPECT_TRUE(saw(ev0, 0, member_event::lost)) << "the head yielded";
    EXPECT_NE(head.why_lost(0).find("the one cut off"), std::string::npos) << head.why_lost(0);
    EXPECT_FALSE(saw(ev0, 1, member_event::lost)) << "it judged nobody";
    EXPECT_FALSE(saw(ev0, 3, member_event::lost));
    EXPECT_EQ(standby.head(), 3u);
    EXPECT_EQ(n1.head(), 3u);
    EXPECT_EQ(n2.head(), 3u);
    EXPECT_TRUE(saw(ev1, 3, member_event::head_changed));
  });
}

// The head cut off from the members but not from the standby: the standby hears the head and
// does not take over on the members' word alone; the head, hearing under half its members,
// yields and falls silent, and then the standby takes its place.
TEST(membership, a_head_cut_off_from_its_members_yields_to_the_standby_that_hears_it) {
  head_with_standby s;
  auto& [c, head, n1, n2, standby] = s;
  events ev0;
  record(head, ev0);
  c.run([&]() -> awaitable<void> {
    CO_ASSERT(co_await s.joined());
    c.hub().cut(0, 1);
    c.hub().cut(0, 2);
    co_await sleep_for(500ms);
    EXPECT_TRUE(saw(ev0, 0, member_event::lost)) << "the head yielded";
    EXPECT_FALSE(saw(ev0, 1, member_event::lost)) << "it judged nobody";
    EXPECT_EQ(standby.head(), 3u);
    EXPECT_EQ(n1.head(), 3u);
    EXPECT_EQ(n2.head(), 3u);
  });
}

// A standby that hears neither the head nor any member is the one cut off: it leaves, and
// the head goes on.
TEST(membership, a_standby_cut_off_from_everyone_leaves) {
  head_with_standby s;
  auto& [c, head, n1, n2, standby] = s;
  events ev3;
  record(standby, ev3);
  c.run([&]() -> awaitable<void> {
    CO_ASSERT(co_await s.joined());
    for (node_id n : {0u, 1u, 2u}) c.hub().cut(3, n);
    co_await sleep_for(400ms);
    EXPECT_TRUE(saw(ev3, 3, member_event::lost));
    EXPECT_NE(standby.why_lost(3).find("standby hears neither"), std::string::npos)
        << standby.why_lost(3);
    EXPECT_EQ(standby.head(), 0u);
    EXPECT_EQ(n1.head(), 0u);
    EXPECT_EQ(head.members().size(), 2u);
  });
}

// A split with the standby on the smaller side: {head, n1, n2} | {standby, n3}. The head
// hears a majority of the others (n1, n2 of n1, n2, n3, standby: not under half) and goes on;
// the standby hears n3 alone, who reports the head silent, but the two of them are no
// majority: no takeover (two heads), and it leaves after three timeouts.
TEST(membership, a_standby_on_the_smaller_side_of_a_split_does_not_take_over) {
  cluster c;
  auto& head = c.add(0, with_standby(4));
  auto& n1 = c.add(1, fast());
  auto& n2 = c.add(2, fast());
  auto& n3 = c.add(3, fast());
  auto& standby = c.add(4, with_standby(4));
  events ev0, ev4;
  record(head, ev0);
  record(standby, ev4);
  c.run([&]() -> awaitable<void> {
    for (auto* n : {&n1, &n2, &n3, &standby}) CO_ASSERT((co_await n->join(1s)).ok());
    co_await sleep_for(20ms);
    for (node_id a : {0u, 1u, 2u}) {
      for (node_id b : {3u, 4u}) c.hub().cut(a, b);
    }
    co_await sleep_for(250ms);
    EXPECT_FALSE(saw(ev0, 0, member_event::lost)) << "the head did not yield";
    EXPECT_TRUE(saw(ev0, 3, member_event::lost));
    EXPECT_TRUE(saw(ev0, 4, member_event::lost));
    EXPECT_EQ(standby.head(), 0u) << "no takeover on the smaller side";
    EXPECT_EQ(n1.head(), 0u);
    co_await sleep_for(200ms);  // past three timeouts: the standby leaves
    EXPECT_TRUE(saw(ev4, 4, member_event::lost));
    EXPECT_NE(standby.why_lost(4).find("no majority"), std::string::npos) << standby.why_lost(4);
    EXPECT_FALSE(saw(ev4, 4, member_event::head_changed));
  });
}

// The head cut off from everyone and one member cut off from the standby too: the standby
// takes over on the others' word (the silent one counts as not hearing it), and as the new
// head it judges that member, whose silence it had noted before (it once stayed suspected,
// never declared).
TEST(membership, a_member_the_standby_suspected_is_judged_once_it_is_the_head) {
  head_with_standby s;
  auto& [c, head, n1, n2, standby] = s;
  events ev3;
  record(standby, ev3);
  c.run([&]() -> awaitable<void> {
    CO_ASSERT(co_await s.joined());
    for (node_id n : {1u, 2u, 3u}) c.hub().cut(0, n);
    c.hub().cut(2, 3);
    c.hub().cut(2, 1);
    co_await sleep_for(400ms);
    EXPECT_EQ(standby.head(), 3u);
    EXPECT_EQ(n1.head(), 3u);
    EXPECT_TRUE(saw(ev3, 2, member_event::lost)) << "the new head judged the silent member";
    EXPECT_EQ(standby.members().size(), 1u);
    (void)head;
  });
}

// Without a standby, a lost head stays lost: nobody takes its place.
TEST(membership, without_a_standby_the_head_is_not_replaced) {
  cluster c;
  c.add(0, fast());
  auto& n1 = c.add(1, fast());
  auto& n2 = c.add(2, fast());
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n1.join(1s)).ok());
    CO_ASSERT((co_await n2.join(1s)).ok());
    EXPECT_FALSE(n1.standby().has_value());
    c.hub().crash(0);
    co_await sleep_for(5ms);
    EXPECT_EQ(n1.head(), 0u);
    EXPECT_EQ(n2.head(), 0u);
  });
}

TEST(membership, goodbye_is_a_shutdown_not_a_failure) {
  cluster c;
  auto& head = c.add(0, fast());
  auto& n1 = c.add(1, fast());
  events ev;
  record(head, ev);
  c.run([&]() -> awaitable<void> {
    CO_ASSERT((co_await n1.join(1s)).ok());
    auto w = head.spawn<watcher>();
    auto a = n1.spawn<echo>();
    co_await sleep_for(1ms);
    head.local_actor<watcher>(w)->monitor(a);
    co_await sleep_for(2ms);
    n1.shutdown();
    co_await sleep_for(5ms);
    CO_ASSERT(ev.seen.size() == 2);
    EXPECT_EQ(ev.seen[1], std::make_pair(node_id{1}, member_event::goodbye));
    auto* hw = head.local_actor<watcher>(w);
    CO_ASSERT(hw->events.size() == 1);
    EXPECT_FALSE(hw->events[0].why.abnormal());  // shutdown
  });
}

}  // namespace
}  // namespace moevement::actors::testing
