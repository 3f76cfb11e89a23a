// Only the head declares a member lost. The suspicion book's verdicts, then the membership
// protocol under the deterministic scheduler: a link cut between two live workers, a
// connection that fails between live workers, a cut that heals inside the window, a worker cut
// off from all its peers, and a verdict that does not come from the head.
#include "actors/suspicions.hpp"
#include "actors/deterministic.hpp"
#include "tests/actors/harness.hpp"

namespace moevement::actors::testing {
namespace {

using book_clock = suspicion_book::clock;

TEST(suspicion_book, of_two_nodes_that_cannot_hear_each_other_one_is_declared) {
  suspicion_book b;
  const auto t = book_clock::time_point{} + 10s;
  b.report(1, 2, t, "x");
  b.report(2, 1, t + 10ms, "y");
  EXPECT_TRUE(b.decide(t + 100ms, 200ms, 60s).empty());  // the window is not over yet
  EXPECT_EQ(*b.next_due(200ms), t + 200ms);
  const auto v = b.decide(t + 210ms, 200ms, 60s);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].node, 2u);  // the first report's far end; its own report falls with it
  EXPECT_NE(v[0].why.find("unreachable from node 1"), std::string::npos) << v[0].why;
  EXPECT_TRUE(b.empty());
}

TEST(suspicion_book, a_reporter_that_hears_nobody_is_the_one_cut_off) {
  suspicion_book b;
  const auto t = book_clock::time_point{} + 10s;
  b.report(1, 2, t, "x");
  b.report(1, 3, t, "x");
  b.report(2, 1, t, "x");
  b.report(3, 1, t, "x");
  const auto v = b.decide(t + 200ms, 200ms, 60s);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].node, 1u);
  EXPECT_TRUE(b.empty());
}

TEST(suspicion_book, reports_about_a_node_the_judge_does_not_hear_wait) {
  suspicion_book b;
  const auto t = book_clock::time_point{} + 10s;
  b.report(1, 2, t, "x");
  b.report(1, 3, t, "x");
  const auto deaf_to_2_and_3 = [](suspicion_book::node_id n) { return n != 2 && n != 3; };
  EXPECT_TRUE(
      b.decide(t + 1s, 200ms, 60s, deaf_to_2_and_3).empty());  // not node 1: it may be right
  EXPECT_FALSE(b.empty());
}

TEST(suspicion_book, a_withdrawn_or_forgotten_report_takes_no_verdict) {
  suspicion_book b;
  const auto t = book_clock::time_point{} + 10s;
  b.report(1, 2, t, "x");
  b.report(1, 2, t + 50ms, "again");  // keeps its first time
  b.withdraw(1, 2);
  b.report(3, 4, t, "x");
  b.forget(4);
  EXPECT_TRUE(b.empty());
  EXPECT_FALSE(b.next_due(200ms).has_value());
  EXPECT_TRUE(b.decide(t + 1s, 200ms, 60s).empty());
}

TEST(suspicion_book, a_reporter_whose_word_already_cost_a_member_is_the_one_judged_next) {
  suspicion_book b;
  const auto t = book_clock::time_point{} + 10s;
  b.report(1, 2, t, "x");
  auto v = b.decide(t + 200ms, 200ms, 60s);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].node, 2u);
  b.report(1, 3, t + 10s, "x");  // another peer, one at a time: node 1's own link
  v = b.decide(t + 10s + 200ms, 200ms, 60s);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].node, 1u);
  EXPECT_NE(v[0].why.find("after node 2"), std::string::npos) << v[0].why;
  EXPECT_TRUE(b.empty());
  // Past the memory, a report is judged on its own again.
  b.report(4, 5, t, "x");
  ASSERT_EQ(b.decide(t + 200ms, 200ms, 60s).size(), 1u);
  b.report(4, 6, t + 61s, "x");
  v = b.decide(t + 61s + 200ms, 200ms, 60s);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].node, 6u);
}

// A verdict that others' reports backed up marks nobody, and a suspect others report too is
// theirs to lose: neither case is one member losing its peers alone.
TEST(suspicion_book, a_verdict_others_back_up_counts_against_no_reporter) {
  suspicion_book b;
  const auto t = book_clock::time_point{} + 10s;
  b.report(1, 2, t, "x");
  b.report(3, 2, t, "x");  // node 2 cut off from both
  auto v = b.decide(t + 200ms, 200ms, 60s);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].node, 2u);
  b.report(1, 4, t + 10s, "x");  // node 1's next report, alone: judged on its own
  v = b.decide(t + 10s + 200ms, 200ms, 60s);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].node, 4u);
  b.report(1, 5, t + 20s, "x");  // node 1's word alone cost node 4: but node 3 reports 5 too
  b.report(3, 5, t + 20s, "x");
  v = b.decide(t + 20s + 200ms, 200ms, 60s);
  ASSERT_EQ(v.size(), 1u);
  EXPECT_EQ(v[0].node, 5u);
}

// A head and three workers, heartbeats every 100 ms, lost after 1 s of silence.
struct four_nodes {
  deterministic d;
  system_config cfg;
  std::map<node_id, std::vector<std::pair<node_id, member_event>>> seen;

