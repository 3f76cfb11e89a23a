// Where a stage's compute thread is, for the head's stuck-stage probe
// (cluster.iteration_timeout_ms). A stage actor stays busy while its compute runs, so it
// cannot answer for itself; its worker's agent answers from this instead. A stage waiting for
// a peer waits either between messages (its pipeline neighbours) or on its compute thread (an
// EP exchange's rows, the device sum of its replicas): those waits are marked, so that only a
// compute that runs on by itself (a hung kernel, a stalled thread) looks stuck.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace moevement::engine {

class compute_watch {
 public:
  enum class state : std::uint8_t { idle, computing, waiting };
  struct view {
    state now = state::idle;
    double for_s = 0.0;       // how long it has been so
    std::uint64_t epoch = 0;  // the newest epoch the stage began
  };

  // The compute thread runs one task of the stage (a scope around it).
  class task {
   public:
    explicit task(compute_watch* w) : w_(w) {
      if (w_) w_->set(state::computing);
    }
    ~task() {
      if (w_) w_->set(state::idle);
    }
    task(const task&) = delete;
    task& operator=(const task&) = delete;

   private:
    compute_watch* w_;
  };
  // Within a task, the compute thread waits for its peers (a scope around the wait).
  class peer_wait {
   public:
    explicit peer_wait(compute_watch* w) : w_(w) {
      if (w_) w_->set(state::waiting);
    }
    ~peer_wait() {
      if (w_) w_->set(state::computing);
    }
    peer_wait(const peer_wait&) = delete;
    peer_wait& operator=(const peer_wait&) = delete;

   private:
    compute_watch* w_;
  };

  void set_epoch(std::uint64_t e) { epoch_.store(e, std::memory_order_relaxed); }
  view read() const {
    const std::uint64_t v = word_.load(std::memory_order_acquire);
    const auto since = std::int64_t(v >> 2);
    return {state(v & 3), std::max<std::int64_t>(0, now_ms() - since) * 1e-3,
            epoch_.load(std::memory_order_relaxed)};
  }

 private:
  static std::int64_t now_ms() {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  // The state and when it began, in one word: a reader never pairs one with the other's time.
  void set(state s) {
    word_.store((std::uint64_t(now_ms()) << 2) | std::uint64_t(s), std::memory_order_release);
  }
  std::atomic<std::uint64_t> word_{std::uint64_t(now_ms()) << 2};
  std::atomic<std::uint64_t> epoch_{0};
};

}  // namespace moevement::engine
