// The actor system on one node and across simulated nodes: tell/ask, deadlines, reentrancy,
// dead targets and incarnations, bounded mailboxes, monitors, links, malformed input.
#include <asio/steady_timer.hpp>

#include "tests/actors/harness.hpp"

namespace moevement::actors::testing {
namespace {

TEST(actors, tell_and_ask_locally) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto e = sys.spawn<echo>();
    for (std::uint64_t i = 1; i <= 3; ++i) {
      EXPECT_TRUE(e.tell<msg::Ping>([i](msg::Ping::Builder b) { b.setSeq(i); }).ok());
    }
    auto sum = co_await e.ask<msg::Add>(1s, [](msg::Add::Builder b) {
      b.setA(40);
      b.setB(2);
    });
    CO_ASSERT(sum.ok());
    EXPECT_EQ(sum->get().getValue(), 42);
    // Tells sent before the ask were handled before it (FIFO per sender).
    auto n = co_await e.ask<msg::Get>(1s);
    CO_ASSERT(n.ok());
    EXPECT_EQ(n->get().getN(), 3u);
    std::vector<std::uint64_t> seen;
    for (auto v : n->get().getLog()) seen.push_back(v);
    EXPECT_EQ(seen, (std::vector<std::uint64_t>{1, 2, 3}));
  });
}

TEST(actors, delivery_is_posted_never_inline) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto e = sys.spawn<echo>();
    co_await sleep_for(1ms);  // let on_start run
    CO_ASSERT(e.tell<msg::Ping>([](msg::Ping::Builder b) { b.setSeq(7); }).ok());
    // Not handled yet: the handler runs later, on the loop.
    EXPECT_TRUE(sys.local_actor<echo>(e)->log.empty());
    co_await sleep_for(1ms);
    EXPECT_EQ(sys.local_actor<echo>(e)->log.size(), 1u);
  });
}

TEST(actors, a_handler_that_awaits_keeps_the_actor_busy) {
  // Reentrancy policy: one message at a time, start to finish, even across co_await.
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto e = sys.spawn<echo>();
    auto first = [&]() -> awaitable<void> {
      auto r = co_await e.ask<msg::Sleep>(2s, [](msg::Sleep::Builder b) {
        b.setMs(30);
        b.setTag(1);
      });
      EXPECT_TRUE(r.ok());
    };
    asio::co_spawn(c.io(), first, asio::detached);
    co_await sleep_for(5ms);  // the first handler is now suspended in its timer
    auto r2 = co_await e.ask<msg::Sleep>(2s, [](msg::Sleep::Builder b) {
      b.setMs(0);
      b.setTag(2);
    });
    CO_ASSERT(r2.ok());
    // Start and end of message 1 come before the start of message 2: no interleaving.
    EXPECT_EQ(sys.local_actor<echo>(e)->log, (std::vector<std::uint64_t>{10, 11, 20, 21}));
  });
}

TEST(actors, ask_from_a_handler_to_another_actor) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto a = sys.spawn<echo>();
    auto b = sys.spawn<echo>();
    auto r = co_await a.ask<msg::Relay>(1s, [&](msg::Relay::Builder m) {
      m.setTo(b.ref.actor);
      m.setA(9);
    });
    CO_ASSERT(r.ok());
    EXPECT_EQ(r->get().getValue(), 10);
  });
}

TEST(actors, ask_times_out_with_an_error) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto e = sys.spawn<echo>();
    const auto t0 = clock::now();
    auto r = co_await e.ask<msg::Sleep>(20ms, [](msg::Sleep::Builder b) {
      b.setMs(500);
      b.setTag(1);
    });
    const auto waited = clock::now() - t0;
    CO_ASSERT(!r.ok());
    EXPECT_NE(r.err().message.find("timed out"), std::string::npos) << r.err().message;
    EXPECT_GE(waited, 20ms);
    EXPECT_LT(waited, 500ms);  // it did not wait for the handler
    // A second ask queued behind the sleeping one, whose caller gives up, is never handled.
    auto r2 = co_await e.ask<msg::Add>(10ms);
    EXPECT_FALSE(r2.ok());
    co_await sleep_for(550ms);
    EXPECT_EQ(sys.stats().expired, 1u);
  });
}

