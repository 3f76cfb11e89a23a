// Where an actor system reads the time and sets its timers. Production uses steady_time (the
// steady clock and Asio timers); tests may give a manual_time, which moves only when the test
// moves it, so deadlines, heartbeats and restart intensities run without sleeping and in the
// same order every run (see actors/deterministic.hpp).
//
// Threading: like the actor system, used from the one thread that runs the io_context.
#pragma once

#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <utility>

#include "actors/unique_function.hpp"

namespace moevement::actors {

using clock = std::chrono::steady_clock;

class time_source {
 public:
  using timer_id = std::uint64_t;
  virtual ~time_source() = default;
  virtual clock::time_point now() const = 0;
  // `fn` runs on the io_context once `at` has passed, unless cancelled first; never inside
  // this call. Ids are never 0.
  virtual timer_id call_at(clock::time_point at, unique_function<void()> fn) = 0;
  // The callback of `id` will not run (no effect once it ran or for an unknown id).
  virtual void cancel(timer_id id) = 0;
};

class steady_time final : public time_source {
 public:
  explicit steady_time(asio::io_context& io) : io_(io) {}
  ~steady_time() override;
  clock::time_point now() const override { return clock::now(); }
  timer_id call_at(clock::time_point at, unique_function<void()> fn) override;
  void cancel(timer_id id) override;

 private:
  asio::io_context& io_;
  std::shared_ptr<bool> alive_ = std::make_shared<bool>(true);  // for handlers that outlive us
  timer_id next_ = 1;
  std::map<timer_id, std::shared_ptr<asio::steady_timer>> timers_;
};

// Test time: starts at a fixed point and moves only by advance_to(). Due callbacks run one at
// a time, in (time, order of call_at) order, each posted to the io_context when its time comes.
class manual_time final : public time_source {
 public:
  explicit manual_time(asio::io_context& io) : io_(io) {}
  clock::time_point now() const override { return now_; }
  timer_id call_at(clock::time_point at, unique_function<void()> fn) override;
  void cancel(timer_id id) override;

  // The earliest pending timer's time (nullopt: none).
  std::optional<clock::time_point> next_due() const;
  // Moves the time to `at` (never back) and posts the callback of the earliest timer due by
  // then, if any: true when one was posted. Call it until false to post every due timer, letting
  // the io_context run between calls so that each callback sees the ones before it.
  bool advance_to(clock::time_point at);
  std::size_t pending() const { return timers_.size(); }

 private:
  asio::io_context& io_;
  // A fixed, arbitrary origin far from 0 (code subtracts durations from now()).
  clock::time_point now_ = clock::time_point{} + std::chrono::hours(24);
  timer_id next_ = 1;
  std::map<std::pair<clock::time_point, timer_id>, unique_function<void()>> timers_;
  std::map<timer_id, clock::time_point> when_;
};

}  // namespace moevement::actors
