// Elapsed time on the steady clock, for durations reported in logs and statistics.
#pragma once

#include <chrono>

namespace moevement {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace moevement
