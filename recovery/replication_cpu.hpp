// The actor thread's CPU time spent replicating snapshots: the checkpoint agent's and the
// replicator's handlers (offering slots, mapping or taking them, answering, dropping persisted
// windows) and the messages they send. One per worker process, summed until taken once an
// iteration. On CPU stages these handlers share the cores with the compute as the capture
// thread does, and they run once per offer, not per byte: on a small model they cost more than
// the copies (docs/benchmark-notes.md), so the window tuner charges them beside the capture.
#pragma once

#include <atomic>

#include "engine/hooks.hpp"

namespace moevement::recovery {

class replication_cpu {
 public:
  // Adds the calling thread's CPU time from here to the end of the scope (a handler that does
  // not suspend in between: a suspended one would count what ran meanwhile).
  class scope {
   public:
    explicit scope(replication_cpu* meter)
        : meter_(meter), t0_(meter ? engine::thread_cpu_seconds() : 0.0) {}
    ~scope() {
      if (meter_) meter_->add(engine::thread_cpu_seconds() - t0_);
    }
    scope(const scope&) = delete;
    scope& operator=(const scope&) = delete;

   private:
    replication_cpu* meter_;
    double t0_;
  };

  void add(double seconds) {
    if (!(seconds > 0)) return;
    double was = s_.load();
    while (!s_.compare_exchange_weak(was, was + seconds)) {
    }
  }
  // What was added since the last take.
  double take() { return s_.exchange(0.0); }

 private:
  std::atomic<double> s_{0.0};
};

}  // namespace moevement::recovery