  // node1_timeout: node 1's own heartbeat timeout (its reports can then ripen before the head
  // has timed anything out itself).
  explicit four_nodes(std::chrono::milliseconds window = 200ms,
                      std::chrono::milliseconds node1_timeout = 1000ms) {
    cfg.heartbeat_interval = 100ms;
    cfg.heartbeat_timeout = 1000ms;
    cfg.suspicion_window = window;
    for (node_id n = 0; n < 4; ++n) {
      system_config own = cfg;
      if (n == 1) own.heartbeat_timeout = node1_timeout;
      auto& s = d.add(n, own);
      cfg.head = 0;
      s.on_membership([this, n](node_id who, member_event e) {
        if (e != member_event::up) seen[n].emplace_back(who, e);
      });
    }
  }
  awaitable<void> join() {
    for (node_id n = 1; n < 4; ++n) {
      auto joined = co_await d[n].join(1s);
      EXPECT_TRUE(joined.ok());
    }
    co_await d[0].sleep_for(3s);  // steady state: heartbeats all ways, nothing lost
  }
  bool member(node_id at, node_id n) {
    for (const auto& m : d[at].members())
      if (m.node == n) return true;
    return false;
  }
};

TEST(verdicts, a_link_cut_between_two_live_workers_is_judged_by_the_head_alone) {
  four_nodes c;
  c.d.run_body([&]() -> awaitable<void> {
    co_await c.join();
    auto w = c.d[3].spawn<watcher>();
    std::vector<actor_ref> on;
    for (node_id n : {1u, 2u}) on.push_back(c.d[n].spawn<echo>());
    co_await c.d[0].sleep_for(10ms);
    for (const auto& a : on) c.d[3].local_actor<watcher>(w)->monitor(a);
    co_await c.d[0].sleep_for(10ms);
    c.d.hub().cut(1, 2);
    co_await c.d[0].sleep_for(900ms);
    EXPECT_TRUE(c.seen.empty());  // nobody decides alone before the timeout
    co_await c.d[0].sleep_for(4s);
    // The head declared exactly one of the pair, and every member acted on that one verdict.
    CO_ASSERT(c.seen[0].size() == 1u);
    const node_id lost = c.seen[0][0].first;
    const node_id kept = lost == 1 ? 2 : 1;
    EXPECT_TRUE(lost == 1 || lost == 2);
    EXPECT_EQ(c.seen[0][0].second, member_event::lost);
    EXPECT_EQ(c.seen[3], c.seen[0]);
    EXPECT_EQ(c.seen[kept], c.seen[0]);
    // Told it is fenced (its own id, lost); then it stops hearing the head, which forgot it.
    CO_ASSERT(!c.seen[lost].empty());
    EXPECT_EQ(c.seen[lost][0], c.seen[0][0]);
    EXPECT_TRUE(c.member(0, kept));
    EXPECT_TRUE(c.member(3, kept));
    EXPECT_FALSE(c.member(3, lost));
    EXPECT_GE(c.d[kept].stats().suspicions, 1u);
    EXPECT_EQ(c.d[0].stats().verdicts, 1u);
    // Node 3 never lost sight of either: its monitor fired from the head's verdict.
    const auto& events = c.d[3].local_actor<watcher>(w)->events;
    CO_ASSERT(events.size() == 1u);
    EXPECT_EQ(events[0].who, on[lost - 1]);
    EXPECT_EQ(events[0].why.kind, exit_kind::node_lost);
    EXPECT_NE(events[0].why.detail.find("unreachable from node"), std::string::npos);
  });
}

TEST(verdicts, a_failed_connection_between_live_workers_costs_no_member) {
  four_nodes c;
  c.d.run_body([&]() -> awaitable<void> {
    co_await c.join();
    auto e = c.d[2].spawn<echo>();
    typed_ref<echo> from1{&c.d[1], e};
    for (int i = 0; i < 3; ++i) {
      c.d.hub().drop_connection(1, 2);
      co_await c.d[0].sleep_for(300ms);
    }
    // Redialled: a message goes through, and nobody was lost anywhere after 5 s.
    CO_ASSERT(from1.tell<msg::Ping>([](msg::Ping::Builder b) { b.setSeq(5); }).ok());
    co_await c.d[0].sleep_for(5s);
    EXPECT_TRUE(c.seen.empty());
    EXPECT_EQ(c.d[2].local_actor<echo>(e)->log, (std::vector<std::uint64_t>{5}));
    EXPECT_GE(c.d[1].stats().reconnects, 3u);
    EXPECT_GE(c.d[2].stats().reconnects, 3u);
    EXPECT_EQ(c.d[0].stats().verdicts, 0u);
  });
}

