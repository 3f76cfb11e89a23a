// `moevement bench simvalidate [options]`: the simulator (sim/) against our own engine. Runs real
// `moevement launch` jobs (one process per stage, UCX between them): policy `none` and each
// checkpoint policy fault-free, then each policy with the failures of every --failures SPEC
// injected (`--inject kill:stage=S,replica=0,iter=T`). From the run logs it measures ETTR and
// a profile (written in the simulator's format 1 with --profile-out), builds the simulator's
// inputs for the same job through the sim library (model shape, plan, the profile, the same
// failures) and prints, per policy and run,
//   ettr_<policy>_<run>: measured=<v> predicted=<v> diff=<predicted - measured>
//   sim_ettr_<policy>_<run>: ours=<predicted> theirs=<measured> ratio=<min/max, 1 = exact>
// and per policy and --failures SPEC the same for the medians over the repeats (`_median`).
//
// ETTR, measured: the useful time of every iteration the run committed (each index once: its
// own iteration_s in this run, the last record, i.e. the one that committed it) over the
// training window: from job_start (the first iteration is sent right after it) to the record of
// the last iteration. Process spawn and wiring happen before job_start; the final hash and the
// shutdown after the last iteration are not training; validation is off (train.val_batches=0).
// ETTR, predicted: iterations x T over the simulator's time to commit them (a fixed-work run,
// bench/sim_validation.hpp), T = the mean of the same useful times, with the failures at the
// same iterations and times into them (trace_at_points; `_at_times`: at the same times from
// job_start). Both ETTRs therefore measure what the failures cost. Other references:
// `_ffref` (the policy's fault-free runs' per-index medians) and `_vs_none` (policy none's
// fault-free times and T, the profile file's iteration_s, so that the checkpoint overhead
// counts too: the simulator's ETTR definition, paper 2.4).
//
// Profile: T and stage times as above; snapshot bandwidth: moevement's window_chosen; persist
// lag: window_persisted after its last iteration's record, fault-free moevement runs; restart
// and load per recovery (split_recovery): a rollback's restore_s and load_s, moevement's
// recovery_end seconds less its replay (the simulator replays itself) and pull (its load);
// the baselines' snapshot_s: their stall_s at checkpoint iterations; dense-disk's persist lag:
// its windows' MANIFEST seen on disk (polled with the run log) after the checkpointed
// iteration's record (the other baselines' is modelled from their snapshot_s); both lags as
// their measured distribution (the prediction is the expectation over it: predict_over_lags);
// dispatch: the time between iteration records beyond their own iteration_s (dispatch_gaps).
// Medians throughout: one recovery in several takes 5-10x the others on a loaded machine
// (the `_mean` lines use means). HELD OUT: each faulty run is predicted with the median
// restart and load of the same policy's other faulty runs (a rollback's restart rewires every
// stage, moevement's only the replacement).
//
// The baselines (dense-memory, dense-disk, pec) run at checkpoint.interval = --interval (10;
// 0: the engine's Young choice) and recover by global rollback to the newest checkpoint every
// stage holds (engine/coordinator_rollback.cpp); the simulator gets the interval the engine
// logged (interval_chosen) and rolls every stage back the same way.
//
// Options: --config FILE (default examples/configs/pipeline_tiny.toml), --set KEY=VALUE
// (repeatable), --iterations N (48), --pp N (3), --dp N (1), --spares N (2), --repeats N (3,
// fault-free runs per policy), --faulty-repeats N (3, runs per --failures SPEC and policy; the
// per-SPEC medians are printed as ettr_<policy>_<spec>_median), --preset NAME (tiny),
// --micro-batches N (4), --micro-batch-size N (4), --seq-len N (32), --failures SPEC (repeatable;
// one faulty run per SPEC, a comma list of STAGE@ITERATION; default "1@2N/3", "1@N/3,2@2N/3" and
// "0@N/2"), --policies LIST (default moevement,dense-memory,dense-disk,pec), --interval K (10),
// --profile-out FILE, --trace-out PREFIX (writes PREFIX<policy>_<run>.txt trace files), --keep-logs
// DIR (every run log, each line with the time the bench saw it). Run from the source root.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/launch_job.hpp"
#include "bench/run_log_stats.hpp"
#include "bench/sim_validation.hpp"
#include "bench/sim_validation_options.hpp"
#include "models/config.hpp"
#include "sim/config.hpp"
#include "sim/cost_model.hpp"
#include "sim/ettr.hpp"

