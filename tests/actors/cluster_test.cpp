// Multi-process actor tests over a real ucx_link on 127.0.0.1: this process is the head
// (node 0); actor_node processes (posix_spawn) are the other nodes. A node killed with kill -9
// is reported by the transport; a node hung with SIGSTOP only by missing heartbeats; a clean
// shutdown says goodbye. Each runs over shared memory (UCX's default on one host) and over
// UCX_TLS=tcp. Every bound is relative to the configured heartbeat settings or ask deadlines.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <capnp/serialize.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "tests/actors/harness.hpp"
#include "transport/ucx_link.hpp"

extern char** environ;

namespace moevement::actors::testing {
namespace {

constexpr char token[] = "actors-cluster-test";

// Heartbeat settings of every node in these tests (the defaults are 100 ms / 1000 ms).
constexpr auto interval = 100ms;
constexpr auto timeout = 800ms;
// Allowance for a loaded 2-core machine (scheduling delays of this process and the children).
constexpr auto slack = 750ms;
// How long readiness, exits and notifications may take at most before the test fails.
constexpr auto patience = 20s;

long long ms(clock::duration d) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(d).count();
}

struct membership_record {
  node_id node;
  member_event what;
  clock::time_point at;
};

class cluster_test : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const char* h = std::getenv("MOEVEMENT_ACTOR_NODE");
    helper_ = h != nullptr ? h : "";
    ASSERT_FALSE(helper_.empty()) << "run through meson test (MOEVEMENT_ACTOR_NODE names the "
                                     "actor_node helper)";
    if (GetParam() == "tcp") ::setenv("UCX_TLS", "tcp", 1);
    transport::ucx_link_options o;
    o.self = 0;
    o.job_token = token;
    link_ = std::make_unique<transport::ucx_link>(io_, o);
    system_config cfg;
    cfg.head = 0;
    cfg.heartbeat_interval = interval;
    cfg.heartbeat_timeout = timeout;
    sys_ = std::make_unique<actor_system>(io_, *link_, cfg);
    sys_->on_membership([this](node_id n, member_event e) {
      events_.push_back({n, e, clock::now()});
    });
  }

  void TearDown() override {
    for (pid_t pid : children_) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    sys_->shutdown();
    pump_for(200ms);
    sys_.reset();
    link_.reset();
    ::unsetenv("UCX_TLS");
  }

  void pump_for(clock::duration d) {
    const auto end = clock::now() + d;
    while (clock::now() < end) {
      io_.restart();
      io_.run_for(2ms);
    }
  }

  // Runs the test body as a coroutine on the head's io_context, bounded by `limit`.
  template <class Body>
  void run(Body&& body, clock::duration limit = 60s) {
    bool finished = false;
    std::exception_ptr failure;
    asio::co_spawn(io_, body(), [&](std::exception_ptr e) {
      failure = e;
      finished = true;
    });
    const auto end = clock::now() + limit;
    while (!finished && clock::now() < end) {
      io_.restart();
      io_.run_for(2ms);
    }
    if (!finished) {
      ADD_FAILURE() << "the test body did not finish within its limit";
      sys_->shutdown();  // fails the asks it waits on, so it unwinds
      pump_for(500ms);
    }
    if (failure) std::rethrow_exception(failure);
  }

  pid_t spawn_node(node_id node, int actors, std::vector<std::string> extra = {}) {
    std::vector<std::string> args{helper_,
                                  std::to_string(link_->port()),
                                  token,
                                  std::to_string(node),
                                  std::to_string(interval.count()),
                                  std::to_string(timeout.count()),
                                  std::to_string(actors)};
    args.insert(args.end(), extra.begin(), extra.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_t pid = -1;
    EXPECT_EQ(::posix_spawn(&pid, helper_.c_str(), nullptr, nullptr, argv.data(), environ), 0);
    if (pid > 0) children_.push_back(pid);
    return pid;
  }

  // Waits (running the loop) until `pred` holds; false when `limit` passed first.
  template <class Pred>
  awaitable<bool> wait_until(Pred pred, clock::duration limit = patience) {
    const auto end = clock::now() + limit;
    while (!pred()) {
      if (clock::now() > end) co_return false;
      co_await sleep_for(1ms);
    }
    co_return true;
  }

  // The actors a node registered, once it has joined and registered them all.
  awaitable<std::vector<actor_ref>> node_actors(node_id node, int count) {
    std::vector<actor_ref> out;
    const auto end = clock::now() + patience;
    for (int i = 0; i < count && clock::now() < end;) {
      auto name = "echo@" + std::to_string(node) + "/" + std::to_string(i);
      auto r = co_await sys_->whereis_global(std::move(name), 1s);
      if (r.ok()) {
        out.push_back(*r);
        ++i;
      } else {
        co_await sleep_for(10ms);
      }
    }
    co_return out;
  }

  // Exit status of a child (128 + signal when killed), reaped; -1 if still running at `limit`.
  awaitable<int> wait_exit(pid_t pid, clock::duration limit = patience) {
    int status = -1;
    const bool exited = co_await wait_until(
        [&] {
          int st = 0;
          if (::waitpid(pid, &st, WNOHANG) != pid) return false;
          status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
          return true;
        },
        limit);
    if (exited) std::erase(children_, pid);
    co_return status;
  }

  std::optional<membership_record> first_loss(node_id node) const {
    for (const auto& e : events_) {
      if (e.node == node && e.what != member_event::up) return e;
    }
    return std::nullopt;
  }

  // Two watchers, each monitoring every actor in `targets`.
  std::vector<actor_ref> watch_all(const std::vector<actor_ref>& targets) {
    std::vector<actor_ref> watchers;
    for (int i = 0; i < 2; ++i) {
      actor_ref w = sys_->spawn<watcher>();
      for (const auto& t : targets) sys_->local_actor<watcher>(w)->monitor(t);
      watchers.push_back(w);
    }
    return watchers;
  }
  std::size_t downs(actor_ref w) { return sys_->local_actor<watcher>(w)->events.size(); }
  const std::vector<watcher::event>& downs_of(actor_ref w) {
    return sys_->local_actor<watcher>(w)->events;
  }

  std::string helper_;
  asio::io_context io_{1};
  std::unique_ptr<transport::ucx_link> link_;
  std::unique_ptr<actor_system> sys_;
  std::vector<membership_record> events_;
  std::vector<pid_t> children_;
};