TEST(verdicts, a_cut_that_heals_within_the_window_is_withdrawn) {
  four_nodes c(500ms);
  c.d.run_body([&]() -> awaitable<void> {
    co_await c.join();
    c.d.hub().cut(1, 2);
    co_await c.d[0].sleep_for(1150ms);  // both reported by now
    EXPECT_GE(c.d[1].stats().suspicions + c.d[2].stats().suspicions, 1u);
    c.d.hub().heal(1, 2);
    co_await c.d[0].sleep_for(5s);
    EXPECT_TRUE(c.seen.empty());
    EXPECT_EQ(c.d[0].stats().verdicts, 0u);
    EXPECT_EQ(c.d[0].members().size(), 3u);
  });
}

TEST(verdicts, a_worker_cut_off_from_every_peer_is_the_one_declared) {
  four_nodes c;
  c.d.run_body([&]() -> awaitable<void> {
    co_await c.join();
    c.d.hub().cut(1, 2);
    c.d.hub().cut(1, 3);
    co_await c.d[0].sleep_for(5s);
    CO_ASSERT(c.seen[0].size() == 1u);
    EXPECT_EQ(c.seen[0][0].first, 1u);
    EXPECT_TRUE(c.member(0, 2));
    EXPECT_TRUE(c.member(0, 3));
    EXPECT_TRUE(c.member(2, 3));
  });
}

// Worker 1 loses its peers one at a time (a link of its own that flaps): its first report
// costs worker 2 its place (the far end: the head cannot tell), its next one costs worker 1
// its own, and worker 3 stays. (Worker 3 was declared, and then any next peer of worker 1.)
TEST(verdicts, a_worker_that_loses_its_peers_one_by_one_is_the_one_declared_next) {
  four_nodes c(200ms, 400ms);  // worker 1 reports first
  c.d.run_body([&]() -> awaitable<void> {
    co_await c.join();
    c.d.hub().cut(1, 2);
    co_await c.d[0].sleep_for(3s);
    CO_ASSERT(c.seen[0].size() == 1u);
    EXPECT_EQ(c.seen[0][0].first, 2u);
    c.d.hub().cut(1, 3);
    co_await c.d[0].sleep_for(3s);
    CO_ASSERT(c.seen[0].size() == 2u);
    EXPECT_EQ(c.seen[0][1].first, 1u) << "worker 3, which the head and worker 2 hear, declared";
    EXPECT_TRUE(c.member(0, 3));
  });
}

// Two workers hang together: the third reports both (first: its timeout is shorter), but the
// head does not hear them either, so its own heartbeats decide; the healthy reporter is not
// taken for the one cut off.
TEST(verdicts, two_hung_workers_do_not_fence_the_one_that_reports_them) {
  four_nodes c(200ms, 400ms);
  c.d.run_body([&]() -> awaitable<void> {
    co_await c.join();
    c.d.hub().hang(2);
    c.d.hub().hang(3);
    co_await c.d[0].sleep_for(5s);
    EXPECT_TRUE(c.member(0, 1));
    EXPECT_FALSE(c.member(0, 2));
    EXPECT_FALSE(c.member(0, 3));
    EXPECT_EQ(c.d[0].stats().verdicts, 0u);  // the head's own heartbeats, not reports
    EXPECT_GE(c.d[1].stats().suspicions, 1u);
  });
}

TEST(verdicts, a_verdict_that_does_not_come_from_the_head_is_refused) {
  four_nodes c;
  c.d.run_body([&]() -> awaitable<void> {
    co_await c.join();
    transport::outgoing_envelope out({{}, {1, 0, 0}, capnp::typeId<proto::MemberLost>(), 0, 0});
    auto who = out.init_payload<proto::MemberLost>().initMember();
    who.setNode(3);
    who.setIncarnation(1);
    const auto malformed = c.d[1].stats().malformed;
    CO_ASSERT(c.d[2].send_envelope(1, out).ok());
    co_await c.d[0].sleep_for(2s);
    EXPECT_EQ(c.d[1].stats().malformed, malformed + 1);
    EXPECT_TRUE(c.member(1, 3));
    EXPECT_TRUE(c.seen.empty());
  });
}

// MemberUp comes from the head only (its join): one from another member would rewrite a
// member's incarnation (its fence lifted, every message to it refused) on that member's word.
TEST(verdicts, a_member_up_that_does_not_come_from_the_head_is_refused) {
  four_nodes c;
  c.d.run_body([&]() -> awaitable<void> {
    co_await c.join();
    const auto incarnation_of = [&](node_id at, node_id n) {
      for (const auto& m : c.d[at].members())
        if (m.node == n) return m.incarnation;
      return std::uint32_t{0};
    };
    const std::uint32_t before = incarnation_of(1, 3);
    transport::outgoing_envelope out({{}, {1, 0, 0}, capnp::typeId<proto::MemberUp>(), 0, 0});
    auto who = out.init_payload<proto::MemberUp>().initMember();
    who.setNode(3);
    who.setIncarnation(before + 99);
    const auto malformed = c.d[1].stats().malformed;
    CO_ASSERT(c.d[2].send_envelope(1, out).ok());
    co_await c.d[0].sleep_for(2s);
    EXPECT_EQ(c.d[1].stats().malformed, malformed + 1);
    EXPECT_EQ(incarnation_of(1, 3), before);
  });
}

}  // namespace
}  // namespace moevement::actors::testing