TEST(actors, dead_target_and_dead_incarnation_fail_fast) {
  cluster c;
  auto& sys = c.add(1, {.incarnation = 3});
  c.run([&]() -> awaitable<void> {
    auto e = sys.spawn<echo>();
    sys.stop(e);
    EXPECT_FALSE(sys.alive(e));
    EXPECT_FALSE(e.tell<msg::Ping>().ok());
    const auto t0 = clock::now();
    auto r = co_await e.ask<msg::Add>(10s);
    CO_ASSERT(!r.ok());
    EXPECT_LT(clock::now() - t0, 1s);  // at once, not at the deadline
    EXPECT_NE(r.err().message.find("not running"), std::string::npos) << r.err().message;

    auto live = sys.spawn<echo>();
    actor_ref old = live;
    old.incarnation = 2;  // the same slot in the node's previous life
    auto r2 = co_await sys.ask<msg::Add, msg::Sum>(old, 10s);
    CO_ASSERT(!r2.ok());
    EXPECT_NE(r2.err().message.find("incarnation"), std::string::npos) << r2.err().message;
  });
}

TEST(actors, untyped_sends_of_the_wrong_kind_fail_at_once) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto e = sys.spawn<echo>();
    // Ping is a tell: asking it would never be answered, so it is refused.
    auto r = co_await sys.ask<msg::Ping, msg::Sum>(e, 10s);
    CO_ASSERT(!r.ok());
    // Add is answered with Sum, not Done.
    auto r2 = co_await sys.ask<msg::Add, msg::Done>(e, 10s);
    EXPECT_FALSE(r2.ok());
    // Add is an ask: telling it is refused too.
    EXPECT_FALSE(sys.tell<msg::Add>(e).ok());
    // A message type the actor does not take at all.
    EXPECT_FALSE(sys.tell<msg::Sum>(e).ok());
  });
}

class twice : public actor {
 public:
  using interface = actors::interface<tell_t<msg::Ping>>;
  twice() {
    on<msg::Ping>(&twice::ping);
    on<msg::Ping>(&twice::ping);
  }

 private:
  awaitable<void> ping(msg::Ping::Reader) { co_return; }
};

TEST(actors, a_message_type_has_one_handler) {
  EXPECT_THROW(twice{}, std::logic_error);
}

TEST(actors, asks_queued_at_a_stopping_actor_get_an_error_not_a_timeout) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto e = sys.spawn<echo>();
    auto sleeper = [&]() -> awaitable<void> {
      auto r = co_await e.ask<msg::Sleep>(10s, [](msg::Sleep::Builder b) { b.setMs(5000); });
      EXPECT_FALSE(r.ok());
    };
    asio::co_spawn(c.io(), sleeper, asio::detached);
    co_await sleep_for(5ms);
    const auto t0 = clock::now();
    auto stopper = [&]() -> awaitable<void> {
      co_await sleep_for(5ms);
      sys.stop(e);  // cancels the sleeping handler, fails the queued ask
    };
    asio::co_spawn(c.io(), stopper, asio::detached);
    auto r = co_await e.ask<msg::Add>(10s);
    CO_ASSERT(!r.ok());
    EXPECT_LT(clock::now() - t0, 1s);
  });
}

TEST(actors, bounded_mailbox_refuses_when_full) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto e = sys.spawn_with<echo>({.mailbox_capacity = 4});
    // Nothing runs between these sends: the fifth finds the mailbox full.
    for (int i = 0; i < 4; ++i) EXPECT_TRUE(e.tell<msg::Ping>().ok());
    auto full = e.tell<msg::Ping>();
    CO_ASSERT(!full.ok());
    EXPECT_NE(full.err().message.find("full"), std::string::npos);
    auto r = co_await e.ask<msg::Add>(1s);
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(sys.stats().mailbox_full, 2u);
    co_await sleep_for(2ms);  // drained
    EXPECT_TRUE(e.tell<msg::Ping>().ok());
  });
}

TEST(actors, handler_failure_answers_the_ask_and_stops_the_actor) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto e = sys.spawn<echo>();
    auto w = sys.spawn<watcher>();
    sys.monitor(w, e);
    EXPECT_TRUE(e.tell<msg::Crash>([](msg::Crash::Builder b) { b.setWhy("boom"); }).ok());
    co_await sleep_for(2ms);
    EXPECT_FALSE(sys.alive(e));
    auto* wa = sys.local_actor<watcher>(w);
    CO_ASSERT(wa->events.size() == 1);
    EXPECT_EQ(wa->events[0].who, e.ref);
    EXPECT_EQ(wa->events[0].why.kind, exit_kind::error);
    EXPECT_NE(wa->events[0].why.detail.find("boom"), std::string::npos);
    // Monitoring a dead actor gives noproc at once.
    sys.monitor(w, e);
    co_await sleep_for(1ms);
    CO_ASSERT(wa->events.size() == 2);
    EXPECT_EQ(wa->events[1].why.kind, exit_kind::noproc);
  });
}

