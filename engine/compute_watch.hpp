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

  // A state for the length of a scope, and the one it goes back to after.
  template <state Enter, state Leave>
  class scope {
   public:
    explicit scope(compute_watch* w) : w_(w) {
      if (w_) w_->set(Enter);
    }
    ~scope() {
      if (w_) w_->set(Leave);
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

   private:
    compute_watch* w_;
  };
  // The compute thread runs one task of the stage.
  using task = scope<state::computing, state::idle>;
  // Within a task, the compute thread waits for its peers.
  using peer_wait = scope<state::waiting, state::computing>;

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