namespace {

namespace fs = std::filesystem;
using namespace moevement;
using namespace moevement::bench;

using simvalidate::kill_at;
using simvalidate::options;
using simvalidate::parse_options;

std::string run_name(const std::vector<kill_at>& spec) {
  std::string s = fmt::format("{}fail", spec.size());
  for (const auto& k : spec) s += fmt::format("_s{}i{}", k.stage, k.iteration);
  return s;
}

double mean_of(const std::map<long, double>& m) {
  double s = 0;
  for (const auto& [i, v] : m) s += v;
  return m.empty() ? 0.0 : s / double(m.size());
}

struct policy_runs {
  std::string name;
  bool available = true;
  std::string why;
  std::vector<run_result> fault_free;
  std::vector<double> disk_lags;  // dense-disk: persist lags seen in the fault-free runs
  std::vector<std::pair<std::string, run_result>> faulty;  // name, run
  std::vector<disk_windows_seen> faulty_disk;              // dense-disk: windows seen, per run
};

void print_compare(const std::string& metric, double measured, double predicted) {
  std::printf("%s: measured=%.4f predicted=%.4f diff=%+.4f\n", metric.c_str(), measured, predicted,
              predicted - measured);
  const double lo = std::min(measured, predicted), hi = std::max(measured, predicted);
  std::printf("sim_%s: ours=%.4f theirs=%.4f ratio=%.4f\n", metric.c_str(), predicted, measured,
              hi > 0 ? lo / hi : 0.0);
}

// The bench's runs: policy none's fault-free runs, and every policy's.
struct bench_runs {
  std::vector<run_result> none;
  std::vector<policy_runs> pols;
};

// Launches the bench's `moevement launch` jobs: one job's arguments, one launch, and every run of
// the bench (fault-free, then faulty).
struct job_runner {
  const options& o;
  const std::string& bin;
  const fs::path& log;
  const fs::path& disk_dir;
  int kept = 0;  // run logs written to --keep-logs

  std::vector<std::string> args(const std::string& policy,
                                const std::vector<kill_at>& kills) const {
    std::vector<std::string> a{"launch", o.config};
    auto set = [&](const std::string& kv) {
      a.push_back("--set");
      a.push_back(kv);
    };
    set("model.preset=" + o.preset);
    set(fmt::format("train.iterations={}", o.iterations));
    set(fmt::format("train.micro_batches={}", o.micro_batches));
    set(fmt::format("train.micro_batch_size={}", o.micro_batch_size));
    set(fmt::format("train.seq_len={}", o.seq_len));
    set("train.val_batches=0");
    set("train.log_every=1000000");
    set(fmt::format("parallel.pp={}", o.pp));
    set(fmt::format("parallel.dp={}", o.dp));
    set(fmt::format("cluster.spares={}", o.spares));
    set("checkpoint.policy=" + policy);
    if (policy != "moevement" && policy != "none")
      set(fmt::format("checkpoint.interval={}", o.interval));
    if (policy == "dense-disk") set("checkpoint.dir=" + disk_dir.string());
    // As in bench policies: under load the 1 s default heartbeat silence looked like a lost
    // worker; the injected kills are detected by the process's exit.
    set("cluster.failure_timeout_ms=10000");
    for (const auto& s : o.sets) set(s);
    set("engine.run_log=" + log.string());
    for (const auto& k : kills) {
      a.push_back("--inject");
      a.push_back(fmt::format("kill:stage={},replica=0,iter={}", k.stage, k.iteration));
    }
    return a;
  }

  void keep(const std::string& label, const job_outcome& j) {
    if (o.keep_logs.empty()) return;
    fs::create_directories(o.keep_logs);
    std::ofstream out(fs::path(o.keep_logs) / fmt::format("{:02}_{}.tsv", kept++, label));
    for (const auto& [t, line] : j.lines) out << fmt::format("{:.4f}\t{}\n", t, line);
  }

  // dense-disk: when each window reached the disk (`seen`, on the run log's clock).
  job_outcome launch_one(const std::string& policy, const std::vector<kill_at>& kills,
                         disk_windows_seen* seen = nullptr) const {
    fs::remove_all(disk_dir);
    std::function<void(double)> watch;
    if (seen != nullptr && policy == "dense-disk")
      watch = [&](double t) { watch_disk_windows(disk_dir, t, *seen); };
    job_outcome j = launch_job(bin, args(policy, kills), log, watch);
    fs::remove_all(disk_dir);
    // moevement's durable tier, beside the run log by default (checkpoint.dir)
    fs::remove_all(fs::path(log).replace_extension(".checkpoints"));
    return j;
  }

  run_result run(const std::string& policy, const std::vector<kill_at>& kills,
                 disk_windows_seen* seen = nullptr) {
    const job_outcome j = launch_one(policy, kills, seen);
    keep(policy + (kills.empty() ? std::string("_faultfree") : "_" + run_name(kills)), j);
    if (!j.ok) throw std::runtime_error("moevement launch failed (" + policy + "):\n" + j.output);
    return parse(j.lines);
  }

