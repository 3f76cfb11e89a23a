// Reading a `moevement launch` run log (JSONL) back for the policies/recovery benchmark:
// the records it needs, a median, and the ETTR definition. Header-only so that the test
// (tests/bench/run_log_stats_test.cpp) checks exactly what the benchmark computes.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace moevement::bench {

// A run log line with the time (since the run's spawn) at which the bench first saw it.
struct stamped {
  double t = 0;
  std::string line;
};

struct iteration_rec {
  long iteration = 0;
  double seconds = 0, stall_s = 0;
  double capture_cpu_s = 0;            // the stages' captures' CPU time, summed
  double replication_cpu_s = 0;        // the workers' actor-thread CPU on replication, summed
  double log_s = 0, step_hooks_s = 0;  // the busiest stage's compute-thread seconds in the hooks
  double step_phase_s = 0;             // of `seconds`, Step sent .. the last Stepped
  double t = 0;                        // when the bench saw the record
  double snapshot_bytes = 0, host_bytes = 0;  // host: snapshot_host_bytes + log_host_bytes
  double mean_stage_compute_s =
      0;                         // over the stages: their forward + backward of all micro-batches
  double max_expert_wait_s = 0;  // the longest a stage waited for expert rows (parallel.ep > 1)
};

// A worker_lost record: which stage, at which iteration, seen when (since the spawn).
struct loss_rec {
  double t = 0;
  int stage = -1, replica = -1;
  long iteration = -1;
};

// A window_persisted record: window `window`, from which a replay starts at first_iteration.
struct persist_rec {
  double t = 0;  // seen
  long window = -1, first_iteration = -1;
};

// A durable_window record (checkpoint.durable): one window on disk on every stage replica.
struct durable_rec {
  long window = -1;
  double bytes = 0, seconds = 0;  // all stages' bytes, the slowest stage's seconds
};

// A recovery_end record: detection to resume, and its parts as the coordinator measured them.
struct recovery_rec {
  double t = 0;  // seen
  long target = -1, replayed = 0;
  int stage = -1;  // the stage rebuilt (the first, when several were)
  double seconds = 0, spawn_s = 0, pull_s = 0, replay_s = 0, rejoin_s = 0;
  // A global rollback: detection to the job rewired, then the checkpoint's query and load; where
  // it went back to (-1: not a rollback).
  double restore_s = 0, load_s = 0;
  long rollback_to = -1;
};

// What one `moevement launch` left in its run log.
struct run_result {
  std::vector<iteration_rec> iterations;
  int w_sparse = 0;  // the W the run ended with (window_tuned changes it)
  int w_first = 0;   // Algorithm 1's (window_chosen)
  long window_chosen_at = -1;
  long w_changed_at = -1;           // the last window_tuned that changed W (-1: none)
  std::map<long, int> w_from;       // every W the tuner chose, by the iteration it took effect
  double t_start = -1, t_end = -1;  // job_start, job_end seen
  std::string state_hash;
  bool recovered = false;
  double recovery_s = 0;
  long target = -1, replay_from = -1, window = -1;
  double t_lost = -1, t_recovery_start = -1, t_recovery_end = -1;  // seen by the bench
  // A global rollback (dense-memory, dense-disk, pec): where to, iterations every stage
  // recomputes, and (pec) the proportion of lost tokens; -1 when not a rollback.
  long rollback_to = -1, recomputed = -1;
  double plt = -1, run_plt = -1;
  double profile_bandwidth = 0;  // window_chosen: snapshot bytes/s per stage process
  // interval_chosen (dense-memory, dense-disk, pec): the checkpoint interval k and the engine's
  // estimate of the slowest stage's full snapshot (Young's C); 0 and -1 when absent.
  int interval = 0;
  double interval_snapshot_s = -1;
  int micro_batches = 0;                 // job_start (0: not in the record)
  int ep = 1;                            // job_start's parallel.ep (1 when not in the record)
  double t_last_iteration = -1;          // the last iteration record seen
  std::vector<loss_rec> losses;          // every worker_lost, in order
  std::vector<recovery_rec> recoveries;  // every recovery_end, in order
  std::vector<persist_rec> persisted;    // every window_persisted, in order
  std::vector<durable_rec> durable;      // every durable_window, in order
};

