// Feeding a measured `moevement launch` job into the simulator (`moevement bench simvalidate`):
// the profile file writer (docs/simulator.md "Profile file", format 1), the failure trace built
// from a run log's worker_lost records, the simulator inputs for the job's model and plan, and
// the simulator's prediction for a job of a fixed number of iterations. Header-only so that
// tests/bench/sim_validation_test.cpp checks exactly what the benchmark computes.
#pragma once

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/run_log_stats.hpp"
#include "models/config.hpp"
#include "sim/config.hpp"
#include "sim/cost_model.hpp"
#include "sim/ettr.hpp"

namespace moevement::bench {

// A TOML float that reads back bit-exactly: the shortest round-trip digits, with a decimal point
// so that TOML does not take 2.0 for the integer 2.
inline std::string toml_float(double v) {
  if (!std::isfinite(v)) throw std::invalid_argument("profile values must be finite");
  std::string s = fmt::format("{}", v);
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

// The profile in the simulator's format 1. Negative (unmeasured) values and empty lists are
// left out, as the format allows.
inline std::string profile_toml(const sim::profile_data& p) {
  std::string out = "[profile]\nformat_version = 1\n";
  if (!p.producer.empty()) out += fmt::format("producer = \"{}\"\n", p.producer);
  if (p.iteration_s > 0) out += "iteration_s = " + toml_float(p.iteration_s) + "\n";
  if (!p.stage_microbatch_s.empty()) {
    out += "stage_microbatch_s = [";
    for (std::size_t i = 0; i < p.stage_microbatch_s.size(); ++i)
      out += (i ? ", " : "") + toml_float(p.stage_microbatch_s[i]);
    out += "]\n";
  }
  if (p.sync_s >= 0) out += "sync_s = " + toml_float(p.sync_s) + "\n";
  if (p.update_s >= 0) out += "update_s = " + toml_float(p.update_s) + "\n";
  if (p.snapshot_bytes_per_s_per_gpu > 0)
    out += "snapshot_gb_per_s_per_gpu = " + toml_float(p.snapshot_bytes_per_s_per_gpu / 1e9) + "\n";
  if (p.restart_s >= 0) out += "restart_s = " + toml_float(p.restart_s) + "\n";
  if (p.persist_lag_s >= 0) out += "persist_lag_s = " + toml_float(p.persist_lag_s) + "\n";
  if (p.dispatch_s >= 0) out += "dispatch_s = " + toml_float(p.dispatch_s) + "\n";
  if (p.ep > 0) out += fmt::format("ep = {}\n", p.ep);
  if (p.alltoall_s >= 0) out += "alltoall_s = " + toml_float(p.alltoall_s) + "\n";
  if (p.replay_iteration_s > 0)
    out += "replay_iteration_s = " + toml_float(p.replay_iteration_s) + "\n";
  if (!p.snapshot_s.empty()) {
    out += "[profile.snapshot_s]\n";
    for (const auto& [policy, s] : p.snapshot_s) out += policy + " = " + toml_float(s) + "\n";
  }
  if (!p.policy_persist_lag_s.empty()) {
    out += "[profile.policy_persist_lag_s]\n";
    for (const auto& [policy, s] : p.policy_persist_lag_s)
      out += policy + " = " + toml_float(s) + "\n";
  }
  if (!p.policy_restart_s.empty()) {
    out += "[profile.policy_restart_s]\n";
    for (const auto& [policy, s] : p.policy_restart_s) out += policy + " = " + toml_float(s) + "\n";
  }
  if (!p.load_s.empty()) {
    out += "[profile.load_s]\n";
    for (const auto& [policy, s] : p.load_s) out += policy + " = " + toml_float(s) + "\n";
  }
  if (!p.persist_lag_samples_s.empty()) {
    out += "[profile.persist_lag_samples_s]\n";
    for (const auto& [policy, v] : p.persist_lag_samples_s) {
      if (v.empty()) continue;
      out += policy + " = [";
      for (std::size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + toml_float(v[i]);
      out += "]\n";
    }
  }
  return out;
}

// The failures of a run as a simulator trace: one event per lost stage worker (spares that die
// are not failures of the training), at the time the bench saw its worker_lost record, counted
// from job_start: the simulator's clock starts with the first iteration, as job_start does.
inline std::vector<sim::failure_event> failure_trace(const run_result& r) {
  std::vector<sim::failure_event> out;
  for (const auto& l : r.losses) {
    if (l.stage < 0) continue;
    out.push_back({l.t - r.t_start, l.stage});
  }
  return out;
}

// The same as a trace file (`failures.trace`, docs/simulator.md "Trace file").
inline std::string trace_text(const std::vector<sim::failure_event>& trace) {
  std::string out = "# TIME_SECONDS STAGE, measured by moevement bench simvalidate\n";
  for (const auto& e : trace) out += fmt::format("{} {}\n", toml_float(e.time_s), e.stage);
  return out;
}

// ETTR over the window the simulator models: from job_start (the first iteration is sent right
// after it) to the record of the last iteration (the job's final hash and shutdown after it are
// not training and the simulator has no such phase). Useful time as in ettr().
inline double ettr_training_window(const run_result& r, const std::map<long, double>& fault_free) {
  if (r.t_last_iteration <= r.t_start) throw std::runtime_error("no iteration after job_start");
  const double whole = r.t_end - r.t_start;
  return ettr(r, fault_free) * whole / (r.t_last_iteration - r.t_start);
}

// moevement's W_sparse as the simulator should take it for run `r`: the tuner's W at the run's
// first failure (a recovery replays from windows of that W; the tuner may choose another after
// it), else the W the run ended with (0: none logged).
inline int w_at_failure(const run_result& r) {
  if (r.recoveries.empty() || r.recoveries.front().target < 0) return r.w_sparse;
  const auto after = r.w_from.upper_bound(r.recoveries.front().target);
  return after == r.w_from.begin() ? r.w_first : std::prev(after)->second;
}

// The run's own iteration times: each committed index's `iteration_s` in this run (its last
// record: after a failure the re-attempt, which is what committed it). As the useful time of
// ettr() this is the simulator's definition (committed iterations x T_iter over the wall time)
// with the run's own speed, so that run-to-run speed differences of a shared machine do not
// count as failure cost.
inline std::map<long, double> own_times(const run_result& r) {
  std::map<long, double> m;
  for (const auto& it : r.iterations) m[it.iteration] = it.seconds;
  return m;
}

// Persist lag of every window: from the record of its last iteration (first_iteration - 1: the
// state a replay starts from) to its window_persisted record, both as the bench saw them.
inline std::vector<double> persist_lags(const run_result& r) {
  std::map<long, double> seen;
  for (const auto& it : r.iterations) seen.emplace(it.iteration, it.t);  // first record
  std::vector<double> out;
  for (const auto& p : r.persisted) {
    const auto it = seen.find(p.first_iteration - 1);
    if (it != seen.end()) out.push_back(std::max(0.0, p.t - it->second));
  }
  return out;
}

// The coordinator's wall time between iterations outside their own iteration_s (messaging,
// dispatch): for each iteration record, its time since the previous record (job_start for the
// first) less its iteration_s, where no loss or recovery lies between the two (those are
// recovery time). Times as the bench saw the records; one per such iteration.
inline std::vector<double> dispatch_gaps(const run_result& r) {
  std::vector<double> events;
  for (const auto& l : r.losses) events.push_back(l.t);
  for (const auto& c : r.recoveries) events.push_back(c.t);
  std::vector<double> out;
  double prev = r.t_start;
  for (const auto& it : r.iterations) {
    bool clean = prev >= 0;
    for (double e : events) clean = clean && !(e > prev && e <= it.t);
    if (clean) out.push_back(it.t - prev - it.seconds);
    prev = it.t;
  }
  return out;
}

// Where a run's lost time went (time lost = training window - the committed iterations' own
// times), from the records as the bench saw them: the parts add up to it exactly.
struct lost_time_split {
  double dispatch_s = 0;    // between iterations outside them (dispatch_gaps)
  double aborted_s = 0;     // last record before a loss to the loss: the aborted iteration
                            // and the detection
  double recovery_s = 0;    // the loss to recovery_end (restart and load)
  double resume_gap_s = 0;  // recovery_end to the next record, less that iteration's own time
  double lost_work_s = 0;   // every attempt that did not commit (rolled back): own times
  long lost_iterations = 0;
  double total() const { return dispatch_s + aborted_s + recovery_s + resume_gap_s + lost_work_s; }
};

inline lost_time_split split_lost_time(const run_result& r) {
  // 0: iteration, 1: loss of a stage worker, 2: recovery_end; in the order the bench saw them.
  struct mark {
    double t;
    int kind;
    double seconds;
  };
  std::vector<mark> marks;
  for (const auto& it : r.iterations) marks.push_back({it.t, 0, it.seconds});
  for (const auto& l : r.losses) {
    if (l.stage >= 0) marks.push_back({l.t, 1, 0});
  }
  for (const auto& c : r.recoveries) marks.push_back({c.t, 2, 0});
  std::stable_sort(marks.begin(), marks.end(),
                   [](const mark& a, const mark& b) { return a.t < b.t; });
  lost_time_split out;
  double prev = r.t_start;
  bool resuming = false;
  for (const auto& m : marks) {
    if (m.kind == 0) {
      (resuming ? out.resume_gap_s : out.dispatch_s) += m.t - prev - m.seconds;
      resuming = false;
    } else if (m.kind == 1) {
      (resuming ? out.recovery_s : out.aborted_s) += m.t - prev;  // a loss during a recovery
      resuming = true;
    } else {
      out.recovery_s += m.t - prev;
    }
    prev = m.t;
  }
  double all = 0, own = 0;
  for (const auto& it : r.iterations) all += it.seconds;
  for (const auto& [i, v] : own_times(r)) own += v;
  out.lost_work_s = all - own;
  out.lost_iterations = long(r.iterations.size()) - long(own_times(r).size());
  return out;
}

// Median over the iterations of the stages' mean compute time per micro-batch.
inline double stage_microbatch_s(const std::vector<run_result>& runs, int micro_batches) {
  std::vector<double> v;
  for (const auto& r : runs) {
    for (const auto& it : r.iterations) v.push_back(it.mean_stage_compute_s / micro_batches);
  }
  return median(v);
}

// One recovery split as the simulator counts it: restart (detection to the job ready to load)
// and load (the checkpoint read back). A rollback's record has both (restore_s, load_s);
// moevement's has its parts: the pull of the persisted window is its load, the replay is left
// out (the simulator computes it from the stage times), the rest is restart.
struct recovery_split {
  double restart_s = 0, load_s = 0;
};

inline recovery_split split_recovery(const recovery_rec& r) {
  if (r.rollback_to >= 0) return {r.restore_s, r.load_s};
  return {std::max(0.0, r.seconds - r.replay_s - r.pull_s), r.pull_s};
}

// A baseline's measured checkpoint time: its snapshot is taken on the compute thread after the
// step (recovery/baseline_policy.cpp), so the iteration record's stall_s at each checkpoint
// iteration ((i + 1) % k == 0) is that time. Median over the runs; -1 when none was taken.
inline double checkpoint_stall_s(const std::vector<run_result>& runs) {
  std::vector<double> v;
  for (const auto& r : runs) {
    if (r.interval < 1) continue;
    for (const auto& it : r.iterations) {
      if ((it.iteration + 1) % r.interval == 0) v.push_back(it.stall_s);
    }
  }
  return v.empty() ? -1.0 : median(v);
}

// The profile `moevement bench policies --profile-out FILE` writes (format 1): the fault-free
// iteration time of training without checkpoints (policy none: the median of the iterations
// from `counted_from` on, as that bench's iteration_time), stage times per micro-batch from the
// same runs (every stage gets the mean stage's: the run log has no per-stage times), moevement's
// snapshot bandwidth (window_chosen) and persist lag, and from the recoveries of `faulty` (may
// be empty) the restart and moevement's load (split_recovery). Throws when a run log lacks what
// a field needs, naming it.
inline sim::profile_data policies_profile(const std::vector<run_result>& none,
                                          const std::vector<run_result>& moevement,
                                          const std::vector<run_result>& faulty, long counted_from,
                                          int pp) {
  if (none.empty() || moevement.empty() || pp < 1)
    throw std::invalid_argument("policies_profile: needs runs of none and moevement, pp >= 1");
  sim::profile_data p;
  p.producer = "moevement bench policies";
  std::vector<double> times, bandwidths, lags;
  for (const auto& r : none) {
    for (const auto& it : r.iterations) {
      if (it.iteration >= counted_from) times.push_back(it.seconds);
    }
  }
  if (times.empty()) throw std::runtime_error("policies_profile: no counted iteration of none");
  p.iteration_s = median(times);
  const int m = none.front().micro_batches;
  if (m < 1) throw std::runtime_error("policies_profile: job_start has no micro_batches");
  p.stage_microbatch_s.assign(std::size_t(pp), stage_microbatch_s(none, m));
  for (const auto& r : moevement) {
    if (r.profile_bandwidth > 0) bandwidths.push_back(r.profile_bandwidth);
    for (double l : persist_lags(r)) lags.push_back(l);
  }
  if (bandwidths.empty()) throw std::runtime_error("policies_profile: no window_chosen bandwidth");
  p.snapshot_bytes_per_s_per_gpu = median(bandwidths);
  if (!lags.empty()) {
    p.persist_lag_s = median(lags);
    p.persist_lag_samples_s["moevement"] = lags;  // the distribution, as simvalidate writes it
  }
  // Under expert parallelism: the EP degree, and the all-to-all's share of a micro-batch (the
  // longest expert wait of a stage per micro-batch, policy none's median counted iteration).
  if (none.front().ep > 1) {
    p.ep = none.front().ep;
    std::vector<double> waits;
    for (const auto& r : none) {
      for (const auto& it : r.iterations) {
        if (it.iteration >= counted_from) waits.push_back(it.max_expert_wait_s / m);
      }
    }
    p.alltoall_s = median(waits);
  }
  std::vector<double> gaps;
  for (const auto& r : none) {
    for (double g : dispatch_gaps(r)) gaps.push_back(g);
  }
  if (!gaps.empty()) p.dispatch_s = std::max(0.0, mean(gaps));
  std::vector<double> restarts, loads;
  for (const auto& r : faulty) {
    for (const auto& rec : r.recoveries) {
      const auto s = split_recovery(rec);
      restarts.push_back(s.restart_s);
      loads.push_back(s.load_s);
    }
  }
  if (!restarts.empty()) {
    p.restart_s = mean(restarts);
    p.policy_restart_s["moevement"] = median(restarts);
    p.load_s["moevement"] = mean(loads);
  }
  return p;
}

// When each dense-disk window became loadable, as the bench saw it: [store directory][window id,
// the state iteration] = the first poll that found its MANIFEST (recovery/durable_store.hpp: a
// window exists once its manifest does).
using disk_windows_seen = std::map<std::string, std::map<long, double>>;

// Looks at dense-disk's checkpoint directory (one store per stage replica) at time `t`.
inline void watch_disk_windows(const std::filesystem::path& dir, double t,
                               disk_windows_seen& seen) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (const auto& store : fs::directory_iterator(dir, ec)) {
    auto& mine = seen[store.path().filename().string()];
    for (const auto& w : fs::directory_iterator(store.path(), ec)) {
      const std::string name = w.path().filename().string();
      if (name.rfind("window-", 0) != 0) continue;
      const long id = std::atol(name.c_str() + 7);
      if (!mine.contains(id) && fs::exists(w.path() / "MANIFEST", ec)) mine[id] = t;
    }
  }
}

// dense-disk's persist lag per checkpoint: from the record of its last iteration (state s: the
// record of iteration s - 1) until every stage's store had window s. Windows some store never
// showed (dropped before a poll saw them), and windows of a recomputed iteration, are left out.
inline std::vector<double> disk_persist_lags(const run_result& r, const disk_windows_seen& seen) {
  std::map<long, double> rec;
  std::map<long, int> records;
  for (const auto& it : r.iterations) {
    rec.emplace(it.iteration, it.t);  // first record
    ++records[it.iteration];
  }
  std::map<long, std::pair<double, std::size_t>> all;  // window: latest first sight, stores
  for (const auto& [store, windows] : seen) {
    for (const auto& [id, t] : windows) {
      auto& a = all[id];
      a.first = std::max(a.first, t);
      ++a.second;
    }
  }
  std::vector<double> out;
  for (const auto& [id, a] : all) {
    const auto it = rec.find(id - 1);
    // A window whose iteration was redone after a rollback may have been taken twice: its
    // first sight cannot be matched to one record.
    if (id < 1 || a.second != seen.size() || it == rec.end() || records[id - 1] != 1) continue;
    out.push_back(std::max(0.0, a.first - it->second));
  }
  return out;
}

// What the simulator needs to know about the job besides the profile.
struct job_shape {
  models::model_config model;
  int seq_len = 32, micro_batches = 1, micro_batch_size = 1;
  int pp = 1, dp = 1, replicas = 2;
};

// The job's model in the simulator's terms. The engine's GELU experts have two matrices; the
// position embedding and the norms, which the simulator's shape does not name, are counted as
// extra parameters of the first stage so that the totals agree exactly.
inline sim::model_shape sim_model(const job_shape& j) {
  sim::model_shape m;
  m.name = j.model.preset;
  m.layers = j.model.layers;
  m.hidden = j.model.d_model;
  m.vocab = j.model.vocab;
  m.seq_len = j.seq_len;
  m.experts = j.model.experts;
  m.top_k = j.model.top_k;
  m.shared_experts = j.model.shared_experts;
  m.expert_ffn = j.model.d_ff;
  m.gated_ffn = false;
  m.tied_embeddings = false;
  m.extra_params = double(j.model.parameter_count()) - sim::total_params(m);
  return m;
}

// Simulator inputs for the job on this machine: one node holding every process, every link at
// `copy_bytes_per_s` (the plain copy bandwidth the engine measured), snapshots at
// `snapshot_bytes_per_s` per process (what the engine's Algorithm 1 used). Compute rates do not
// matter: the profile's stage times replace them.
inline sim::model_inputs sim_inputs(const job_shape& j, double copy_bytes_per_s,
                                    double snapshot_bytes_per_s) {
  if (!(copy_bytes_per_s > 0) || !(snapshot_bytes_per_s > 0))
    throw std::invalid_argument("sim_inputs: bandwidths must be positive");
  sim::model_inputs in;
  in.model = sim_model(j);
  in.cluster.gpu = "cpu-process";
  in.cluster.gpus_per_node = j.pp * j.dp;
  in.cluster.intra_node_bytes_per_s = copy_bytes_per_s;
  in.cluster.inter_node_bytes_per_s = copy_bytes_per_s * in.cluster.gpus_per_node;
  in.cluster.host_device_bytes_per_s = copy_bytes_per_s;
  in.cluster.storage_bytes_per_s = copy_bytes_per_s;
  in.cluster.snapshot_bytes_per_s = snapshot_bytes_per_s;
  in.plan.pp = j.pp;
  in.plan.dp = j.dp;
  in.plan.ep = 1;
  in.plan.micro_batch = j.micro_batch_size;
  in.plan.global_batch = j.micro_batches * j.micro_batch_size * j.dp;
  in.plan.zero1 = false;  // every replica keeps its own optimizer state, as the engine does
  return in;
}

// The simulator's model of `policy` for the job: the profile's measured inputs (iteration time,
// stage times, snapshot bandwidth; snapshot and load times per policy where measured; moevement's
// persist lag), the engine's checkpoint interval `interval` for the baselines (global rollback to
// the newest checkpoint every stage holds: dense-memory, dense-disk and pec alike in our engine),
// restart from `f`, and moevement's W_sparse `w_sparse` where the engine's window tuner chose
// one (0: Algorithm 1's, as the simulator chooses it). `copy_bytes_per_s`: the plain copy
// bandwidth (sim_inputs).
inline sim::policy_model sim_policy(const job_shape& j, const sim::profile_data& prof,
                                    const std::string& policy, int interval,
                                    const sim::failure_settings& f, int w_sparse = 0) {
  if (!(prof.snapshot_bytes_per_s_per_gpu > 0))
    throw std::invalid_argument("sim_policy: the profile needs a snapshot bandwidth");
  // The engine's bandwidth is its plain copy divided by 1 + r (engine/coordinator.cpp).
  const auto in = sim_inputs(j, prof.snapshot_bytes_per_s_per_gpu * (1 + j.replicas),
                             prof.snapshot_bytes_per_s_per_gpu);
  const auto costs = sim::apply_profile(
      sim::estimate_iteration(in.model, in.cluster, in.plan, in.constants, j.replicas), prof);
  sim::policy_settings ps;
  ps.kind = sim::parse_policy(policy);
  ps.replicas = j.replicas;
  if (ps.kind == sim::policy_kind::moevement) {
    ps.persist_lag_s = prof.persist_lag_s;  // measured on moevement's windows
    ps.w_sparse = w_sparse;
    ps.replay_iteration_s = prof.replay_iteration_s;
  } else {
    if (interval < 1) throw std::invalid_argument("sim_policy: a baseline needs its interval");
    // The engine's interval, whatever rule chose it (checkpoint.interval or Young's).
    ps.rule = sim::interval_rule::fixed;
    ps.fixed_interval = interval;
    ps.pec_interval = interval;
    // The engine checkpoints pec's K experts per MoE layer from the start; no doubling levels
    // matter at these lengths (the budget is per fault), and the persist lag of a baseline is
    // measured where the profile has it (dense-disk: its windows' MANIFEST seen on disk), else
    // modelled from its measured snapshot time (no run log record says when a checkpoint reached
    // its holders).
  }
  if (const auto it = prof.snapshot_s.find(policy); it != prof.snapshot_s.end())
    ps.snapshot_s = it->second;
  if (const auto it = prof.load_s.find(policy); it != prof.load_s.end()) ps.load_s = it->second;
  if (const auto it = prof.policy_restart_s.find(policy); it != prof.policy_restart_s.end())
    ps.restart_s = it->second;
  if (const auto it = prof.policy_persist_lag_s.find(policy); it != prof.policy_persist_lag_s.end())
    ps.persist_lag_s = it->second;
  if (const auto it = prof.persist_lag_samples_s.find(policy);
      it != prof.persist_lag_samples_s.end())
    ps.persist_lag_samples_s = it->second;
  return sim::build_policy(in, costs, ps, f, 3600.0);  // the MTBF feeds only Young and oracle
}

// For a prediction at a run's own iteration times, which already contain the checkpoint stalls:
// the model must not add them again.
inline sim::policy_model without_stall(sim::policy_model m) {
  m.stall_s = 0;
  std::fill(m.pec_stall_s.begin(), m.pec_stall_s.end(), 0.0);
  return m;
}

struct prediction {
  double ettr = 0;
  double wall_s = 0;       // time to commit the job's iterations
  double time_lost_s = 0;  // wall_s - iterations x iteration time
  double recovery_s = 0;   // the simulator's recovery time (restart, load, replay, aborted)
  double failures = 0;
};

// The simulator's ETTR for a job of `iterations` iterations: the shortest duration in which its
// run (one trial: the trace fixes the failures and their stages) commits them all, found by
// bisection over `failures.duration` (the simulator's run has a fixed length; ours a fixed
// number of iterations, and with a few dozen iterations rounding the progress to whole
// iterations would move ETTR by up to 1/iterations). ETTR = iterations x T_iter / that duration.
inline prediction predict_fixed_work(const sim::policy_model& m, long iterations,
                                     const sim::failure_settings& settings,
                                     const std::vector<sim::failure_event>& trace) {
  if (iterations < 1 || !(m.iteration_s > 0))
    throw std::invalid_argument("predict_fixed_work: iterations and iteration time must be > 0");
  sim::failure_settings f = settings;
  f.trials = 1;
  const double t = m.iteration_s;
  const double no_failures = std::numeric_limits<double>::max();  // Poisson gap never reached
  auto run = [&](double duration) {
    f.duration_s = duration;
    return sim::monte_carlo(m, trace.empty() ? no_failures : 1.0, f, trace);
  };
  auto done = [&](const sim::monte_carlo_result& r, double duration) {
    return std::lround(r.ettr_mean * duration / t) >= iterations;
  };
  double lo = (double(iterations) - 0.5) * t;  // shorter than the iterations alone: never done
  double hi = 2 * double(iterations) * t;
  while (!done(run(hi), hi)) {
    lo = hi;
    hi *= 2;
    if (hi > 1e12) throw std::runtime_error("predict_fixed_work: the run never completes");
  }
  for (int i = 0; i < 200 && hi - lo > 1e-12 * hi; ++i) {
    const double mid = 0.5 * (lo + hi);
    (done(run(mid), mid) ? hi : lo) = mid;
  }
  const auto r = run(hi);
  prediction p;
  p.wall_s = hi;
  p.ettr = double(iterations) * t / hi;
  p.time_lost_s = hi - double(iterations) * t;
  p.recovery_s = r.recovery_s_mean;
  p.failures = r.failures_mean;
  return p;
}

// Where each failure of a run hit: the iteration it aborted (the number of iterations committed
// before it) and how far into that attempt (from the previous iteration's record, or job_start).
struct failure_point {
  long iteration = 0;
  double offset_s = 0;
  int stage = 0;
};

inline std::vector<failure_point> failure_points(const run_result& r) {
  std::vector<failure_point> out;
  for (const auto& e : failure_trace(r)) {
    const double t = e.time_s + r.t_start;
    failure_point p;
    p.stage = e.stage;
    double since = r.t_start;
    std::set<long> committed;
    for (const auto& it : r.iterations) {
      if (it.t > t) break;
      committed.insert(it.iteration);
      since = it.t;
    }
    p.iteration = long(committed.size());
    p.offset_s = t - since;
    out.push_back(p);
  }
  return out;
}

// The run's failures at the same points (same iteration, same time into it) on the simulator's
// clock for policy `m`: for a reference speed other than the run's own, the same absolute times
// would fall into other iterations (or after the end of a faster run). Earlier failures delay
// the later ones by the simulator's own recovery time.
inline std::vector<sim::failure_event> trace_at_points(const std::vector<failure_point>& points,
                                                       const sim::policy_model& m,
                                                       const sim::failure_settings& f) {
  std::vector<sim::failure_event> out;
  for (const auto& p : points) {
    const double start = p.iteration > 0 ? predict_fixed_work(m, p.iteration, f, out).wall_s : 0.0;
    out.push_back({start + p.offset_s, p.stage});
  }
  return out;
}

// The expected prediction over the measured persist lags: one fixed-work run per lag sample
// (every checkpoint of that run lags that much), their mean duration. The failures come from
// `trace_for(m)` for each sample's model (trace_at_points depends on it). The expectation is
// exact over the empirical distribution for a run whose failures each depend on one checkpoint
// (the one before the failure: the lags are shorter than an interval); for several failures it
// assumes their checkpoints' lags alike, which leaves the expectation of a sum of per-failure
// losses unchanged. Without samples: the one prediction at persist_lag_s.
template <typename TraceFor>
inline prediction predict_over_lags(const sim::policy_model& m, long iterations,
                                    const sim::failure_settings& f, const TraceFor& trace_for) {
  if (m.persist_lag_samples_s.empty()) return predict_fixed_work(m, iterations, f, trace_for(m));
  prediction sum;
  for (double lag : m.persist_lag_samples_s) {
    sim::policy_model one = m;
    one.persist_lag_samples_s.clear();
    one.persist_lag_s = lag;
    const auto p = predict_fixed_work(one, iterations, f, trace_for(one));
    sum.wall_s += p.wall_s;
    sum.recovery_s += p.recovery_s;
    sum.failures += p.failures;
  }
  const double n = double(m.persist_lag_samples_s.size());
  prediction out;
  out.wall_s = sum.wall_s / n;
  out.recovery_s = sum.recovery_s / n;
  out.failures = sum.failures / n;
  out.time_lost_s = out.wall_s - double(iterations) * m.iteration_s;
  out.ettr = double(iterations) * m.iteration_s / out.wall_s;
  return out;
}

}  // namespace moevement::bench
