// The jobs the recovery suites launch (recovery_test, joint_recovery_test): the tiny preset at
// a placement with policy moevement and a window of 2, its fault-free hash by `moevement
// train`, and readers of their run logs.
#pragma once

#include <map>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace moevement::test_support {

inline std::string tiny() {
  return source_path("examples/configs/tiny.toml");
}

// tiny, 12 iterations, a window of 2 (so that several windows persist before a failure).
inline std::string job(int pp, int dp, int spares, const std::string& extra = "") {
  return tiny() + " --set train.iterations=12 --set train.seq_len=16 --set parallel.pp=" +
         std::to_string(pp) + " --set parallel.dp=" + std::to_string(dp) +
         " --set checkpoint.policy=moevement --set checkpoint.w_sparse=2 --set cluster.spares=" +
         std::to_string(spares) +
         // kills are seen at once (the process exits); a long heartbeat timeout keeps a busy
         // machine from declaring live workers lost (tests of hangs set their own)
         " --set cluster.failure_timeout_ms=3000 " + extra;
}

// The fault-free hash of the same job (by `moevement train`, which launch equals).
inline std::string reference(int dp, int iterations = 12) {
  static std::map<std::pair<int, int>, std::string> cache;
  const std::pair<int, int> k{dp, iterations};
  if (!cache.contains(k)) {
    const auto r =
        run_moevement("train " + tiny() + " --set train.iterations=" + std::to_string(iterations) +
                      " --set train.seq_len=16 --set parallel.dp=" + std::to_string(dp));
    EXPECT_EQ(r.exit_code, 0) << r.output;
    cache[k] = hash_of(r.output);
  }
  return cache[k];
}

using outcome = launch_outcome;

// The holders list ("5,3") of a snapshot_holders event ("" when it has none).
inline std::string holders_of(const std::string& line) {
  const auto at = line.find("\"holders\":\"");
  if (at == std::string::npos) return "";
  return line.substr(at + 11, line.find('"', at + 11) - at - 11);
}

inline const std::string* event(const outcome& o, const std::string& name) {
  return o.first(name);
}

// A text field of a run-log line ("" when absent).
inline std::string text_field(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":\"");
  if (at == std::string::npos) return "";
  const auto from = at + key.size() + 4;
  return line.substr(from, line.find('"', from) - from);
}

inline std::vector<const std::string*> events(const outcome& o, const std::string& name) {
  return o.events(name);
}

}  // namespace moevement::test_support
