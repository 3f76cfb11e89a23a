// Failure injection for `moevement launch --inject SPEC` (repeatable):
//   kill:stage=S,replica=D,iter=T   SIGKILL the worker of (S, D) once iteration T has begun
//   hang:stage=S,replica=D,iter=T   SIGSTOP it instead (a hung peer: heartbeats stop)
// The head does it, so it is repeatable run to run; the coordinator then sees a real lost
// worker (its process gone, or silent past cluster.failure_timeout_ms).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moevement::launcher {

struct injection {
  enum class kind : std::uint8_t { kill, hang };
  kind what = kind::kill;
  int stage = 0, replica = 0;
  std::int64_t iteration = 1;  // >= 1: the worker dies while iteration T runs
  bool done = false;
  std::string text() const;
};

// Throws std::invalid_argument saying what is wrong and what is expected.
injection parse_injection(const std::string& spec);

}  // namespace moevement::launcher