TEST(actors, links_propagate_abnormal_exits_and_trap_turns_them_into_messages) {
  cluster c;
  auto& sys = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto a = sys.spawn<echo>();
    auto b = sys.spawn<echo>();
    auto trapper = sys.spawn<watcher>(true);
    co_await sleep_for(1ms);
    sys.local_actor<echo>(a)->link(b);
    sys.local_actor<watcher>(trapper)->link(b);
    EXPECT_TRUE(a.tell<msg::Crash>([](msg::Crash::Builder m) { m.setWhy("bad"); }).ok());
    co_await sleep_for(2ms);
    EXPECT_FALSE(sys.alive(a));
    EXPECT_FALSE(sys.alive(b));  // died with a
    EXPECT_TRUE(sys.alive(trapper));
    auto* t = sys.local_actor<watcher>(trapper);
    CO_ASSERT(t->events.size() == 1);
    EXPECT_TRUE(t->events[0].is_exit);
    EXPECT_EQ(t->events[0].who, b.ref);
    EXPECT_EQ(t->events[0].why.kind, exit_kind::error);

    // A normal exit does not propagate.
    auto x = sys.spawn<echo>();
    auto y = sys.spawn<echo>();
    co_await sleep_for(1ms);
    sys.local_actor<echo>(x)->link(y);
    sys.stop(x, exit_reason::normal());
    co_await sleep_for(1ms);
    EXPECT_TRUE(sys.alive(y));
  });
}

TEST(actors, remote_tell_ask_and_errors_over_the_loopback_link) {
  cluster c;
  auto& n1 = c.add(1);
  auto& n2 = c.add(2);
  c.run([&]() -> awaitable<void> {
    auto e = n2.spawn<echo>();
    typed_ref<echo> remote{&n1, e.ref};  // node 1 talks to node 2's actor
    EXPECT_TRUE(remote.tell<msg::Ping>([](msg::Ping::Builder b) { b.setSeq(5); }).ok());
    auto r = co_await remote.ask<msg::Add>(1s, [](msg::Add::Builder b) {
      b.setA(1);
      b.setB(2);
    });
    CO_ASSERT(r.ok());
    EXPECT_EQ(r->get().getValue(), 3);
    auto n = co_await remote.ask<msg::Get>(1s);
    CO_ASSERT(n.ok());
    EXPECT_EQ(n->get().getN(), 1u);
    EXPECT_GE(c.link(1).stats().sent, 3u);

    // Dead remote target: an error reply, not a timeout.
    n2.stop(e);
    const auto t0 = clock::now();
    auto dead = co_await remote.ask<msg::Add>(10s);
    CO_ASSERT(!dead.ok());
    EXPECT_LT(clock::now() - t0, 1s);
    // Remote handler timeout.
    auto e2 = n2.spawn<echo>();
    typed_ref<echo> r2{&n1, e2.ref};
    auto slow = co_await r2.ask<msg::Sleep>(20ms, [](msg::Sleep::Builder b) { b.setMs(200); });
    EXPECT_FALSE(slow.ok());
  });
}

TEST(actors, a_remote_ref_of_a_dead_incarnation_fails) {
  cluster c;
  auto& n1 = c.add(1);
  auto& n2 = c.add(2, {.incarnation = 4});
  c.run([&]() -> awaitable<void> {
    auto e = n2.spawn<echo>();
    actor_ref stale = e;
    stale.incarnation = 3;
    // Node 1 does not know node 2's incarnation (no membership): node 2 refuses it.
    const auto t0 = clock::now();
    auto r = co_await n1.ask<msg::Add, msg::Sum>(stale, 10s);
    CO_ASSERT(!r.ok());
    EXPECT_LT(clock::now() - t0, 1s);
    EXPECT_NE(r.err().message.find("incarnation"), std::string::npos) << r.err().message;
    EXPECT_EQ(n2.stats().dead_letters, 1u);
  });
}