  // Runs. `none` and the policies fault-free, interleaved; a policy that `moevement launch`
  // rejects is reported as not available.
  bench_runs run_fault_free() {
    std::vector<run_result> none;
    std::vector<policy_runs> pols;
    for (const auto& p : o.policies) {
      pols.emplace_back();
      pols.back().name = p;
    }
    for (int r = 0; r < o.repeats; ++r) {
      none.push_back(run("none", {}));
      for (auto& p : pols) {
        if (!p.available) continue;
        disk_windows_seen seen;
        const job_outcome j = launch_one(p.name, {}, &seen);
        if (!j.ok) {
          if (r == 0 && j.output.find("not available") != std::string::npos) {
            p.available = false;
            const auto at = j.output.find("checkpoint.policy");
            p.why = j.output.substr(at == std::string::npos ? 0 : at);
            p.why = p.why.substr(0, p.why.find('\n'));
            continue;
          }
          throw std::runtime_error("moevement launch failed (" + p.name + "):\n" + j.output);
        }
        keep(p.name + "_faultfree", j);
        p.fault_free.push_back(parse(j.lines));
        for (double l : disk_persist_lags(p.fault_free.back(), seen)) p.disk_lags.push_back(l);
      }
    }
    return {std::move(none), std::move(pols)};
  }

  // Each available policy with the failures of every --failures SPEC, --faulty-repeats times.
  void run_faulty(std::vector<policy_runs>& pols) {
    for (auto& p : pols) {
      if (!p.available) continue;
      for (int k = 0; k < o.faulty_repeats; ++k) {
        for (const auto& spec : o.failures) {
          disk_windows_seen seen;
          p.faulty.push_back({run_name(spec) + fmt::format("_r{}", k), run(p.name, spec, &seen)});
          p.faulty_disk.push_back(std::move(seen));
        }
      }
    }
  }
};

// The run log has each iteration's mean over the stages of their compute time, not each
// stage's: every stage gets that mean per micro-batch (tiny's 4 layers on 3 stages are not
// alike; the replay of a failed stage is costed at the mean stage's speed).
std::vector<double> stage_microbatch(const options& o, const std::vector<run_result>& runs) {
  return std::vector<double>(std::size_t(o.pp), stage_microbatch_s(runs, o.micro_batches));
}

// The measured profile, and the samples behind its restart and persist lag.
struct measured_profile {
  sim::profile_data prof;
  std::vector<double> restarts, replays, lags;
};

measured_profile measure_profile(const options& o, const std::vector<run_result>& none,
                                 const std::vector<policy_runs>& pols,
                                 const std::map<long, double>& none_ff) {
  sim::profile_data prof;
  std::vector<double> bandwidths, restarts, replays, lags;
  for (const auto& p : pols) {
    for (const auto& r : p.fault_free) {
      if (r.profile_bandwidth > 0) bandwidths.push_back(r.profile_bandwidth);
      if (p.name == "moevement") {
        for (double l : persist_lags(r)) lags.push_back(l);
      }
    }
    std::vector<double> loads, policy_restarts, replay_rates;
    for (const auto& [name, r] : p.faulty) {
      for (const auto& rec : r.recoveries) {
        const auto split = split_recovery(rec);
        restarts.push_back(split.restart_s);
        policy_restarts.push_back(split.restart_s);
        loads.push_back(split.load_s);
        replays.push_back(rec.replay_s);
        if (p.name == "moevement" && rec.replayed > 0)
          replay_rates.push_back(rec.replay_s / double(rec.replayed));
      }
    }
    if (!replay_rates.empty()) prof.replay_iteration_s = median(replay_rates);
    if (!loads.empty()) prof.load_s[p.name] = median(loads);
    if (!policy_restarts.empty()) prof.policy_restart_s[p.name] = median(policy_restarts);
    if (!p.disk_lags.empty()) {
      // Every window seen: the fault-free runs' and the faulty runs'.
      std::vector<double> all = p.disk_lags;
      for (std::size_t fj = 0; fj < p.faulty.size(); ++fj) {
        for (double l : disk_persist_lags(p.faulty[fj].second, p.faulty_disk[fj])) all.push_back(l);
      }
      prof.policy_persist_lag_s[p.name] = median(all);
      prof.persist_lag_samples_s[p.name] = all;
    }
    if (p.name != "moevement" && !p.fault_free.empty()) {
      const double c = checkpoint_stall_s(p.fault_free);
      if (c >= 0) prof.snapshot_s[p.name] = c;
    }
  }
  if (bandwidths.empty()) throw std::runtime_error("no window_chosen with a bandwidth");
  if (restarts.empty()) throw std::runtime_error("no recovery_end in the faulty runs");
  prof.producer = "moevement bench simvalidate";
  prof.iteration_s = mean_of(none_ff);
  prof.stage_microbatch_s = stage_microbatch(o, none);
  prof.snapshot_bytes_per_s_per_gpu = median(bandwidths);
  prof.restart_s = median(restarts);
  {
    std::vector<double> gaps;
    for (const auto& r : none) {
      for (double g : dispatch_gaps(r)) gaps.push_back(g);
    }
    if (!gaps.empty()) prof.dispatch_s = std::max(0.0, mean(gaps));
  }
  if (!lags.empty()) {
    prof.persist_lag_s = median(lags);
    prof.persist_lag_samples_s["moevement"] = lags;
  }
  return {std::move(prof), std::move(restarts), std::move(replays), std::move(lags)};
}

void print_profile(const measured_profile& m) {
  const sim::profile_data& prof = m.prof;
  std::string per_policy;
  for (const auto& [name, v] : prof.policy_restart_s)
    per_policy += fmt::format(" restart {} {:.5f}", name, v);
  for (const auto& [name, v] : prof.load_s) per_policy += fmt::format(" load {} {:.5f}", name, v);
  for (const auto& [name, v] : prof.snapshot_s)
    per_policy += fmt::format(" snapshot {} {:.5f}", name, v);
  for (const auto& [name, v] : prof.persist_lag_samples_s) {
    if (name == "moevement" || v.empty()) continue;
    per_policy += fmt::format(
        " persist lag {} {:.5f} (median of {} windows of its fault-free and faulty runs, 90th "
        "percentile {:.5f}, max {:.5f})",
        name, median(v), v.size(),
        [&] {
          auto s = v;
          std::sort(s.begin(), s.end());
          return s[std::size_t(0.9 * double(s.size() - 1))];
        }(),
        *std::max_element(v.begin(), v.end()));
  }
  std::printf(
      "# profile: iteration_s %.6f (policy none), stage_microbatch_s %.6f, snapshot "
      "bandwidth %.3f GB/s per process, restart_s %.5f (median of %zu recoveries, replay "
      "%.5f s left out), persist_lag_s %.5f (median of %zu windows of moevement's fault-free "
      "runs), dispatch_s %.6f (policy none, between iterations), replay_iteration_s %.6f "
      "(moevement's replay per replayed iteration, median of its recoveries);%s\n",
      prof.iteration_s, prof.stage_microbatch_s.front(), prof.snapshot_bytes_per_s_per_gpu / 1e9,
      prof.restart_s, m.restarts.size(), mean(m.replays), prof.persist_lag_s, m.lags.size(),
      prof.dispatch_s, prof.replay_iteration_s, per_policy.c_str());
  std::printf(
      "# not measured (absent from the profile): sync_s and update_s (the run log has "
      "no per-phase times), moevement's snapshot_s (its slots overlap the next iteration)\n");
}

void write_profile(const options& o, const sim::profile_data& prof) {
  if (!o.profile_out.empty()) {
    const std::string text = profile_toml(prof);
    (void)sim::parse_profile(text);  // the simulator must read what we write
    std::ofstream out(o.profile_out);
    out << text;
    if (!out) throw std::runtime_error("cannot write " + o.profile_out);
    std::printf("# profile written to %s\n", o.profile_out.c_str());
  }
}

job_shape make_shape(const options& o) {
  const int replicas = 2;  // checkpoint.replicas default (engine/job_config.hpp)
  job_shape shape;
  shape.model = models::preset(o.preset);
  shape.seq_len = o.seq_len;
  shape.micro_batches = o.micro_batches;
  shape.micro_batch_size = o.micro_batch_size;
  shape.pp = o.pp;
  shape.dp = o.dp;
  shape.replicas = replicas;
  return shape;
}

// What every prediction shares: the options, every policy's runs, the measured profile, the
// job's shape, the failure settings and policy none's fault-free times.
struct sim_context {
  const options& o;
  const std::vector<policy_runs>& pols;
  const sim::profile_data& prof;
  const job_shape& shape;
  const sim::failure_settings& fs_settings;
  const std::map<long, double>& none_ff;