// kill -9: the transport reports the dead peer long before any heartbeat timeout could.
TEST_P(cluster_test, a_killed_node_is_detected_by_the_transport_and_every_monitor_fires) {
  run([&]() -> awaitable<void> {
    const pid_t pid = spawn_node(1, 3);
    auto targets = co_await node_actors(1, 3);
    CO_ASSERT(targets.size() == 3u);
    EXPECT_EQ(sys_->members().size(), 1u);
    auto watchers = watch_all(targets);
    co_await sleep_for(3 * interval);  // steady state: heartbeats flowing both ways
    CO_ASSERT(!first_loss(1).has_value());

    const auto killed_at = clock::now();
    ::kill(pid, SIGKILL);
    CO_ASSERT(co_await wait_until([&] { return first_loss(1).has_value(); }, 3 * timeout + slack));
    const auto loss = *first_loss(1);
    EXPECT_EQ(loss.what, member_event::lost);
    std::printf("kill -9 detected after %lld ms (heartbeat timeout %lld ms)\n",
                ms(loss.at - killed_at), ms(timeout));
    // From the transport, not from the heartbeat timeout.
    EXPECT_LT(loss.at - killed_at, timeout)
        << "detected after "
        << std::chrono::duration_cast<std::chrono::milliseconds>(loss.at - killed_at).count()
        << " ms";
    CO_ASSERT(co_await wait_until([&] {
      return downs(watchers[0]) == targets.size() && downs(watchers[1]) == targets.size();
    }));
    for (auto w : watchers) {
      for (const auto& d : downs_of(w)) EXPECT_EQ(d.why.kind, exit_kind::node_lost);
    }
    EXPECT_TRUE(sys_->members().empty());
    // An ask to an actor of the lost node fails at once, far inside its deadline.
    const auto asked_at = clock::now();
    auto r = co_await sys_->ask<msg::Add, msg::Sum>(targets[0], 10s);
    EXPECT_FALSE(r.ok());
    EXPECT_LT(clock::now() - asked_at, 10s / 10);
    EXPECT_EQ(co_await wait_exit(pid), 128 + SIGKILL);
  });
}

