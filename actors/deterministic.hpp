// A deterministic scheduler for actor tests, after CAF's deterministic fixture: several actor
// systems (simulated nodes) on one io_context over loopback links, under manual time. Work
// runs only when the test runs it (step, run) and time moves only when the test moves it
// (advance) or when nothing else can run (run_until, run_body jump to the next timer). So
// deadlines, heartbeat losses, restart intensities and protocol races are unit tests without
// processes or sleeps, they take no wall time, and every run takes the same path.
//
//   deterministic d;
//   auto& head = d.add(0);
//   auto& w = d.add(1, {.head = 0});
//   d.run_body([&]() -> awaitable<void> { ... co_await head.sleep_for(5s); ... });
//
// Actors must read the time and sleep through their system (actor_system::now, sleep_for):
// an Asio steady_timer would wait real time, outside this scheduler.
#pragma once

#include <asio/co_spawn.hpp>
#include <asio/io_context.hpp>

#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <stdexcept>

#include "actors/system.hpp"
#include "actors/time_source.hpp"
#include "transport/loopback_link.hpp"

namespace moevement::actors {

class deterministic {
 public:
  deterministic() = default;
  ~deterministic();
  deterministic(const deterministic&) = delete;
  deterministic& operator=(const deterministic&) = delete;

  // A node on a loopback link; the config's time is this scheduler's (any given is replaced).
  actor_system& add(node_id n, system_config cfg = {});
  actor_system& operator[](node_id n) { return *systems_.at(n); }
  transport::loopback_hub& hub() { return hub_; }
  asio::io_context& io() { return io_; }
  manual_time& time() { return time_; }
  clock::time_point now() const { return time_.now(); }

  // Runs one ready handler (a delivery, a resumption, a due timer's callback): false if none
  // was ready. Time does not move.
  bool step();
  // Runs ready handlers until none is left; time does not move. Returns how many ran.
  std::size_t run();
  // Moves time forward by `d`, firing every timer due on the way in order, each followed by
  // everything it made ready.
  void advance(clock::duration d);
  // Runs until done() holds, jumping time to the next timer whenever nothing is ready. False
  // when nothing can ever run again (no ready work, no timer) or the time limit passed first.
  bool run_until(const std::function<bool()>& done, clock::duration limit = std::chrono::hours(1));

  // Runs `body` (a coroutine factory) as run_until its completion, then shuts every system
  // down; rethrows what the body threw; throws std::runtime_error if it never completed.
  template <class Body>
  void run_body(Body&& body, clock::duration limit = std::chrono::hours(1));

 private:
  asio::io_context io_;
  manual_time time_{io_};
  transport::loopback_hub hub_{io_};
  std::map<node_id, std::unique_ptr<transport::loopback_link>> links_;
  std::map<node_id, std::unique_ptr<actor_system>> systems_;
};

template <class Body>
void deterministic::run_body(Body&& body, clock::duration limit) {
  struct outcome {
    std::exception_ptr failure;
    bool finished = false;
  };
  // Shared: a body that never completed may still complete after this returns.
  auto out = std::make_shared<outcome>();
  asio::co_spawn(io_, body(), [out](std::exception_ptr e) {
    out->failure = e;
    out->finished = true;
  });
  const bool done = run_until([&] { return out->finished; }, limit);
  for (auto& [n, s] : systems_) s->shutdown();
  run();
  if (out->failure) std::rethrow_exception(out->failure);
  if (!done) {
    throw std::runtime_error(
        "deterministic: the test body never completed (nothing left to run, or the time limit "
        "passed): a deadlock, or an await on something outside the scheduler");
  }
}

}  // namespace moevement::actors