inline double number(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":");
  if (at == std::string::npos) return 0.0;
  return std::strtod(line.c_str() + at + key.size() + 3, nullptr);
}

inline std::string text(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":\"");
  if (at == std::string::npos) return {};
  const auto from = at + key.size() + 4;
  return line.substr(from, line.find('"', from) - from);
}

inline bool is_event(const std::string& line, const std::string& name) {
  return line.find("\"event\":\"" + name + "\"") != std::string::npos;
}

inline run_result parse(const std::vector<stamped>& log) {
  run_result r;
  for (const auto& [t, l] : log) {
    if (l.find("\"kind\":\"iteration\"") != std::string::npos) {
      iteration_rec it;
      it.iteration = long(number(l, "iteration"));
      it.seconds = number(l, "iteration_s");
      it.stall_s = number(l, "stall_s");
      it.capture_cpu_s = number(l, "capture_cpu_s");
      it.replication_cpu_s = std::max(0.0, number(l, "replication_cpu_s"));
      it.log_s = number(l, "log_s");
      it.step_phase_s = number(l, "step_phase_s");
      it.step_hooks_s = number(l, "step_hooks_s");
      it.snapshot_bytes = number(l, "snapshot_bytes");
      it.host_bytes = number(l, "snapshot_host_bytes") + number(l, "log_host_bytes");
      it.mean_stage_compute_s = number(l, "mean_stage_compute_s");
      it.max_expert_wait_s = number(l, "max_expert_wait_s");
      it.t = t;
      r.iterations.push_back(it);
      r.t_last_iteration = t;
    } else if (is_event(l, "window_chosen")) {
      r.w_sparse = r.w_first = int(number(l, "w_sparse"));
      r.window_chosen_at = long(number(l, "iteration"));
      r.profile_bandwidth = number(l, "profile_bandwidth");
    } else if (is_event(l, "window_tuned")) {
      const int w = int(number(l, "w_sparse"));
      if (w != int(number(l, "previous"))) {
        r.w_sparse = w;
        r.w_changed_at = long(number(l, "iteration"));
        r.w_from[r.w_changed_at] = w;
      }
    } else if (is_event(l, "interval_chosen")) {
      r.interval = int(number(l, "interval"));
      r.interval_snapshot_s = number(l, "snapshot_s");
    } else if (is_event(l, "window_persisted")) {
      r.persisted.push_back({t, long(number(l, "window")), long(number(l, "first_iteration"))});
    } else if (is_event(l, "durable_window")) {
      r.durable.push_back({long(number(l, "window")), number(l, "bytes"), number(l, "seconds")});
    } else if (is_event(l, "job_start")) {
      r.t_start = t;
      r.micro_batches = int(number(l, "micro_batches"));
      r.ep = std::max(1, int(number(l, "ep")));
    } else if (is_event(l, "job_end")) {
      r.t_end = t;
      r.state_hash = text(l, "state_hash");
    } else if (is_event(l, "job_failed")) {
      throw std::runtime_error("the job failed: " + l);
    } else if (is_event(l, "worker_lost")) {
      if (r.t_lost < 0) r.t_lost = t;
      r.losses.push_back(
          {t, int(number(l, "stage")), int(number(l, "replica")), long(number(l, "iteration"))});
    } else if (is_event(l, "recovery_start")) {
      r.t_recovery_start = t;
      r.target = long(number(l, "target_iteration"));
      r.replay_from = long(number(l, "replay_from"));
      r.window = long(number(l, "window"));
    } else if (is_event(l, "recovery_end")) {
      r.recovered = true;
      r.recovery_s = number(l, "seconds");
      r.t_recovery_end = t;
      if (l.find("\"rollback_to\":") != std::string::npos) {
        r.rollback_to = long(number(l, "rollback_to"));
        r.recomputed = long(number(l, "iterations_recomputed"));
      }
      if (l.find("\"plt\":") != std::string::npos) {
        r.plt = number(l, "plt");
        r.run_plt = number(l, "run_plt");
      }
      recovery_rec rr;
      rr.t = t;
      rr.target = long(number(l, "target_iteration"));
      rr.stage = l.find("\"stage\":") != std::string::npos ? int(number(l, "stage")) : -1;
      rr.replayed = long(number(l, "iterations_replayed"));
      rr.seconds = r.recovery_s;
      rr.spawn_s = number(l, "spawn_s");
      rr.pull_s = number(l, "pull_s");
      rr.replay_s = number(l, "replay_s");
      rr.rejoin_s = number(l, "rejoin_s");
      rr.restore_s = number(l, "restore_s");
      rr.load_s = number(l, "load_s");
      rr.rollback_to = r.rollback_to >= 0 && l.find("\"rollback_to\":") != std::string::npos
                           ? long(number(l, "rollback_to"))
                           : -1;
      r.recoveries.push_back(rr);
    }
  }
  if (r.t_start < 0 || r.t_end < 0) throw std::runtime_error("no job_start/job_end in the log");
  return r;
}