// SIGSTOP: UCX sees nothing; the heartbeats must find it, within the configured bounds.
TEST_P(cluster_test, a_hung_node_is_detected_by_heartbeat_timeout_within_its_bounds) {
  run([&]() -> awaitable<void> {
    const pid_t pid = spawn_node(1, 2);
    auto targets = co_await node_actors(1, 2);
    CO_ASSERT(targets.size() == 2u);
    auto watchers = watch_all(targets);
    co_await sleep_for(3 * interval);
    CO_ASSERT(!first_loss(1).has_value());

    CO_ASSERT(sys_->last_heard(1).has_value());
    clock::time_point heard = *sys_->last_heard(1);
    const auto stopped_at = clock::now();
    ::kill(pid, SIGSTOP);
    // Track when node 1 was last heard from until it is declared lost.
    const bool lost = co_await wait_until(
        [&] {
          if (auto h = sys_->last_heard(1)) heard = std::max(heard, *h);
          return first_loss(1).has_value();
        },
        3 * timeout + slack);
    ::kill(pid, SIGCONT);
    ::kill(pid, SIGKILL);
    CO_ASSERT(lost);
    const auto loss = *first_loss(1);
    EXPECT_EQ(loss.what, member_event::lost);
    std::printf(
        "SIGSTOP detected %lld ms after it, %lld ms after last heard (timeout %lld ms, "
        "interval %lld ms)\n",
        ms(loss.at - stopped_at), ms(loss.at - heard), ms(timeout), ms(interval));
    using std::chrono::duration_cast;
    using std::chrono::milliseconds;
    // Never before `timeout` of silence, and no later than timeout + one interval (+ slack).
    EXPECT_GE(loss.at - heard, timeout)
        << duration_cast<milliseconds>(loss.at - heard).count() << " ms after last heard";
    EXPECT_LE(loss.at - stopped_at, timeout + interval + slack)
        << duration_cast<milliseconds>(loss.at - stopped_at).count() << " ms after SIGSTOP";
    CO_ASSERT(co_await wait_until([&] {
      return downs(watchers[0]) == targets.size() && downs(watchers[1]) == targets.size();
    }));
    for (auto w : watchers) {
      for (const auto& d : downs_of(w)) EXPECT_EQ(d.why.kind, exit_kind::node_lost);
    }
    // Forgotten by the link: an ask fails at once.
    const auto asked_at = clock::now();
    auto r = co_await sys_->ask<msg::Add, msg::Sum>(targets[0], 10s);
    EXPECT_FALSE(r.ok());
    EXPECT_LT(clock::now() - asked_at, 10s / 10);
    EXPECT_EQ(co_await wait_exit(pid), 128 + SIGKILL);
  });
}

// A clean shutdown says goodbye: reported as goodbye, monitors fire with a normal reason.
TEST_P(cluster_test, a_clean_shutdown_is_reported_as_goodbye_not_as_a_crash) {
  run([&]() -> awaitable<void> {
    const pid_t pid = spawn_node(1, 2);
    auto targets = co_await node_actors(1, 2);
    CO_ASSERT(targets.size() == 2u);
    auto watchers = watch_all(targets);
    co_await sleep_for(3 * interval);
    ::kill(pid, SIGTERM);
    CO_ASSERT(co_await wait_until([&] { return first_loss(1).has_value(); }));
    EXPECT_EQ(first_loss(1)->what, member_event::goodbye);
    CO_ASSERT(co_await wait_until([&] {
      return downs(watchers[0]) == targets.size() && downs(watchers[1]) == targets.size();
    }));
    for (auto w : watchers) {
      for (const auto& d : downs_of(w)) {
        EXPECT_FALSE(d.why.abnormal()) << d.why.to_string();
      }
    }
    EXPECT_EQ(co_await wait_exit(pid), 0);
    // Nothing later turned the goodbye into a loss.
    co_await sleep_for(timeout + interval);
    for (const auto& e : events_) EXPECT_NE(e.what, member_event::lost);
  });
}

struct in_flight_ask {
  bool done = false;
  bool ok = true;
  clock::time_point done_at{};
};

