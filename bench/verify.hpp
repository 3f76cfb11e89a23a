// `moevement bench policies --verify`: what the silent-corruption checks cost a fault-free run
// (checkpoint.verify_every at its default against 0, checks off; docs/recovery.md "Silent data
// corruption"), and how many iterations after a flipped bit the head finds it.
//
// Overhead: the same job under policy moevement (the in-memory tier alone), checks off and at
// the default interval, interleaved (off, on, off, ...), --repeats each; counted iterations
// as bench policies counts them (run_log_stats.hpp counted_from), the same indices for both.
//   verify_iteration_time: ours = the median counted iteration_s with the checks, theirs =
//   without; ratio = theirs / ours (1 = no overhead). Plus the mean verify_s of the iterations
//   that digested compute weights and of those that digested the whole state.
// Detection: one run per flip (--inject flip:...) at several iterations past the warm-up, a
// bit the compute weights keep (22) and a low one they round away (2); the latency is
// sdc_suspected's iteration less the flip's. At dp = 2 the job stops after finding it (no
// majority): the latency is read all the same.
#pragma once

#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "bench/launch_job.hpp"
#include "bench/run_log_stats.hpp"
#include "engine/job_config.hpp"

namespace moevement::bench {

struct verify_options {
  std::string config;
  std::vector<std::string> sets;
  int repeats = 3, iterations = 40, pp = 2, dp = 2, spares = 1, w_sparse = 0;
};

// Mean verify_s over the iteration records whose `verified` is `kind`, from `from` on.
inline double mean_verify_s(const std::vector<stamped>& log, const std::string& kind, long from) {
  std::vector<double> v;
  for (const auto& [t, l] : log) {
    if (l.find("\"kind\":\"iteration\"") == std::string::npos) continue;
    if (l.find("\"verified\":\"" + kind + "\"") == std::string::npos) continue;
    if (long(number(l, "iteration")) < from) continue;
    v.push_back(number(l, "verify_s"));
  }
  return mean(v);
}

inline void run_verify(const verify_options& o, const std::string& bin,
                       const std::filesystem::path& log) {
  // The default, or what --set checkpoint.verify_every=N says (the checks-off arm sets 0 after).
  int every = engine::job_config{}.verify_every;
  for (const auto& s : o.sets) {
    if (s.starts_with("checkpoint.verify_every=")) every = std::atoi(s.c_str() + 24);
  }
  // extra: --set values after the options' own; injects: --inject specs.
  auto args = [&](const std::vector<std::string>& extra,
                  const std::vector<std::string>& injects = {}) {
    std::vector<std::string> sets{"checkpoint.policy=moevement",
                                  fmt::format("checkpoint.w_sparse={}", o.w_sparse),
                                  "checkpoint.durable=false"};
    sets.insert(sets.end(), o.sets.begin(), o.sets.end());
    sets.insert(sets.end(), extra.begin(), extra.end());
    return launch_args({o.config, o.iterations, o.pp, o.dp, o.spares}, sets, log, injects);
  };
  std::printf(
      "# config %s pp=%d dp=%d iterations=%d repeats=%d verify_every=%d; "
      "load before: %s\n",
      o.config.c_str(), o.pp, o.dp, o.iterations, o.repeats, every, loadavg().c_str());
  std::vector<run_result> off, on;
  std::vector<std::vector<stamped>> on_logs;
  for (int r = 0; r < o.repeats; ++r) {
    off.push_back(parse(launch_or_throw(bin, args({"checkpoint.verify_every=0"}), log)));
    auto lines = launch_or_throw(bin, args({}), log);
    on.push_back(parse(lines));
    on_logs.push_back(std::move(lines));
  }
  std::vector<run_result> all = off;
  all.insert(all.end(), on.begin(), on.end());
  const long from = counted_from(all);
  if (from + 2 >= o.iterations) {
    throw std::runtime_error(fmt::format(
        "the warm-up ends at iteration {} of {}: raise --iterations or give a smaller --w-sparse",
        from, o.iterations));
  }
  auto pooled = [&](const std::vector<run_result>& runs) {
    std::vector<double> v;
    for (const auto& r : runs) {
      for (const auto& it : r.iterations) {
        if (it.iteration >= from) v.push_back(it.seconds);
      }
    }
    return median(v);
  };
  const double ours = pooled(on), theirs = pooled(off);
  std::vector<double> weights_s, state_s;
  for (const auto& l : on_logs) {
    weights_s.push_back(mean_verify_s(l, "weights", from));
    state_s.push_back(mean_verify_s(l, "state", from));
  }
  std::printf("verify_iteration_time: ours=%.5f theirs=%.5f ratio=%.4f\n", ours, theirs,
              ours > 0 ? theirs / ours : 0.0);
  std::printf(
      "# verify overhead_pct=%.2f (counted iterations from %ld); mean verify_s of the "
      "slowest stage: weights=%.6f state=%.6f\n",
      ours > 0 && theirs > 0 ? 100.0 * (ours / theirs - 1.0) : 0.0, from, mean(weights_s),
      mean(state_s));
  // Detection latency.
  std::vector<long> visible, low;
  for (int k = 0; k < 4; ++k) {
    const long at = from + 3L * k + 1;
    if (at >= o.iterations - every - 1) break;
    for (const int bit : {22, 2}) {
      const std::string spec = fmt::format("flip:stage={},replica={},iter={},word={},bit={}",
                                           k % o.pp, k % o.dp, at, 7 * k, bit);
      const job_outcome j = launch_job(bin, args({}, {spec}), log);
      long found = -1;
      for (const auto& [t, l] : j.lines) {
        if (l.find("\"event\":\"sdc_suspected\"") != std::string::npos) {
          found = long(number(l, "iteration"));
          break;
        }
      }
      if (found < 0) throw std::runtime_error("the flip was not found: " + spec + "\n" + j.output);
      (bit == 22 ? visible : low).push_back(found - at);
    }
  }
  std::printf("detection_latency_iterations: compute_weight_bit=%s low_bit=%s (at most %d)\n",
              fmt::format("{}", fmt::join(visible, ",")).c_str(),
              fmt::format("{}", fmt::join(low, ",")).c_str(), every);
  std::filesystem::remove(log);
}

}  // namespace moevement::bench