  // The simulator's policy for one reference speed (iteration time and stage times), at the
  // baselines' interval in run `r` (the one the engine logged: checkpoint.interval or Young's)
  // and moevement's W_sparse in it (the window tuner's at its first failure, w_at_failure: a
  // failure replays from windows of that W, not of Algorithm 1's).
  sim::policy_model sim_policy_at(const std::string& name, double iteration_s, double stage_s,
                                  const run_result& r) const {
    sim::profile_data p = prof;
    p.iteration_s = iteration_s;
    p.stage_microbatch_s.assign(std::size_t(o.pp), stage_s);
    if (name != "moevement" && o.interval > 0 && r.interval != o.interval) {
      throw std::runtime_error(
          fmt::format("{}: the engine logged interval {}, not {}", name, r.interval, o.interval));
    }
    return sim_policy(shape, p, name, r.interval, fs_settings, w_at_failure(r));
  }
};

// Per SPEC: measured and predicted of each repeat.
struct spec_values {
  std::vector<double> measured, predicted, predicted_mean_recovery, predicted_single_lag;
};

// One available policy's runs against the simulator. Three useful-time references, each with its
// simulator run (T = the mean useful time per iteration, stage times from the same runs): `own`
// (the run itself, the primary: the simulator's definition without run-to-run speed noise),
// `ffref` (the policy's fault-free runs, per index: bench policies' definition), `vs_none` (policy
// none's fault-free runs: the checkpoint overhead counts too).
struct policy_check : sim_context {
  const policy_runs& p;
  std::map<long, double> ff_ref;
  const run_result& ff0;
  sim::policy_model m_ffref, m_none;