// Asks `to` to sleep far past the ask's deadline; the state outlives the test body.
awaitable<void> ask_sleep(actor_system& sys, actor_ref to, std::shared_ptr<in_flight_ask> st) {
  auto fill = [](msg::Sleep::Builder b) { b.setMs(30000); };
  auto r = co_await sys.ask<msg::Sleep, msg::Done>(to, 20s, fill);
  st->ok = r.ok();
  st->done_at = clock::now();
  st->done = true;
}

// Remote spawn by registered type name, asks with deadlines across processes, and asks to a
// node that dies while they wait.
TEST_P(cluster_test, remote_spawn_and_asks_across_processes) {
  run([&]() -> awaitable<void> {
    const pid_t pid = spawn_node(1, 1);
    auto ready = co_await node_actors(1, 1);
    CO_ASSERT(ready.size() == 1u);
    auto spawned = co_await sys_->spawn_named(1, "echo", 5s);
    CO_ASSERT(spawned.ok());
    const actor_ref a = *spawned;
    EXPECT_EQ(a.node, 1u);
    EXPECT_FALSE(a == ready[0]);
    // Asks with a reply.
    for (std::int64_t i = 0; i < 50; ++i) {
      auto fill = [i](msg::Add::Builder b) {
        b.setA(i);
        b.setB(1000);
      };
      auto r = co_await sys_->ask<msg::Add, msg::Sum>(a, 5s, fill);
      CO_ASSERT(r.ok());
      EXPECT_EQ(r->get().getValue(), i + 1000);
    }
    // An unknown type name is an error reply, not a hang.
    auto bad = co_await sys_->spawn_named(1, "no_such_type", 5s);
    EXPECT_FALSE(bad.ok());
    // Ill-typed and malformed asks across processes: error replies, the node stays up.
    {
      auto r = co_await sys_->ask<msg::Ping, msg::Sum>(a, 5s);  // a type it does not take
      EXPECT_FALSE(r.ok());
      const actor_ref nobody{a.node, a.incarnation, 999999};
      auto r2 = co_await sys_->ask<msg::Add, msg::Sum>(nobody, 5s);
      EXPECT_FALSE(r2.ok());
      // Type id Add, payload a list: refused by the node with an error reply (which arrives
      // here for no open ask, so it is counted as late).
      capnp::MallocMessageBuilder mb;
      auto root = mb.initRoot<wire::Envelope>();
      auto snd = root.initSender();
      snd.setNode(0);
      snd.setIncarnation(sys_->incarnation());
      auto rcv = root.initReceiver();
      rcv.setNode(a.node);
      rcv.setIncarnation(a.incarnation);
      rcv.setActor(a.actor);
      root.setTypeId(capnp::typeId<msg::Add>());
      root.setCorrelationId(0x7777);
      root.getPayload().initAs<capnp::List<std::uint64_t>>(3);
      const auto late_before = sys_->stats().late_replies;
      CO_ASSERT(link_->send(a.node, capnp::messageToFlatArray(mb)).ok());
      EXPECT_TRUE(co_await wait_until([&] { return sys_->stats().late_replies > late_before; }));
      auto fill = [](msg::Add::Builder b) { b.setA(1); };
      auto ok = co_await sys_->ask<msg::Add, msg::Sum>(a, 5s, fill);
      CO_ASSERT(ok.ok());
      EXPECT_EQ(ok->get().getValue(), 1);
      EXPECT_TRUE(first_loss(1) == std::nullopt);
    }
    // A deadline shorter than the handler: an error, not before the deadline.
    {
      const auto deadline = 200ms;
      auto fill = [](msg::Sleep::Builder b) { b.setMs(2000); };
      const auto t0 = clock::now();
      auto r = co_await sys_->ask<msg::Sleep, msg::Done>(a, deadline, fill);
      const auto took = clock::now() - t0;
      EXPECT_FALSE(r.ok());
      EXPECT_GE(took, deadline);
      EXPECT_LT(took, deadline + slack);
    }
    // An ask in flight when its node is killed fails when the loss is detected, long before
    // its own deadline.
    auto flight = std::make_shared<in_flight_ask>();
    asio::co_spawn(io_, ask_sleep(*sys_, ready[0], flight), asio::detached);
    co_await sleep_for(3 * interval);
    CO_ASSERT(!flight->done);
    const auto killed_at = clock::now();
    ::kill(pid, SIGKILL);
    CO_ASSERT(co_await wait_until([&] { return flight->done; }, 3 * timeout + slack));
    EXPECT_FALSE(flight->ok);
    EXPECT_LT(flight->done_at - killed_at, timeout);
    std::printf("in-flight ask failed %lld ms after kill -9\n", ms(flight->done_at - killed_at));
    // And a new ask to the lost node's actor fails at once.
    const auto asked_at = clock::now();
    auto r = co_await sys_->ask<msg::Add, msg::Sum>(a, 10s);
    EXPECT_FALSE(r.ok());
    EXPECT_LT(clock::now() - asked_at, 10s / 10);
    EXPECT_EQ(co_await wait_exit(pid), 128 + SIGKILL);
  });
}

