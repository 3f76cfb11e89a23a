// Test harness: several simulated nodes (actor systems over loopback links) on one io_context.
#pragma once

#include <gtest/gtest.h>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#include <exception>
#include <map>
#include <memory>
#include <vector>

#include "actors/system.hpp"
#include "tests/actors/test_messages.capnp.h"
#include "tests/support/co_assert.hpp"
#include "transport/loopback_link.hpp"

namespace moevement::actors::testing {

using namespace std::chrono_literals;
namespace msg = moevement::actors::test;

inline awaitable<void> sleep_for(clock::duration d) {
  asio::steady_timer t(co_await asio::this_coro::executor, d);
  co_await t.async_wait(asio::use_awaitable);
}

class cluster {
 public:
  cluster() = default;
  ~cluster() {
    for (auto& [n, s] : systems_) s->shutdown();
    io_.restart();
    io_.run_for(std::chrono::seconds(5));
    systems_.clear();
    links_.clear();
  }

  actor_system& add(node_id n, system_config cfg = {}) {
    links_[n] = hub_.attach(n);
    systems_[n] = std::make_unique<actor_system>(io_, *links_[n], cfg);
    return *systems_[n];
  }
  actor_system& operator[](node_id n) { return *systems_.at(n); }
  transport::loopback_hub& hub() { return hub_; }
  transport::loopback_link& link(node_id n) { return *links_.at(n); }
  asio::io_context& io() { return io_; }

  // Runs the test body as a coroutine, then shuts every system down and drains the loop.
  template <class Body>
  void run(Body&& body) {
    std::exception_ptr failure;
    bool finished = false;
    asio::co_spawn(io_, body(), [&](std::exception_ptr e) {
      failure = e;
      finished = true;
      for (auto& [n, s] : systems_) s->shutdown();
    });
    io_.run();
    EXPECT_TRUE(finished) << "the test coroutine never finished";
    if (failure) std::rethrow_exception(failure);
  }

 private:
  asio::io_context io_;
  transport::loopback_hub hub_{io_};
  std::map<node_id, std::unique_ptr<transport::loopback_link>> links_;
  std::map<node_id, std::unique_ptr<actor_system>> systems_;
};

// An actor for the tests: counts pings, adds, sleeps, crashes on request.
class echo : public actor {
 public:
  using interface = actors::interface<tell_t<msg::Ping>, ask_t<msg::Add, msg::Sum>,
                                      ask_t<msg::Sleep, msg::Done>, tell_t<msg::Crash>,
                                      ask_t<msg::Get, msg::Count>, ask_t<msg::Relay, msg::Sum>>;
  echo() {
    on<msg::Ping>(&echo::ping);
    on<msg::Add, msg::Sum>(&echo::add);
    on<msg::Sleep, msg::Done>(&echo::sleep);
    on<msg::Crash>(&echo::crash);
    on<msg::Get, msg::Count>(&echo::get);
    on<msg::Relay, msg::Sum>(&echo::relay);
  }
  std::vector<std::uint64_t> log;  // handler start/end events (tag*10+0 start, +1 end)
  std::vector<actor_ref> senders;  // of each Ping (sender())

 private:
  awaitable<void> ping(msg::Ping::Reader m) {
    log.push_back(m.getSeq());
    senders.push_back(sender());
    co_return;
  }
  awaitable<void> add(msg::Add::Reader m, msg::Sum::Builder out) {
    out.setValue(m.getA() + m.getB());
    co_return;
  }
  awaitable<void> sleep(msg::Sleep::Reader m, msg::Done::Builder out) {
    const auto tag = m.getTag();
    log.push_back(tag * 10);
    co_await system().sleep_for(std::chrono::milliseconds(m.getMs()));
    log.push_back(tag * 10 + 1);
    out.setTag(tag);
  }
  awaitable<void> crash(msg::Crash::Reader m) {
    throw std::runtime_error(std::string(m.getWhy()));
    co_return;
  }
  awaitable<void> get(msg::Get::Reader, msg::Count::Builder out) {
    out.setN(log.size());
    auto l = out.initLog(static_cast<unsigned>(log.size()));
    for (unsigned i = 0; i < log.size(); ++i) l.set(i, log[i]);
    co_return;
  }
  // Asks another actor on this node from inside a handler.
  awaitable<void> relay(msg::Relay::Reader m, msg::Sum::Builder out) {
    const actor_ref to{self().node, self().incarnation, m.getTo()};
    const auto a = m.getA();
    auto r = co_await ask<msg::Add, msg::Sum>(to, 1s, [a](msg::Add::Builder b) {
      b.setA(a);
      b.setB(1);
    });
    if (!r.ok()) throw std::runtime_error(r.err().message);
    out.setValue(r->get().getValue());
  }
};

// Records down and exit notifications.
class watcher : public actor {
 public:
  using interface = actors::interface<>;
  struct event {
    actor_ref who;
    exit_reason why;
    bool is_exit;
  };
  std::vector<event> events;
  explicit watcher(bool trap = false) : trap_(trap) {}

 protected:
  awaitable<void> on_start() override {
    trap_exit(trap_);
    co_return;
  }
  awaitable<void> on_down(actor_ref who, exit_reason why) override {
    events.push_back({who, why, false});
    co_return;
  }
  awaitable<void> on_exit(actor_ref who, exit_reason why) override {
    events.push_back({who, why, true});
    co_return;
  }

 private:
  bool trap_;
};

}  // namespace moevement::actors::testing