  policy_check(const sim_context& ctx, const policy_runs& runs)
      : sim_context(ctx),
        p(runs),
        ff_ref(per_index(p.fault_free)),
        ff0(p.fault_free.front()),
        m_ffref(
            sim_policy_at(p.name, mean_of(ff_ref), stage_microbatch(o, p.fault_free).front(), ff0)),
        m_none(sim_policy_at(p.name, prof.iteration_s, prof.stage_microbatch_s.front(), ff0)) {
    m_ffref.dispatch_s = m_none.dispatch_s = dispatch_for(run_result{});
  }

  // The coordinator's dispatch between iterations (dispatch_gaps), held out: the mean over
  // the policy's fault-free runs other than `r` (all of them for a faulty run).
  double dispatch_for(const run_result& r) const {
    std::vector<double> gaps;
    for (const auto& q : p.fault_free) {
      if (&q == &r && p.fault_free.size() > 1) continue;
      for (double g : dispatch_gaps(q)) gaps.push_back(g);
    }
    return gaps.empty() ? 0.0 : std::max(0.0, mean(gaps));
  }

  // At the run's own iteration times, which contain its checkpoint stalls already.
  sim::policy_model m_self(const run_result& r) const {
    auto m = without_stall(
        sim_policy_at(p.name, mean_of(own_times(r)), stage_microbatch_s({r}, o.micro_batches), r));
    m.dispatch_s = dispatch_for(r);
    return m;
  }

  void compare_fault_free() const;
  void compare_faulty() const;
};

void policy_check::compare_fault_free() const {
  std::printf(
      "# %s: fault-free iteration %.6f s (none %.6f s), simulator W_sparse %d (engine %d), "
      "interval %d (engine %d), predicted stall %.6f s, snapshot %.6f s, persist lag %.6f "
      "s, load %.6f s, catch-up %.6f s/iteration, dispatch %.6f s/iteration\n",
      p.name.c_str(), mean_of(ff_ref), prof.iteration_s, m_ffref.w_sparse, ff0.w_sparse,
      m_ffref.interval, ff0.interval, m_ffref.stall_s, m_ffref.snapshot_s, m_ffref.persist_lag_s,
      m_ffref.load_s, m_ffref.catch_up_s.empty() ? 0.0 : m_ffref.catch_up_s.front(),
      m_ffref.dispatch_s);
  std::vector<double> own_m, own_p, ref_m, none_m;
  for (const auto& r : p.fault_free) {
    own_m.push_back(ettr_training_window(r, own_times(r)));
    own_p.push_back(predict_fixed_work(m_self(r), o.iterations, fs_settings, {}).ettr);
    ref_m.push_back(ettr_training_window(r, ff_ref));
    none_m.push_back(ettr_training_window(r, none_ff));
  }
  std::printf("# %s fault-free: medians over %zu runs\n", p.name.c_str(), own_m.size());
  print_compare(fmt::format("ettr_{}_faultfree", p.name), median(own_m), median(own_p));
  print_compare(fmt::format("ettr_{}_faultfree_ffref", p.name), median(ref_m),
                predict_fixed_work(m_ffref, o.iterations, fs_settings, {}).ettr);
  print_compare(fmt::format("ettr_{}_faultfree_vs_none", p.name), median(none_m),
                predict_fixed_work(m_none, o.iterations, fs_settings, {}).ettr);
}

// The restart and load a faulty run is predicted with, held out from it (faulty_run_check), and
// moevement's replay speed: the profile's, scaled by `replay_scale` to the other runs' median.
struct held_out_recovery {
  double restart = 0, load = 0, restart_mean = 0, load_mean = 0;
  std::vector<double> stage_restart, stage_restart_mean;  // per failed stage, -1: none
  double replay_scale = 1.0;

  sim::policy_model held_out(sim::policy_model m) const {
    m.restart_s = restart;
    m.stage_restart_s = stage_restart;
    m.load_s = load;
    for (auto& stage : m.conversion_s) {
      for (double& s : stage) s *= replay_scale;
    }
    for (double& s : m.catch_up_s) s *= replay_scale;
    return m;
  }
};

// One faulty run of a policy against the simulator: the restart, load and persist lags held out
// from it, the simulator's predictions with them, and the run's lines.
struct faulty_run_check {
  const policy_check& c;
  const options& o;
  const policy_runs& p;
  std::size_t fi;
  const std::string& name;
  const run_result& r;
  std::vector<sim::failure_event> trace;
  std::string times;
  double measured_recovery = 0, slowest = 0;
  std::map<long, double> own;
  held_out_recovery h;
  sim::policy_model m_run, m_ref, m_nonec;
  std::vector<failure_point> points;
  prediction pr, pr_times, pr_mean;
  double measured = 0;