inline double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

inline double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return v.empty() ? 0.0 : s / double(v.size());
}

// Fault-free iteration time of each iteration index: the median over the runs.
inline std::map<long, double> per_index(const std::vector<run_result>& runs) {
  std::map<long, std::vector<double>> by;
  for (const auto& r : runs) {
    for (const auto& it : r.iterations) by[it.iteration].push_back(it.seconds);
  }
  std::map<long, double> m;
  for (const auto& [i, v] : by) m[i] = median(v);
  return m;
}

// ETTR: the fault-free time of every iteration the run committed (each index once, however
// often it was attempted or replayed), over the wall time from job_start to job_end.
inline double ettr(const run_result& r, const std::map<long, double>& fault_free) {
  std::set<long> committed;
  for (const auto& it : r.iterations) committed.insert(it.iteration);
  double useful = 0;
  for (long i : committed) {
    const auto f = fault_free.find(i);
    if (f == fault_free.end())
      throw std::runtime_error(fmt::format("no fault-free time for {}", i));
    useful += f->second;
  }
  if (r.t_end <= r.t_start) throw std::runtime_error("job_end not after job_start");
  return useful / (r.t_end - r.t_start);
}

// Wall time the failure cost the coordinator: from the record of the last iteration before
// the failed one to the failed one's record, less that iteration's fault-free time (the
// detection, the recovery and the aborted attempt together). -1 when not measurable.
inline double time_lost(const run_result& r, const std::map<long, double>& fault_free) {
  double before = -1, after = -1;
  for (const auto& it : r.iterations) {
    if (it.iteration == r.target - 1) before = it.t;
    if (it.iteration == r.target && after < 0) after = it.t;
  }
  const auto f = fault_free.find(r.target);
  if (before < 0 || after < 0 || f == fault_free.end()) return -1;
  return after - before - f->second;
}

// The first counted iteration, the same in every run: past the warm-up, when the capture first
// writes its windows' memory (recovery/window_tuner.hpp), and never iteration 0. That is the
// end of the second window (window_chosen's iteration + 2 x its W: a stage holds two windows
// at once), and of the first window after the last change of W (window_tuned).
inline long counted_from(const std::vector<run_result>& runs) {
  long skip = 1;
  for (const auto& r : runs) {
    if (r.window_chosen_at < 0) throw std::runtime_error("a moevement run chose no window");
    skip = std::max(skip, r.window_chosen_at + 2L * r.w_first);
    if (r.w_changed_at >= 0) skip = std::max(skip, r.w_changed_at + r.w_sparse);
  }
  return skip;
}

}  // namespace moevement::bench