TEST(actors, malformed_wire_messages_get_an_error_reply_not_a_crash) {
  cluster c;
  auto& n1 = c.add(1);
  auto probe_link = c.hub().attach(9);  // a raw peer that crafts envelopes
  std::vector<std::string> errors;
  std::vector<std::uint64_t> reply_types;
  transport::link_handlers h;
  h.on_message = [&](node_id, transport::incoming_envelope env) {
    reply_types.push_back(env.header().type_id);
    if (auto e = env.payload<proto::ErrorReply>(); e.ok()) errors.push_back(e->getMessage());
  };
  probe_link->set_handlers(h);
  c.run([&]() -> awaitable<void> {
    auto e = n1.spawn<echo>();
    const transport::actor_address from{9, 1, 77};
    // 1. Bytes that are no envelope: counted by the link, nothing else happens.
    const std::byte junk[24] = {std::byte{0xff}, std::byte{0xff}, std::byte{0xff}};
    c.hub().inject(9, 1, junk);
    // 2. An ask of a type the actor does not handle.
    {
      transport::outgoing_envelope out({from, e.ref.address(), 0, 1, 0});
      out.init_payload<msg::Count>();
      EXPECT_TRUE(probe_link->send(1, out.to_words()).ok());
    }
    // An envelope from node 9 whose payload is a list, not the struct its type id names.
    const auto send_list_payload = [&](std::uint32_t incarnation, std::uint64_t actor,
                                       std::uint64_t type_id, std::uint64_t correlation_id) {
      capnp::MallocMessageBuilder mb;
      auto root = mb.initRoot<wire::Envelope>();
      auto s = root.initSender();
      s.setNode(9);
      s.setIncarnation(1);
      s.setActor(77);
      auto r = root.initReceiver();
      r.setNode(e.ref.node);
      r.setIncarnation(incarnation);
      r.setActor(actor);
      root.setTypeId(type_id);
      root.setCorrelationId(correlation_id);
      root.getPayload().initAs<capnp::List<std::uint64_t>>(3);
      EXPECT_TRUE(probe_link->send(1, capnp::messageToFlatArray(mb)).ok());
    };
    // 3. An ask whose type id says Add but whose payload is a list.
    send_list_payload(e.ref.incarnation, e.ref.actor, capnp::typeId<msg::Add>(), 2);
    // 4. An ask to an actor that does not exist.
    {
      transport::outgoing_envelope out({from, {1, 1, 999}, 0, 3, 0});
      out.init_payload<msg::Add>();
      EXPECT_TRUE(probe_link->send(1, out.to_words()).ok());
    }
    // 5. A system message (to actor 0) whose payload is a list, not the struct its type names:
    // counted, never fatal (it threw out of the event loop, ending the process).
    send_list_payload(0, 0, capnp::typeId<proto::Down>(), 0);
    co_await sleep_for(5ms);
    EXPECT_EQ(c.link(1).stats().malformed, 1u);
    EXPECT_EQ(errors.size(), 3u);
    for (auto& m : errors) EXPECT_FALSE(m.empty());
    EXPECT_EQ(n1.stats().malformed, 3u);
    // The actor is unharmed.
    auto ok = co_await e.ask<msg::Add>(1s, [](msg::Add::Builder b) { b.setA(2); });
    CO_ASSERT(ok.ok());
    EXPECT_EQ(ok->get().getValue(), 2);
  });
}

// A member speaks only for itself (the link's `from` proved the job token on its connection):
// a message naming another node as its sender, a reply from a node that was not asked, and a
// Down or Unregister about another node's actor are dropped and counted, never acted on.
// A handler reads who sent its message (sender()): the sending actor, from another node too;
// nobody for a tell from outside an actor. Production handlers check it (the worker agent takes
// roles, Restores and Shutdowns only from its head).
TEST(actors, a_handler_knows_who_sent_its_message) {
  cluster c;
  auto& n1 = c.add(1);
  auto& n2 = c.add(2);
  c.run([&]() -> awaitable<void> {
    auto e = n2.spawn<echo>();
    auto from = n1.spawn<echo>();
    co_await sleep_for(1ms);
    EXPECT_TRUE(n1.tell<msg::Ping>(
                      e.ref, [](msg::Ping::Builder b) { b.setSeq(1); }, from.ref)
                    .ok());
    EXPECT_TRUE(n1.tell<msg::Ping>(e.ref, [](msg::Ping::Builder b) { b.setSeq(2); }).ok());
    EXPECT_TRUE(n2.tell<msg::Ping>(
                      e.ref, [](msg::Ping::Builder b) { b.setSeq(3); }, e.ref)
                    .ok());
    co_await sleep_for(5ms);
    const auto* echoed = n2.local_actor<echo>(e);
    CO_ASSERT(echoed->senders.size() == 3u);
    std::map<std::uint64_t, actor_ref> got;  // by Ping (the local one arrives first)
    for (std::size_t i = 0; i < 3; ++i) got[echoed->log[i]] = echoed->senders[i];
    EXPECT_EQ(got[1], from.ref);
    EXPECT_FALSE(got[2].valid()) << "a tell from outside an actor has no sender";
    EXPECT_EQ(got[3], e.ref);
  });
}