  faulty_run_check(const policy_check& check, std::size_t index);
  held_out_recovery held_out_for() const;
  std::string rollbacks_text() const;
  sim::policy_model with_lags(sim::policy_model m) const;
  void print_recovery() const;
  void print_lost_time_split() const;
  void print_compares(std::map<std::string, spec_values>& by_spec) const;
};

faulty_run_check::faulty_run_check(const policy_check& check, std::size_t index)
    : c(check),
      o(check.o),
      p(check.p),
      fi(index),
      name(p.faulty[fi].first),
      r(p.faulty[fi].second) {
  trace = failure_trace(r);
  for (const auto& e : trace) times += fmt::format(" {:.4f}s@stage{}", e.time_s, e.stage);
  for (const auto& rec : r.recoveries) measured_recovery += rec.seconds;
  for (const auto& it : r.iterations) slowest = std::max(slowest, it.seconds);
  own = own_times(r);
  h = held_out_for();
  m_run = with_lags(h.held_out(c.m_self(r)));
  m_ref = with_lags(h.held_out(c.m_ffref));
  m_nonec = with_lags(h.held_out(c.m_none));
  // The failures at the same iterations and times into them (the primary): the run's pace
  // drifts with the machine's load, so at one mean T the same absolute times would fall
  // into other iterations, and for a rollback on the other side of a checkpoint. At the
  // same times as well (`_at_times`), for comparison.
  points = failure_points(r);
  // Expected over the measured persist lags (predict_over_lags), failures at the points.
  auto at_points = [&](const sim::policy_model& x) {
    return trace_at_points(points, x, c.fs_settings);
  };
  auto at_times = [&](const sim::policy_model&) { return trace; };
  pr = predict_over_lags(m_run, o.iterations, c.fs_settings, at_points);
  pr_times = predict_over_lags(m_run, o.iterations, c.fs_settings, at_times);
  // The same with the held-out MEAN restart and load: ETTR integrates the expected
  // recovery, and on this machine the recovery time has a heavy tail (mean > median).
  auto m_mean = m_run;
  m_mean.restart_s = h.restart_mean;
  m_mean.stage_restart_s = h.stage_restart_mean;
  m_mean.load_s = h.load_mean;
  pr_mean = predict_over_lags(m_mean, o.iterations, c.fs_settings, at_points);
  measured = ettr_training_window(r, own);
}

held_out_recovery faulty_run_check::held_out_for() const {
  // Restart and load held out: no prediction uses its own run's recovery (this run's
  // when it is the only faulty run): the same policy's other faulty runs. Per policy,
  // restart too: a rollback rewires every stage (restore_s, median 22-30 ms here), a
  // moevement recovery only the replacement (5-8 ms); pooling them under-predicted the
  // baselines' restart (docs/simulator.md). Median (`_median` lines) and mean
  // (`_mean_recovery`, `_mean`): restart has a heavy tail on this machine.
  std::vector<double> other_restarts, other_loads, other_replay_rates;
  for (const auto& [n2, r2] : p.faulty) {
    if (&r2 == &r && p.faulty.size() > 1) continue;
    for (const auto& rec : r2.recoveries) {
      other_restarts.push_back(split_recovery(rec).restart_s);
      other_loads.push_back(split_recovery(rec).load_s);
      if (rec.replayed > 0) other_replay_rates.push_back(rec.replay_s / double(rec.replayed));
    }
  }
  const double replay_scale =
      p.name == "moevement" && c.prof.replay_iteration_s > 0 && !other_replay_rates.empty()
          ? median(other_replay_rates) / c.prof.replay_iteration_s
          : 1.0;
  const double restart = median(other_restarts), load = median(other_loads);
  const double restart_mean = mean(other_restarts), load_mean = mean(other_loads);
  // Per failed stage as well: the replacement of stage 0 or the last stage (embedding,
  // head) took 2-4x as long to restore as a middle stage's (docs/simulator.md). The same
  // recovery machinery pools: the rollback policies together, moevement alone; other runs
  // only; at least 2 recoveries of the stage, else the policy's restart above.
  const bool rollback = p.name != "moevement";
  std::vector<double> stage_restart(std::size_t(o.pp), -1.0),
      stage_restart_mean(std::size_t(o.pp), -1.0);
  for (int st = 0; st < o.pp; ++st) {
    std::vector<double> v;
    for (const auto& q : c.pols) {
      if ((q.name != "moevement") != rollback) continue;
      for (const auto& [n2, r2] : q.faulty) {
        if (&r2 == &r) continue;
        for (const auto& rec : r2.recoveries) {
          if (rec.stage == st) v.push_back(split_recovery(rec).restart_s);
        }
      }
    }
    if (v.size() >= 2) {
      stage_restart[std::size_t(st)] = median(v);
      stage_restart_mean[std::size_t(st)] = mean(v);
    }
  }
  return {restart, load, restart_mean, load_mean, stage_restart, stage_restart_mean, replay_scale};
}

// The engine's rollbacks (failed -> to); dense-disk's also the newest window on disk at each loss.
std::string faulty_run_check::rollbacks_text() const {
  std::string rollbacks;
  for (const auto& rec : r.recoveries) {
    if (rec.rollback_to >= 0) rollbacks += fmt::format(" {}->{}", rec.target, rec.rollback_to);
  }
  if (p.name == "dense-disk") {
    // What was on disk (every store's MANIFEST seen) when each loss was seen.
    const auto& seen = p.faulty_disk[fi];
    rollbacks += "; on disk at each loss:";
    for (const auto& l : r.losses) {
      if (l.stage < 0) continue;
      long newest = 0;
      std::map<long, std::size_t> stores;
      for (const auto& [store, windows] : seen) {
        for (const auto& [id, t] : windows) {
          if (t <= l.t) ++stores[id];
        }
      }
      for (const auto& [id, n] : stores) {
        if (n == seen.size()) newest = std::max(newest, id);
      }
      rollbacks += fmt::format(" {}", newest);
    }
  }
  return rollbacks;
}

// dense-disk's lag distribution, held out: the fault-free runs' windows and those of
// the policy's other faulty runs (their load is closer to this run's than the
// fault-free runs' at the start of the bench).
sim::policy_model faulty_run_check::with_lags(sim::policy_model m) const {
  if (p.name != "dense-disk") return m;
  std::vector<double> lags = p.disk_lags;
  for (std::size_t fj = 0; fj < p.faulty.size(); ++fj) {
    if (fj == fi) continue;
    for (double l : disk_persist_lags(p.faulty[fj].second, p.faulty_disk[fj])) lags.push_back(l);
  }
  if (lags.empty()) return m;
  std::sort(lags.begin(), lags.end());
  m.persist_lag_samples_s = lags;
  m.persist_lag_s = median(lags);
  return m;
}

void faulty_run_check::print_recovery() const {
  std::string per_stage;
  for (double v : h.stage_restart) per_stage += fmt::format(" {:.4f}", v);
  const std::string rollbacks = rollbacks_text();
  std::printf(
      "# %s %s: failures at%s; %zu recoveries, %.4f s detection to resume; the simulator's "
      "recovery %.4f s (restart, load, replay, aborted iterations); time lost measured "
      "%.4f s, predicted %.4f s; slowest iteration %.4f s (mean %.4f s); restart_s %.5f, "
      "per failed stage%s, load_s %.5f (%s)%s%s\n",
      p.name.c_str(), name.c_str(), times.c_str(), r.recoveries.size(), measured_recovery,
      pr.recovery_s, (r.t_last_iteration - r.t_start) * (1 - measured), pr.time_lost_s, slowest,
      mean_of(own), h.restart, per_stage.c_str(), h.load,
      p.faulty.size() > 1 ? "held out: medians of the other faulty runs'" : "this run's: no other",
      r.recoveries.empty() || r.recoveries.front().rollback_to < 0
          ? ""
          : "; engine rolled back (failed -> to):",
      rollbacks.c_str());
}

// Where the measured lost time went, beside what the simulator charges for each part.
void faulty_run_check::print_lost_time_split() const {
  const auto sp = split_lost_time(r);
  const double recoveries = double(r.recoveries.size());
  std::printf(
      "# %s %s lost time split: dispatch %.4f s (model %.4f), aborted iteration + "
      "detection %.4f s, detection to resume %.4f s (held out: %.4f median, %.4f mean), "
      "resume gap %.4f s, lost work %.4f s over %ld iterations (x mean T: %.4f s); sum "
      "%.4f s\n",
      p.name.c_str(), name.c_str(), sp.dispatch_s, m_run.dispatch_s * double(r.iterations.size()),
      sp.aborted_s, sp.recovery_s,
      [&] {
        double x = 0;
        for (const auto& rec : r.recoveries) {
          const bool known =
              rec.stage >= 0 && rec.stage < o.pp && h.stage_restart[std::size_t(rec.stage)] >= 0;
          x += (known ? h.stage_restart[std::size_t(rec.stage)] : h.restart) + h.load;
        }
        return x;
      }(),
      recoveries * (h.restart_mean + h.load_mean), sp.resume_gap_s, sp.lost_work_s,
      sp.lost_iterations, double(sp.lost_iterations) * mean_of(own), sp.total());
}

void faulty_run_check::print_compares(std::map<std::string, spec_values>& by_spec) const {
  auto at_points = [&](const sim::policy_model& x) {
    return trace_at_points(points, x, c.fs_settings);
  };
  print_compare(fmt::format("ettr_{}_{}", p.name, name), measured, pr.ettr);
  print_compare(fmt::format("ettr_{}_{}_mean_recovery", p.name, name), measured, pr_mean.ettr);
  double single_lag = -1;
  if (!m_run.persist_lag_samples_s.empty()) {
    // The single (median) lag instead of the distribution, for comparison.
    auto m_single = m_run;
    m_single.persist_lag_samples_s.clear();
    single_lag =
        predict_fixed_work(m_single, o.iterations, c.fs_settings, at_points(m_single)).ettr;
    print_compare(fmt::format("ettr_{}_{}_single_lag", p.name, name), measured, single_lag);
  }
  auto& spec = by_spec[name.substr(0, name.rfind("_r"))];
  spec.measured.push_back(measured);
  spec.predicted.push_back(pr.ettr);
  spec.predicted_mean_recovery.push_back(pr_mean.ettr);
  if (single_lag >= 0) spec.predicted_single_lag.push_back(single_lag);
  print_compare(fmt::format("ettr_{}_{}_at_times", p.name, name), measured, pr_times.ettr);
  // Other reference speeds, the failures at the same points.
  print_compare(fmt::format("ettr_{}_{}_ffref", p.name, name), ettr_training_window(r, c.ff_ref),
                predict_over_lags(m_ref, o.iterations, c.fs_settings, at_points).ettr);
  print_compare(fmt::format("ettr_{}_{}_vs_none", p.name, name), ettr_training_window(r, c.none_ff),
                predict_over_lags(m_nonec, o.iterations, c.fs_settings, at_points).ettr);
  if (!o.trace_out.empty()) {
    std::ofstream t(o.trace_out + p.name + "_" + name + ".txt");
    t << trace_text(trace);
  }
}

void policy_check::compare_faulty() const {
  // Per SPEC (the run name without its _r<repeat>): measured and predicted of each repeat.
  std::map<std::string, spec_values> by_spec;
  for (std::size_t fi = 0; fi < p.faulty.size(); ++fi) {
    const faulty_run_check run(*this, fi);
    run.print_recovery();
    run.print_lost_time_split();
    run.print_compares(by_spec);
  }
  for (const auto& [spec, v] : by_spec) {
    std::printf("# %s %s: medians over %zu repeats\n", p.name.c_str(), spec.c_str(),
                v.measured.size());
    print_compare(fmt::format("ettr_{}_{}_median", p.name, spec), median(v.measured),
                  median(v.predicted));
    if (!v.predicted_single_lag.empty()) {
      print_compare(fmt::format("ettr_{}_{}_median_single_lag", p.name, spec), median(v.measured),
                    median(v.predicted_single_lag));
    }
    // Means: the measured mean against the predictions with the mean recovery (expected
    // values on both sides).
    print_compare(fmt::format("ettr_{}_{}_mean", p.name, spec), mean(v.measured),
                  mean(v.predicted_mean_recovery));
  }
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse_options(argc, argv);
    const auto bin = moevement_binary();
    const fs::path log = bench_log("simvalidate");
    // dense-disk's checkpoints: a fresh directory for every run (launch_one).
    const fs::path disk_dir =
        fs::temp_directory_path() / ("bench_simvalidate_ckpt_" + std::to_string(::getpid()));
    job_runner jobs{o, bin, log, disk_dir, 0};
    std::printf(
        "# config %s preset=%s pp=%d dp=%d spares=%d iterations=%d repeats=%d, baselines at "
        "checkpoint.interval=%d; load: %s\n",
        o.config.c_str(), o.preset.c_str(), o.pp, o.dp, o.spares, o.iterations, o.repeats,
        o.interval, loadavg().c_str());
    bench_runs runs = jobs.run_fault_free();
    jobs.run_faulty(runs.pols);
    std::printf("# load after the runs: %s\n", loadavg().c_str());

    // The profile, in the simulator's sense: T_iter and stage times of training without
    // checkpoints (policy none), the snapshot bandwidth moevement's Algorithm 1 measured, and
    // detection -> replacement ready of every measured recovery (recovery_end's seconds less
    // its replay, which the simulator computes itself from the stage times).
    const auto none_ff = per_index(runs.none);
    const measured_profile measurement = measure_profile(o, runs.none, runs.pols, none_ff);
    const sim::profile_data& prof = measurement.prof;
    print_profile(measurement);
    write_profile(o, prof);

    const job_shape shape = make_shape(o);
    sim::failure_settings fs_settings;
    fs_settings.restart_s = prof.restart_s;
    const sim_context ctx{o, runs.pols, prof, shape, fs_settings, none_ff};
    for (const auto& p : runs.pols) {
      if (!p.available) {
        std::printf("ettr_%s: not available under launch (%s)\n", p.name.c_str(), p.why.c_str());
        continue;
      }
      const policy_check check(ctx, p);
      check.compare_fault_free();
      check.compare_faulty();
    }
    std::printf(
        "ettr_none_faultfree: measured=%.4f (reference; the simulator has no policy none)\n", [&] {
          std::vector<double> v;
          for (const auto& r : runs.none) v.push_back(ettr_training_window(r, none_ff));
          return median(v);
        }());
    std::printf("# load at the end: %s\n", loadavg().c_str());
    fs::remove(log);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench simvalidate: %s\n", e.what());
    return 1;
  }
  return 0;
}
