// The other process of the multi-process actor tests (cluster_test): one actor-system node
// over a real ucx_link on 127.0.0.1.
//   actor_node PORT TOKEN NODE INTERVAL_MS TIMEOUT_MS ACTORS [LISTEN_PORT [PEER:PORT...]]
// It connects to the head (node 0, the test process) at 127.0.0.1:PORT, joins, registers the
// actor type "echo" for remote spawn, spawns ACTORS echo actors and registers them
// cluster-wide as "echo@NODE/I" (the test's readiness signal). It listens on LISTEN_PORT (0:
// any). For each PEER given (another actor_node, with the same ACTORS) it monitors every
// "echo@PEER/I" and reports each down to the head's "collector" as a Ping with
// seq = actor id * 16 + exit kind; once armed it sends seq = armed_seq + its link's send
// errors (so a lost message shows). SIGTERM shuts the
// system down cleanly (goodbye). It exits 0 after a clean shutdown, 1 when the head is lost or
// after 60 s.
#include <unistd.h>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/signal_set.hpp>
#include <asio/steady_timer.hpp>

#include <csignal>
#include <cstdio>
#include <string>
#include <vector>

#include "actors/system.hpp"
#include "tests/actors/test_messages.capnp.h"
#include "transport/ucx_link.hpp"

using namespace moevement;
using namespace moevement::actors;
namespace msg = moevement::actors::test;

namespace {

void say(const std::string& what) {
  std::fprintf(stderr, "actor_node[%d]: %s\n", ::getpid(), what.c_str());
}

// Adds, and sleeps on request (to hold an ask past its deadline).
class node_echo : public actor {
 public:
  using interface = actors::interface<ask_t<msg::Add, msg::Sum>, ask_t<msg::Sleep, msg::Done>>;
  node_echo() {
    on<msg::Add, msg::Sum>(&node_echo::add);
    on<msg::Sleep, msg::Done>(&node_echo::sleep);
  }

 private:
  awaitable<void> add(msg::Add::Reader m, msg::Sum::Builder out) {
    out.setValue(m.getA() + m.getB());
    co_return;
  }
  awaitable<void> sleep(msg::Sleep::Reader m, msg::Done::Builder out) {
    const auto tag = m.getTag();
    asio::steady_timer t(co_await asio::this_coro::executor, std::chrono::milliseconds(m.getMs()));
    co_await t.async_wait(asio::use_awaitable);
    out.setTag(tag);
  }
};

// Monitors actors on other nodes and reports every down to a collector actor on the head.
class reporter : public actor {
 public:
  using interface = actors::interface<>;
  explicit reporter(actor_ref collector) : collector_(collector) {}

 protected:
  awaitable<void> on_down(actor_ref who, exit_reason why) override {
    const std::uint64_t seq = who.actor * 16 + static_cast<std::uint64_t>(why.kind);
    (void)tell<msg::Ping>(collector_, [seq](msg::Ping::Builder b) { b.setSeq(seq); });
    co_return;
  }

 private:
  actor_ref collector_;
};

constexpr std::uint64_t armed_seq = 0xa4a4;

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::fprintf(stderr, "usage: actor_node PORT TOKEN NODE INTERVAL_MS TIMEOUT_MS ACTORS\n");
    return 2;
  }
  const auto port = static_cast<std::uint16_t>(std::stoi(argv[1]));
  const auto me = static_cast<node_id>(std::stoul(argv[3]));
  const int actors = std::stoi(argv[6]);
  asio::io_context io(1);
  transport::ucx_link_options opt;
  opt.self = me;
  opt.job_token = argv[2];
  if (argc > 7) opt.listen_port = static_cast<std::uint16_t>(std::stoi(argv[7]));
  transport::ucx_link link(io, opt);
  link.add_peer(0, "127.0.0.1", port);
  std::vector<node_id> peers;
  for (int i = 8; i < argc; ++i) {
    const std::string a = argv[i];
    const auto colon = a.find(':');
    peers.push_back(static_cast<node_id>(std::stoul(a.substr(0, colon))));
    link.add_peer(peers.back(), "127.0.0.1",
                  static_cast<std::uint16_t>(std::stoi(a.substr(colon + 1))));
  }
  say("node " + std::to_string(me) + " listening on port " + std::to_string(link.port()));
  system_config cfg;
  cfg.head = 0;
  cfg.heartbeat_interval = std::chrono::milliseconds(std::stoi(argv[4]));
  cfg.heartbeat_timeout = std::chrono::milliseconds(std::stoi(argv[5]));
  actor_system sys(io, link, cfg);
  sys.register_type<node_echo>("echo");

  int status = 1;
  asio::steady_timer linger(io);
  asio::signal_set signals(io, SIGTERM);
  asio::steady_timer limit(io, std::chrono::seconds(60));
  bool stopping = false;
  // Shuts the system down (goodbye to the peers), then lets the loop flush for a moment.
  auto stop = [&](int s, const std::string& why) {
    if (stopping) return;
    stopping = true;
    status = s;
    say(why);
    signals.cancel();
    limit.cancel();
    sys.shutdown();
    linger.expires_after(std::chrono::milliseconds(100));
    linger.async_wait([&](const std::error_code&) { io.stop(); });
  };
  signals.async_wait([&](const std::error_code& ec, int) {
    if (!ec) stop(0, "SIGTERM: shutting down cleanly");
  });
  limit.async_wait([&](const std::error_code& ec) {
    if (!ec) stop(1, "timed out");
  });
  sys.on_membership([&](node_id n, member_event e) {
    if (n == cfg.head && e != member_event::up) stop(1, "lost the head");
  });
  asio::co_spawn(
      io,
      [&]() -> awaitable<void> {
        if (auto j = co_await sys.join(std::chrono::seconds(20)); !j.ok()) {
          stop(1, "join failed: " + j.err().message);
          co_return;
        }
        for (int i = 0; i < actors; ++i) {
          actor_ref e = sys.spawn<node_echo>();
          auto name = "echo@" + std::to_string(me) + "/" + std::to_string(i);
          if (auto r = co_await sys.register_global(std::move(name), e, std::chrono::seconds(20));
              !r.ok()) {
            stop(1, "register_global failed: " + r.err().message);
            co_return;
          }
        }
        if (peers.empty()) co_return;
        auto collector = co_await sys.whereis_global("collector", std::chrono::seconds(20));
        if (!collector.ok()) {
          stop(1, "no collector: " + collector.err().message);
          co_return;
        }
        actor_ref rep = sys.spawn<reporter>(*collector);
        for (node_id p : peers) {
          for (int i = 0; i < actors; ++i) {
            auto name = "echo@" + std::to_string(p) + "/" + std::to_string(i);
            auto r = co_await sys.whereis_global(std::move(name), std::chrono::seconds(20));
            if (!r.ok()) {
              stop(1, "peer actor not found: " + r.err().message);
              co_return;
            }
            sys.local_actor<reporter>(rep)->monitor(*r);
          }
        }
        // Armed once the watch requests had time to go out; a lost send shows as a wrong seq.
        asio::steady_timer settle(io, 2 * cfg.heartbeat_interval);
        co_await settle.async_wait(asio::use_awaitable);
        const std::uint64_t seq = armed_seq + link.stats().send_errors;
        (void)sys.tell<msg::Ping>(*collector, [seq](msg::Ping::Builder b) { b.setSeq(seq); });
      },
      asio::detached);
  io.run();
  return status;
}