TEST(actors, a_member_speaks_only_for_itself) {
  cluster c;
  auto& n1 = c.add(1);
  c.add(2);
  auto asked = c.hub().attach(9);  // a raw node that n1 asks
  auto other = c.hub().attach(8);  // a raw node that answers for it
  std::vector<transport::envelope_header> to_asked;
  std::vector<transport::envelope_header> to_other;
  transport::link_handlers h;
  h.on_message = [&](node_id, transport::incoming_envelope env) {
    to_asked.push_back(env.header());
  };
  asked->set_handlers(h);
  h.on_message = [&](node_id, transport::incoming_envelope env) {
    to_other.push_back(env.header());
  };
  other->set_handlers(h);
  c.run([&]() -> awaitable<void> {
    auto e = n1.spawn<echo>();
    auto w = n1.spawn<watcher>(true);
    auto* wa = n1.local_actor<watcher>(w);
    co_await sleep_for(1ms);
    // 1. An ask from node 8 in node 2's name: no reply goes to node 2 (or anywhere).
    {
      transport::outgoing_envelope out(
          {{2, 1, 77}, e.ref.address(), capnp::typeId<msg::Add>(), 1, 0});
      out.init_payload<msg::Add>();
      EXPECT_TRUE(other->send(1, out.to_words()).ok());
    }
    // 2. A reply to n1's ask to node 9, from node 8.
    std::optional<bool> answered;
    asio::co_spawn(
        c.io(),
        [&]() -> awaitable<void> {
          auto r = co_await n1.ask<msg::Add, msg::Sum>(actor_ref{9, 1, 5}, 2s);
          answered = r.ok() && r->get().getValue() == 7;
        },
        asio::detached);
    co_await sleep_for(5ms);
    CO_ASSERT(to_asked.size() == 1u);
    const auto ask = to_asked[0];
    const auto reply_from = [&](transport::link& l, transport::actor_address sender, int value) {
      transport::outgoing_envelope out({sender, ask.sender, capnp::typeId<msg::Sum>(),
                                        ask.correlation_id | (std::uint64_t{1} << 63), 0});
      out.init_payload<msg::Sum>().setValue(value);
      EXPECT_TRUE(l.send(1, out.to_words()).ok());
    };
    reply_from(*other, {8, 1, 5}, 666);
    co_await sleep_for(5ms);
    EXPECT_FALSE(answered.has_value()) << "node 8 answered an ask made to node 9";
    // 3. A Down telling n1's watcher that node 2's actor ended, from node 8.
    {
      transport::outgoing_envelope out({{}, {1, 0, 0}, capnp::typeId<proto::Down>(), 0, 0});
      auto d = out.init_payload<proto::Down>();
      auto watcher = d.initWatcher();
      watcher.setNode(w.ref.node);
      watcher.setIncarnation(w.ref.incarnation);
      watcher.setActor(w.ref.actor);
      auto target = d.initTarget();
      target.setNode(2);
      target.setIncarnation(1);
      target.setActor(5);
      d.setIsLink(true);
      EXPECT_TRUE(other->send(1, out.to_words()).ok());
    }
    // 4. An Unregister of node 2's actor, from node 8.
    {
      transport::outgoing_envelope out({{}, {1, 0, 0}, capnp::typeId<proto::Unregister>(), 0, 0});
      auto u = out.init_payload<proto::Unregister>();
      u.setName("anything");
      auto a = u.initActor();
      a.setNode(2);
      a.setIncarnation(1);
      a.setActor(5);
      EXPECT_TRUE(other->send(1, out.to_words()).ok());
    }
    co_await sleep_for(5ms);
    EXPECT_EQ(n1.stats().wrong_sender, 4u);
    EXPECT_TRUE(to_other.empty()) << "n1 answered node 8";
    EXPECT_TRUE(wa->events.empty()) << "a Down from the wrong node acted on";
    // The node asked answers, and that completes the ask.
    reply_from(*asked, {9, 1, 5}, 7);
    co_await sleep_for(5ms);
    EXPECT_EQ(answered, std::optional(true));
    EXPECT_EQ(n1.stats().wrong_sender, 4u);
  });
}