// A port on 127.0.0.1 that was free a moment ago (for a node others must connect to).
std::uint16_t free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// Three processes: node 2 monitors node 1's actors directly (its own connection to node 1).
// When node 1 is killed, the monitors on node 2 fire too, with node_lost, and node 2 stays.
TEST_P(cluster_test, monitors_on_every_surviving_node_fire_when_a_node_is_killed) {
  run([&]() -> awaitable<void> {
    constexpr int n_actors = 3;
    actor_ref collector = sys_->spawn<echo>();  // logs the seq of every Ping it gets
    CO_ASSERT((co_await sys_->register_global("collector", collector, 1s)).ok());
    const std::uint16_t port1 = free_port();
    CO_ASSERT(port1 != 0);
    const pid_t pid1 = spawn_node(1, n_actors, {std::to_string(port1)});
    auto targets = co_await node_actors(1, n_actors);
    CO_ASSERT(targets.size() == std::size_t{n_actors});
    const pid_t pid2 = spawn_node(2, n_actors, {"0", "1:" + std::to_string(port1)});
    CO_ASSERT((co_await node_actors(2, n_actors)).size() == std::size_t{n_actors});
    auto log = [&]() -> const std::vector<std::uint64_t>& {
      return sys_->local_actor<echo>(collector)->log;
    };
    constexpr std::uint64_t armed_seq = 0xa4a4;  // as in actor_node.cpp
    CO_ASSERT(co_await wait_until([&] { return !log().empty(); }));
    EXPECT_EQ(log()[0], armed_seq) << "node 2 lost " << log()[0] - armed_seq << " sends";
    auto watchers = watch_all(targets);
    co_await sleep_for(3 * interval);
    CO_ASSERT(!first_loss(1).has_value());
    CO_ASSERT(!first_loss(2).has_value());

    const auto killed_at = clock::now();
    ::kill(pid1, SIGKILL);
    CO_ASSERT(co_await wait_until([&] { return log().size() == 1 + n_actors; }));
    const auto reported_at = clock::now();
    // Node 2 learnt of it from its own transport, not from a heartbeat timeout.
    EXPECT_LT(reported_at - killed_at, timeout);
    std::vector<std::uint64_t> expected;
    for (const auto& t : targets) {
      expected.push_back(t.actor * 16 + static_cast<std::uint64_t>(exit_kind::node_lost));
    }
    std::vector<std::uint64_t> got(log().begin() + 1, log().end());
    std::ranges::sort(expected);
    std::ranges::sort(got);
    EXPECT_EQ(got, expected);
    CO_ASSERT(co_await wait_until([&] {
      return downs(watchers[0]) == targets.size() && downs(watchers[1]) == targets.size();
    }));
    EXPECT_EQ(first_loss(1)->what, member_event::lost);
    // The survivor is still a member, and answers.
    co_await sleep_for(timeout + interval);
    EXPECT_FALSE(first_loss(2).has_value());
    auto peer = co_await node_actors(2, 1);
    CO_ASSERT(peer.size() == 1u);
    auto fill = [](msg::Add::Builder b) { b.setB(7); };
    auto r = co_await sys_->ask<msg::Add, msg::Sum>(peer[0], 5s, fill);
    CO_ASSERT(r.ok());
    EXPECT_EQ(r->get().getValue(), 7);
    EXPECT_EQ(co_await wait_exit(pid1), 128 + SIGKILL);
    (void)pid2;  // killed in teardown
  });
}

INSTANTIATE_TEST_SUITE_P(transports, cluster_test, ::testing::Values("shm", "tcp"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace moevement::actors::testing