TEST(actors, remote_monitor_and_link_fire_on_actor_stop_and_on_node_crash) {
  cluster c;
  auto& n1 = c.add(1);
  auto& n2 = c.add(2);
  c.run([&]() -> awaitable<void> {
    auto w = n1.spawn<watcher>(true);
    auto a = n2.spawn<echo>();
    auto b = n2.spawn<echo>();
    auto d = n2.spawn<echo>();
    co_await sleep_for(1ms);
    auto* wa = n1.local_actor<watcher>(w);
    wa->monitor(a);
    wa->monitor(b);
    wa->link(d);
    co_await sleep_for(2ms);
    EXPECT_TRUE(a.ref.valid());
    n2.stop(a, exit_reason::failure("stopped for the test"));
    co_await sleep_for(2ms);
    CO_ASSERT(wa->events.size() == 1);
    EXPECT_EQ(wa->events[0].who, a.ref);
    EXPECT_EQ(wa->events[0].why.kind, exit_kind::error);
    c.hub().crash(2);
    co_await sleep_for(2ms);
    CO_ASSERT(wa->events.size() == 3);  // b's monitor and d's link, both node_lost
    for (int i = 1; i < 3; ++i) EXPECT_EQ(wa->events[i].why.kind, exit_kind::node_lost);
    // Sends to the lost node fail fast.
    typed_ref<echo> rb{&n1, b.ref};
    EXPECT_FALSE(rb.tell<msg::Ping>().ok());
  });
}

TEST(actors, remote_spawn_by_type_name) {
  cluster c;
  auto& n1 = c.add(1);
  auto& n2 = c.add(2);
  n2.register_type<echo>("echo");
  c.run([&]() -> awaitable<void> {
    auto r = co_await n1.spawn_named(2, "echo", 1s);
    CO_ASSERT(r.ok());
    EXPECT_EQ(r->node, 2u);
    EXPECT_TRUE(n2.alive(*r));
    typed_ref<echo> e{&n1, *r};
    auto sum = co_await e.ask<msg::Add>(1s, [](msg::Add::Builder b) { b.setA(5); });
    CO_ASSERT(sum.ok());
    EXPECT_EQ(sum->get().getValue(), 5);
    auto bad = co_await n1.spawn_named(2, "no_such_type", 1s);
    CO_ASSERT(!bad.ok());
    EXPECT_NE(bad.err().message.find("no_such_type"), std::string::npos);
  });
}

TEST(actors, local_and_global_registry) {
  cluster c;
  auto& head = c.add(0);
  auto& n1 = c.add(1);
  c.run([&]() -> awaitable<void> {
    auto e = n1.spawn<echo>();
    EXPECT_TRUE(n1.register_name("keeper", e).ok());
    EXPECT_FALSE(n1.register_name("keeper", e).ok());
    EXPECT_EQ(n1.whereis("keeper"), std::optional<actor_ref>(e.ref));
    auto g = co_await n1.register_global("stage0", e, 1s);
    CO_ASSERT(g.ok());
    auto found = co_await head.whereis_global("stage0", 1s);
    CO_ASSERT(found.ok());
    EXPECT_EQ(*found, e.ref);
    auto found_remote = co_await n1.whereis_global("stage0", 1s);
    CO_ASSERT(found_remote.ok());
    EXPECT_EQ(*found_remote, e.ref);
    n1.stop(e);
    EXPECT_FALSE(n1.whereis("keeper").has_value());
    co_await sleep_for(2ms);
    auto gone = co_await n1.whereis_global("stage0", 1s);
    EXPECT_FALSE(gone.ok());
  });
}

}  // namespace
}  // namespace moevement::actors::testing
