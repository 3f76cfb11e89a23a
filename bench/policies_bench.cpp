// `moevement bench policies [options]`: what policy `moevement` costs a fault-free run under
// `moevement launch` (real worker processes), against policy `none` on the same job, and
// then what one failure costs it (the recovery part, also `moevement bench recovery`, which
// runs only that part and the fault-free `moevement` runs it needs as reference).
//
// Options: --config FILE (default examples/configs/pipeline_tiny.toml), --set KEY=VALUE
// (repeatable, passed to every run), --repeats N (default 3), --iterations N (default 40),
// --pp N (default 3: the recovery kills the middle stage), --dp N (default 1; `bench
// recovery --dp 1,2,4` runs the same kill at each dp, see compare_dp),
// --spares N (default 1, every run, so both policies run on the same processes),
// --w-sparse N (default 0: Algorithm 1 chooses); every run gets
// cluster.failure_timeout_ms=10000 (see below), --kill-iter T (default 2/3 of the run),
// --kill-stage S (default pp/2), --no-recovery, --profile-out FILE (the simulator's profile,
// format 1: bench/sim_validation.hpp policies_profile, docs/simulator.md "Profile file"),
// --durable (the moevement runs with checkpoint.durable = true in a temporary checkpoint.dir,
// where they otherwise run with it false, the in-memory tier alone:
// what writing persisted windows to disk in the background costs: also runs moevement without
// it, interleaved, and prints durable_iteration_time ours=durable theirs=without,
// durable_windows, bytes, seconds), --matrix (the fault-free part, without the recovery, for
// each of: the demo config (the small preset) at pp 2 dp 1, pp 3 dp 1 and pp 2 dp 2, and
// pipeline_tiny at pp 3; then a `matrix` line each: W_sparse, overhead_vs_none, the iteration
// times, the captures' share of the host's cores and the predicted ETTR at the default MTBF
// and failure timeout, sim::window_ettr), --load N (N busy processes beside the
// job for the whole benchmark: a shared host), --verify (the silent-corruption checks' cost
// and detection latency instead: bench/verify.hpp; dp at least 2).
//
// Fault-free part: `none` and `moevement` interleaved (none, moevement, none, ...), N each.
// Counted iterations: those past the warm-up (bench/run_log_stats.hpp counted_from: the first two
// windows, and a window after the last change of W), the same indices for both policies.
//   iteration_time: ours = moevement's median counted iteration_s (pooled over repeats),
//                   theirs = none's; ratio = theirs / ours (1 = no overhead)
//   plus W_sparse, snapshot bytes per iteration (mean over counted iterations), mean stall,
//   the captures' CPU time per iteration (capture_cpu_s, mean; and its share of the host's
//   core time in a median iteration), the same for the actor threads' replication
//   (replication_cpu_s), and the peak of snapshot_host_bytes + log_host_bytes over all
//   iterations.
// Recovery part: the same job under moevement with --inject kill:stage=S,replica=0,iter=T.
//   recovery_s (recovery_end's seconds), iterations_replayed (target_iteration -
//   replay_from), state_hash_equal (the job's final hash against the fault-free moevement
//   run's: bit-exact recovery), and
//   ETTR = sum over the iterations the faulty run committed (each iteration index of its
//          iteration records, once) of that iteration's fault-free time (median of its
//          iteration_s over the fault-free moevement runs), divided by the wall time from
//          the job_start record to the job_end record. The run log has no timestamps, so the
//          bench polls the log every 2 ms and stamps each line as it appears.
//   ettr: ours = the faulty run's ETTR, theirs = the fault-free moevement runs' (median) by
//         the same definition (what the engine loses between iterations without failures);
//         ratio = ours / theirs.
// `moevement bench recovery` (this program as bench_recovery) instead compares recoveries:
// the same config and the same --inject kill under moevement, dense-memory, dense-disk and
// pec, one run each, all under `moevement launch`, after --repeats fault-free runs of policy
// `none` (the useful time of each iteration, for every policy's ETTR, and the fault-free
// state_hash). The baselines run at their Young-optimal interval (checkpoint.interval = 0)
// with checkpoint.mtbf_s = the fault-free run's wall time (one failure per run, as injected;
// --mtbf S overrides). Per baseline, ours = moevement:
//   recovery_total_s (the loss seen in the run log to the failed iteration committed again,
//   less its fault-free time: detection, restore and, for a rollback, recomputing the
//   iterations it went back over; ratio theirs/ours), recovery_s (recovery_end's seconds:
//   moevement's includes its replay, a rollback's ends when the recomputation starts),
//   iterations_recomputed (moevement: replayed by the rebuilt stage only; a rollback: by
//   every stage; ratio theirs/ours), ettr (ratio ours/theirs), plt and run_plt (pec only;
//   moevement loses no token: ratio inf), and in a comment line per policy its rollback
//   point and whether its final state_hash equals the fault-free one.
// `moevement bench recovery --kill-iters T1,T2,...`: a trace of kills instead, the same for
// every policy (stage S replica 0 at each listed iteration: the worker holding it then, the
// previous kill's replacement; --spares is raised to the number of kills), in --repeats
// rounds: `none`, then each policy, each policy's ETTR against that round's `none` run (the
// host's load drifts over the minutes a round takes). Default MTBF for the baselines' Young
// interval: the round's fault-free wall time / the number of kills. Per policy, medians over
// the rounds: ettr (ratio ours/theirs) and time_lost_s = wall x (1 - ettr), the wall time
// beyond the useful time (ratio theirs/ours; n/a when ours is not above 0, a run faster than
// its round's `none`); a comment line per run with its recoveries and state_hash.
// `moevement bench recovery --joint K`: stages S..S+K-1 (replica 0) killed together at
// iteration T, one joint region, under moevement with checkpoint.pipelined_replay = true
// (ours: each member replays its own stage, the tensors between them passing live) and false
// (theirs: each member replays every region stage of its replica, the path before),
// interleaved, --repeats each, after a fault-free `none` run (its hash): replay_s (the
// slowest member's, ratio theirs/ours), recovery_s and whether both hashes equal `none`'s.
// --spares is raised to K.
// `moevement bench recovery --spread`: one kill (--kill-stage, replica 0, --kill-iter) at
// dp > 1, the group replaying spread over its workers (checkpoint.spread_replay = true, ours)
// and whole in each replacement (false, theirs), interleaved, --repeats each, after a `none`
// run; the same figures as --joint. With --set parallel.ep=E under expert parallelism.
// Run from the source root.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/busy_load.hpp"
#include "bench/launch_job.hpp"
#include "bench/policies_options.hpp"
#include "bench/run_log_stats.hpp"
#include "bench/sim_validation.hpp"
#include "bench/verify.hpp"
#include "engine/job_config.hpp"
#include "sim/config.hpp"
#include "sim/ettr.hpp"

namespace {

namespace fs = std::filesystem;
using namespace moevement;
using namespace moevement::bench;

using policies::options;
using policies::parse_options;

// The fault-free runs of policy `none` every comparison of recoveries starts from: each
// iteration's useful time, the final state_hash, the median wall time.
struct reference {
  std::vector<run_result> runs;
  std::map<long, double> fault_free;
  double wall = 0;
};
template <class Run>
reference run_reference(const options& o, Run& run) {
  reference ref;
  for (int r = 0; r < o.repeats; ++r) ref.runs.push_back(run("none", {}, {}));
  ref.fault_free = per_index(ref.runs);
  std::vector<double> walls;
  for (const auto& r : ref.runs) walls.push_back(r.t_end - r.t_start);
  ref.wall = median(walls);
  return ref;
}

// One faulty run of `policy`: the baselines at Young's k for `mtbf`, dense-disk into a fresh
// temporary checkpoint directory (removed after).
template <class Run>
run_result run_policy(Run& run, const std::string& policy, const std::vector<std::string>& injects,
                      double mtbf) {
  std::vector<std::string> extra;
  fs::path dir;
  if (policy != "moevement") extra.push_back(fmt::format("checkpoint.mtbf_s={:.6f}", mtbf));
  if (policy == "dense-disk") {
    dir = fs::temp_directory_path() / ("bench_recovery_ckpt_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    extra.push_back("checkpoint.dir=" + dir.string());
  }
  run_result r = run(policy, injects, extra);
  if (!dir.empty()) fs::remove_all(dir);
  return r;
}

// `moevement bench recovery --kill-iters ...`: the same trace of kills under each policy, in
// --repeats rounds (see the header).
template <class Run>
void compare_trace(const options& o, Run run) {
  std::vector<std::string> injects;
  std::string trace;
  for (int t : o.kill_iters) {
    injects.push_back(fmt::format("kill:stage={},replica=0,iter={}", o.kill_stage, t));
    trace += fmt::format("{}{}", trace.empty() ? "" : ",", t);
  }
  const std::vector<std::string> policies{"moevement", "dense-memory", "dense-disk", "pec"};
  struct one {
    double ettr = 0, lost_s = 0;
  };
  std::map<std::string, std::vector<one>> rounds;  // by policy, one per round
  for (int round = 0; round < o.repeats; ++round) {
    // This round's fault-free run: each policy's useful time comes from the run next to it,
    // not from one taken many minutes earlier (the host's load drifts meanwhile).
    const run_result none = run("none", {}, {});
    const auto fault_free = per_index({none});
    const double wall = none.t_end - none.t_start;
    const double mtbf = o.mtbf > 0 ? o.mtbf : wall / double(o.kill_iters.size());
    std::printf(
        "# round %d: trace kill stage %d replica 0 at iterations %s; fault-free (none) wall "
        "%.3f s; baselines at Young's k with checkpoint.mtbf_s=%.3f\n",
        round + 1, o.kill_stage, trace.c_str(), wall, mtbf);
    for (const auto& policy : policies) {
      const run_result r = run_policy(run, policy, injects, mtbf);
      one x;
      x.ettr = ettr(r, fault_free);
      x.lost_s = (r.t_end - r.t_start) * (1.0 - x.ettr);  // wall time beyond the useful time
      if (r.recoveries.size() != o.kill_iters.size()) {
        throw std::runtime_error(fmt::format("{}: {} kills led to {} recovery_end records", policy,
                                             o.kill_iters.size(), r.recoveries.size()));
      }
      double recovery_s = 0;
      long replayed = 0;
      for (const auto& rec : r.recoveries) {
        recovery_s += rec.seconds;
        replayed += rec.replayed;
      }
      const bool same = !r.state_hash.empty() && r.state_hash == none.state_hash;
      std::printf(
          "# %s: ettr %.4f, wall %.3f s, time lost %.3f s, %zu recoveries (recovery_end "
          "seconds %.3f in all, %ld iterations replayed), %s, state_hash_equal %s%s\n",
          policy.c_str(), x.ettr, r.t_end - r.t_start, x.lost_s, r.recoveries.size(), recovery_s,
          replayed,
          policy == "moevement" ? fmt::format("W_sparse {}", r.w_sparse).c_str()
                                : fmt::format("interval {}", r.interval).c_str(),
          same ? "yes" : "NO", policy == "pec" && !same ? " (by design: stale experts)" : "");
      rounds[policy].push_back(x);
    }
  }
  // Each policy's median over the rounds.
  auto med = [&](const std::string& policy, double one::*field) {
    std::vector<double> v;
    for (const auto& x : rounds[policy]) v.push_back(x.*field);
    return median(v);
  };
  const double ours_ettr = med("moevement", &one::ettr), ours_lost = med("moevement", &one::lost_s);
  std::printf("# medians over %d rounds\n", o.repeats);
  for (std::size_t i = 1; i < policies.size(); ++i) {
    const double e = med(policies[i], &one::ettr), l = med(policies[i], &one::lost_s);
    std::printf("## vs %s\n", policies[i].c_str());
    std::printf("ettr: ours=%.4f theirs=%.4f ratio=%.4f\n", ours_ettr, e, ours_ettr / e);
    if (ours_lost > 0) {
      std::printf("time_lost_s: ours=%.3f theirs=%.3f ratio=%.2f\n", ours_lost, l, l / ours_lost);
    } else {  // faster than its round's `none` run: the host's noise is larger than the loss
      std::printf("time_lost_s: ours=%.3f theirs=%.3f ratio=n/a (ours within the noise)\n",
                  ours_lost, l);
    }
  }
}

// `moevement bench recovery`: one failure under each policy (see the header).
template <class Run>
void compare_recoveries(const options& o, Run run) {
  const reference ref = run_reference(o, run);
  const auto& fault_free = ref.fault_free;
  const double mtbf = o.mtbf > 0 ? o.mtbf : ref.wall;
  const std::string inject =
      fmt::format("kill:stage={},replica=0,iter={}", o.kill_stage, o.kill_iter);
  std::printf(
      "# recovery: %s; fault-free (none) wall %.3f s, ettr %.4f; baselines at Young's "
      "k with checkpoint.mtbf_s=%.3f\n",
      inject.c_str(), ref.wall, ettr(ref.runs.front(), fault_free), mtbf);
  struct one {
    std::string policy;
    run_result r;
    double ettr = 0, total_s = -1;
    long recomputed = 0;
  };
  // Total recovery time: from the loss seen in the run log to the failed iteration committed
  // again, less that iteration's fault-free time (detection, restore, and for a rollback the
  // recomputation of the iterations it went back over).
  auto total_recovery = [&](const run_result& r) {
    for (const auto& it : r.iterations) {
      if (it.iteration == r.target && it.t > r.t_lost) {
        const auto f = fault_free.find(r.target);
        return it.t - r.t_lost - (f == fault_free.end() ? 0.0 : f->second);
      }
    }
    return -1.0;
  };
  std::vector<one> all;
  for (const std::string policy : {"moevement", "dense-memory", "dense-disk", "pec"}) {
    one x{policy, run_policy(run, policy, {inject}, mtbf)};
    if (!x.r.recovered)
      throw std::runtime_error(policy + ": the injected kill led to no recovery_end");
    x.ettr = ettr(x.r, fault_free);
    x.total_s = total_recovery(x.r);
    x.recomputed = x.r.rollback_to >= 0 ? x.r.recomputed : x.r.target - x.r.replay_from;
    const bool same = !x.r.state_hash.empty() && x.r.state_hash == ref.runs.front().state_hash;
    std::printf(
        "# %s: total recovery %.4f s (recovery_end seconds %.4f), recomputed %ld (from %ld to "
        "%ld), ettr %.4f, state_hash_equal %s%s\n",
        policy.c_str(), x.total_s, x.r.recovery_s, x.recomputed,
        x.r.rollback_to >= 0 ? x.r.rollback_to : x.r.replay_from, x.r.target, x.ettr,
        same ? "yes" : "NO",
        policy == "pec" && !same ? " (by design: stale experts)"
        : policy == "pec"        ? " (no expert was restored stale)"
                                 : "");
    all.push_back(std::move(x));
  }
  const one& ours = all.front();
  for (std::size_t i = 1; i < all.size(); ++i) {
    const one& t = all[i];
    std::printf("## vs %s\n", t.policy.c_str());
    std::printf("recovery_total_s: ours=%.4f theirs=%.4f ratio=%.2f\n", ours.total_s, t.total_s,
                t.total_s / ours.total_s);
    std::printf("recovery_s: ours=%.4f theirs=%.4f ratio=%.2f\n", ours.r.recovery_s, t.r.recovery_s,
                t.r.recovery_s / ours.r.recovery_s);
    std::printf("iterations_recomputed: ours=%ld theirs=%ld ratio=%.2f\n", ours.recomputed,
                t.recomputed,
                ours.recomputed > 0 ? double(t.recomputed) / double(ours.recomputed) : 0.0);
    std::printf("ettr: ours=%.4f theirs=%.4f ratio=%.4f\n", ours.ettr, t.ettr, ours.ettr / t.ettr);
    if (t.r.plt >= 0) {
      std::printf("plt: ours=0 theirs=%.6f ratio=inf\n", t.r.plt);
      std::printf("run_plt: ours=0 theirs=%.6f ratio=inf\n", t.r.run_plt);
    }
  }
}

// `moevement bench recovery --dp 1,2,4`: the same kill (stage S, replica 0, iteration T)
// under moevement at each dp, --repeats runs each, beside a fault-free `none` run at that dp
// (its hash): how a recovery's pull and replay grow with the stage's data-parallel group.
// Ratios are against the first dp listed.
template <class Run>
void compare_dp(const options& o, Run run) {
  const std::string inject =
      fmt::format("kill:stage={},replica=0,iter={}", o.kill_stage, o.kill_iter);
  std::printf("# recovery: %s under moevement, per dp (medians of %d runs)\n", inject.c_str(),
              o.repeats);
  double base_replay = 0, base_total = 0;
  for (const int dp : o.dps) {
    const std::string set_dp = fmt::format("parallel.dp={}", dp);
    const run_result none = run("none", {}, {set_dp});
    std::vector<double> replay, pull, total;
    long replayed = -1;
    bool same = true;
    for (int r = 0; r < o.repeats; ++r) {
      const run_result f = run("moevement", {inject}, {set_dp});
      if (f.recoveries.empty()) throw std::runtime_error("the injected kill led to no recovery");
      const recovery_rec& rec = f.recoveries.front();
      replay.push_back(rec.replay_s);
      pull.push_back(rec.pull_s);
      total.push_back(rec.seconds);
      replayed = rec.replayed;
      same = same && !f.state_hash.empty() && f.state_hash == none.state_hash;
    }
    const double m = median(replay), t = median(total);
    if (base_replay == 0) {
      base_replay = m;
      base_total = t;
    }
    std::printf("dp=%d replay_s: %.4f (min %.4f max %.4f) ratio_vs_dp%d=%.2f\n", dp, m,
                *std::min_element(replay.begin(), replay.end()),
                *std::max_element(replay.begin(), replay.end()), o.dps.front(), m / base_replay);
    std::printf(
        "dp=%d recovery_s: %.4f ratio_vs_dp%d=%.2f pull_s: %.4f iterations_replayed: %ld "
        "state_hash_equal: %s\n",
        dp, t, o.dps.front(), t / base_total, median(pull), replayed, same ? "yes" : "NO");
  }
}

// `moevement bench recovery --joint K` and `--spread`: the same kills recovered with a
// boolean key true (ours) and false (theirs), interleaved (see the header).
template <class Run>
void compare_key(const options& o, Run run, const std::vector<std::string>& injects,
                 const std::string& key) {
  const run_result none = run("none", {}, {});
  struct side {
    std::vector<double> replay, total;
    long replayed = -1;
    bool same = true;
  } ours, theirs;
  for (int r = 0; r < o.repeats; ++r) {
    for (const bool on : {true, false}) {
      side& x = on ? ours : theirs;
      const run_result f = run("moevement", injects, {fmt::format("{}={}", key, on)});
      if (f.recoveries.empty()) throw std::runtime_error("the injected kills led to no recovery");
      const recovery_rec& rec = f.recoveries.back();
      x.replay.push_back(rec.replay_s);
      x.total.push_back(rec.seconds);
      x.replayed = rec.replayed;
      x.same = x.same && !f.state_hash.empty() && f.state_hash == none.state_hash;
    }
  }
  const double mo = median(ours.replay), mt = median(theirs.replay);
  std::printf("# iterations replayed: ours %ld theirs %ld\n", ours.replayed, theirs.replayed);
  std::printf("replay_s: ours=%.4f theirs=%.4f ratio=%.2f\n", mo, mt, mt / mo);
  std::printf("recovery_s: ours=%.4f theirs=%.4f ratio=%.2f\n", median(ours.total),
              median(theirs.total), median(theirs.total) / median(ours.total));
  std::printf("state_hash_equal: ours=%s theirs=%s\n", ours.same ? "yes" : "NO",
              theirs.same ? "yes" : "NO");
}

template <class Run>
void compare_joint(const options& o, Run run) {
  std::vector<std::string> injects;
  for (int s = o.kill_stage; s < o.kill_stage + o.joint; ++s) {
    injects.push_back(fmt::format("kill:stage={},replica=0,iter={}", s, o.kill_iter));
  }
  std::printf(
      "# recovery: stages %d..%d killed at iteration %d under moevement, the region "
      "replayed as a pipeline (ours) and whole by each member (theirs), %d runs each\n",
      o.kill_stage, o.kill_stage + o.joint - 1, o.kill_iter, o.repeats);
  compare_key(o, run, injects, "checkpoint.pipelined_replay");
}

template <class Run>
void compare_spread(const options& o, Run run) {
  std::printf(
      "# recovery: stage %d replica 0 killed at iteration %d under moevement at dp %d, the "
      "group replayed spread over its workers (ours) and whole by the replacement (theirs), %d "
      "runs each\n",
      o.kill_stage, o.kill_iter, o.dp, o.repeats);
  compare_key(o, run, {fmt::format("kill:stage={},replica=0,iter={}", o.kill_stage, o.kill_iter)},
              "checkpoint.spread_replay");
}

// The fault-free part's figures, for --matrix.
struct policies_summary {
  int w_sparse = 0, w_first = 0;  // the W the runs ended with (the largest), Algorithm 1's
  double overhead_pct = 0, capture_share_pct = 0, none_s = 0, moevement_s = 0;
};

// The fault-free runs: policy none's, moevement's and (--durable) moevement's without the durable
// tier (`plain`).
struct fault_free_runs {
  std::vector<run_result> none, moe, plain;
};

// One run of the benchmark's jobs as `o` says: their arguments, the fault-free runs, the durable
// tier's and the recovery part's figures, and the profile.
struct policies_bench {
  const options& o;
  const std::string& bin;
  const fs::path& log;

  std::vector<std::string> args(const std::string& policy, const std::vector<std::string>& injects,
                                const std::vector<std::string>& extra = {}) const {
    std::vector<std::string> sets{"checkpoint.policy=" + policy};
    if (policy == "moevement") {
      sets.push_back(fmt::format("checkpoint.w_sparse={}", o.w_sparse));
      // The in-memory tier alone unless --durable (its own comparison): what the design's
      // overhead and recovery figures are of. The job's default also writes to disk.
      sets.push_back(fmt::format("checkpoint.durable={}", o.durable));
      if (o.durable) {
        sets.push_back("checkpoint.dir=" + fs::path(log).replace_extension(".ckpt").string());
      }
    }
    sets.insert(sets.end(), extra.begin(), extra.end());
    sets.insert(sets.end(), o.sets.begin(), o.sets.end());
    return launch_args({o.config, o.iterations, o.pp, o.dp, o.spares}, sets, log, injects);
  }

  void print_config() const {
    std::string dp = std::to_string(o.dp);  // each of --dp's list where it has several
    for (std::size_t i = 1; i < o.dps.size(); ++i) dp += "," + std::to_string(o.dps[i]);
    std::printf("# config %s pp=%d dp=%s spares=%d iterations=%d repeats=%d; load before: %s\n",
                o.config.c_str(), o.pp, dp.c_str(), o.spares, o.iterations, o.repeats,
                loadavg().c_str());
  }

  // bench recovery: the comparison of recoveries the options choose.
  void compare_recoveries_only() const {
    auto run = [&](const std::string& policy, const std::vector<std::string>& inject,
                   const std::vector<std::string>& extra) {
      return parse(launch_or_throw(bin, args(policy, inject, extra), log));
    };
    if (o.joint > 0) {
      compare_joint(o, run);
    } else if (o.spread) {
      compare_spread(o, run);
    } else if (o.dps.size() > 1) {
      compare_dp(o, run);
    } else if (o.kill_iters.empty()) {
      compare_recoveries(o, run);
    } else {
      compare_trace(o, run);
    }
  }

  fault_free_runs run_fault_free() const {
    std::vector<run_result> none, moe, plain;  // plain: moevement without the durable tier
    for (int r = 0; r < o.repeats; ++r) {
      if (o.fault_free_compare) none.push_back(parse(launch_or_throw(bin, args("none", {}), log)));
      moe.push_back(parse(launch_or_throw(bin, args("moevement", {}), log)));
      if (o.durable) {
        plain.push_back(
            parse(launch_or_throw(bin, args("moevement", {}, {"checkpoint.durable=false"}), log)));
      }
    }
    return {std::move(none), std::move(moe), std::move(plain)};
  }

  // --durable: the durable tier's cost, moevement with it against moevement without.
  void report_durable(const std::vector<run_result>& moe, const std::vector<run_result>& plain,
                      long skip, double moe_median) const {
    std::vector<double> dbytes, dsecs;
    for (const auto& r : moe) {
      for (const auto& d : r.durable) {
        dbytes.push_back(d.bytes);
        dsecs.push_back(d.seconds);
      }
    }
    std::vector<double> plain_s;
    for (const auto& r : plain) {
      for (const auto& it : r.iterations) {
        if (it.iteration >= skip) plain_s.push_back(it.seconds);
      }
    }
    // ours: moevement with the durable tier; theirs: without (interleaved runs).
    std::printf("durable_iteration_time: ours=%.5f theirs=%.5f ratio=%.4f\n", moe_median,
                median(plain_s), median(plain_s) / moe_median);
    std::printf("durable_windows_per_run: %.1f\n", double(dbytes.size()) / double(moe.size()));
    if (!dbytes.empty()) {
      std::printf("durable_window_bytes_mean: %.0f\ndurable_window_seconds_median: %.4f\n",
                  mean(dbytes), median(dsecs));
    }
    fs::remove_all(fs::path(log).replace_extension(".ckpt"));
  }

  // The recovery part (unless --no-recovery): one moevement run with the injected kill against
  // the fault-free runs. Returns that run, for the profile.
  std::vector<run_result> run_recovery(const std::vector<run_result>& moe) const {
    const auto fault_free = per_index(moe);
    std::vector<double> ff_ettr;
    for (const auto& r : moe) ff_ettr.push_back(ettr(r, fault_free));
    std::vector<run_result> faulty;  // the recovery part's run (restart and load of the profile)
    if (o.recovery) {
      const std::string inject =
          fmt::format("kill:stage={},replica=0,iter={}", o.kill_stage, o.kill_iter);
      std::printf("# recovery: %s\n", inject.c_str());
      const run_result f = parse(launch_or_throw(bin, args("moevement", {inject}), log));
      if (!f.recovered) throw std::runtime_error("the injected kill led to no recovery_end");
      faulty.push_back(f);
      std::printf("recovery_s: %.4f\n", f.recovery_s);
      std::printf("recovery_window: %ld (replay_from %ld, target %ld)\n", f.window, f.replay_from,
                  f.target);
      std::printf("iterations_replayed: %ld\n", f.target - f.replay_from);
      // Seen in the run log (2 ms polling): worker_lost -> recovery_start -> recovery_end.
      std::printf("seen_lost_to_start_s: %.4f\nseen_start_to_end_s: %.4f\n",
                  f.t_recovery_start - f.t_lost, f.t_recovery_end - f.t_recovery_start);
      std::printf("time_lost_s: %.4f\n", time_lost(f, fault_free));
      const bool same = !f.state_hash.empty() && f.state_hash == moe.front().state_hash;
      std::printf("state_hash_equal: %s (%s vs fault-free %s)\n", same ? "yes" : "NO",
                  f.state_hash.c_str(), moe.front().state_hash.c_str());
      const double ours = ettr(f, fault_free), theirs = median(ff_ettr);
      std::printf("ettr: ours=%.4f theirs=%.4f ratio=%.4f\n", ours, theirs, ours / theirs);
      std::vector<double> walls;
      for (const auto& r : moe) walls.push_back(r.t_end - r.t_start);
      const double wall = f.t_end - f.t_start, wall_ff = median(walls);
      std::printf("wall_s_job: ours=%.3f theirs=%.3f ratio=%.4f\n", wall, wall_ff, wall_ff / wall);
    }
    return faulty;
  }

  void write_profile(const fault_free_runs& runs, const std::vector<run_result>& faulty,
                     long skip) const {
    if (!o.profile_out.empty()) {
      // The simulator's profile (format 1, docs/simulator.md): `moevement simulate` reads it
      // through profile.file.
      const std::string text =
          profile_toml(policies_profile(runs.none, runs.moe, faulty, skip, o.pp));
      (void)sim::parse_profile(text);  // the simulator must read what we write
      std::ofstream p(o.profile_out);
      p << text;
      if (!p) throw std::runtime_error("cannot write " + o.profile_out);
      std::printf("# profile (simulator format 1) written to %s\n", o.profile_out.c_str());
    }
  }
};

// Algorithm 1's W, and the W the head tuned it to (checkpoint.max_overhead).
void print_w_sparse(const std::vector<run_result>& moe, policies_summary& summary) {
  int w = 0, w_first = 0, changes = 0;
  for (const auto& r : moe) {
    w = std::max(w, r.w_sparse);
    w_first = std::max(w_first, r.w_first);
    changes += r.w_changed_at >= 0;
  }
  std::printf("w_sparse: %d (Algorithm 1: %d; runs where it changed: %d)\n", w, w_first, changes);
  summary.w_sparse = w;
  summary.w_first = w_first;
}

// The moevement runs' per-iteration figures: the counted iterations' (from `skip`), and the host
// bytes of every iteration.
struct moevement_samples {
  std::vector<double> moe_s, stall, bytes, host, capture_cpu, replication_cpu, log_s, hooks_s,
      moe_compute, moe_step;

  moevement_samples(const std::vector<run_result>& moe, long skip) {
    for (const auto& r : moe) {
      for (const auto& it : r.iterations) {
        host.push_back(it.host_bytes);
        if (it.iteration < skip) continue;
        moe_s.push_back(it.seconds);
        stall.push_back(it.stall_s);
        bytes.push_back(it.snapshot_bytes);
        capture_cpu.push_back(it.capture_cpu_s);
        replication_cpu.push_back(it.replication_cpu_s);
        log_s.push_back(it.log_s);
        hooks_s.push_back(it.step_hooks_s);
        moe_compute.push_back(it.mean_stage_compute_s);
        moe_step.push_back(it.step_phase_s);
      }
    }
    if (moe_s.empty()) {
      throw std::runtime_error(fmt::format(
          "no iteration after the warm-up windows and the last change of W (counted from {}): "
          "raise --iterations",
          skip));
    }
  }

  // Against policy none's runs, the same iterations counted.
  void compare_with_none(const std::vector<run_result>& none, long skip, double moe_median,
                         policies_summary& summary) const {
    std::vector<double> none_s, none_compute, none_step;
    for (const auto& r : none) {
      for (const auto& it : r.iterations) {
        if (it.iteration < skip) continue;
        none_s.push_back(it.seconds);
        none_compute.push_back(it.mean_stage_compute_s);
        none_step.push_back(it.step_phase_s);
      }
    }
    const double none_median = median(none_s);
    std::printf("iteration_time: ours=%.5f theirs=%.5f ratio=%.4f\n", moe_median, none_median,
                none_median / moe_median);
    std::printf("overhead_vs_none: %.2f%%\n", 100.0 * (moe_median / none_median - 1.0));
    summary.overhead_pct = 100.0 * (moe_median / none_median - 1.0);
    summary.none_s = none_median;
    summary.moevement_s = moe_median;
    // Forward + backward per stage (the boundary logging counts in it), median.
    std::printf("mean_stage_compute_s: ours=%.5f theirs=%.5f\n", median(moe_compute),
                median(none_compute));
    std::printf("step_phase_s: ours=%.5f theirs=%.5f\n", median(moe_step), median(none_step));
  }

  // The checkpoint's costs: snapshot bytes, stall, the hooks, the host's CPU and memory.
  void print_costs(double moe_median, policies_summary& summary) const {
    std::printf("snapshot_bytes_per_iteration: %.0f\n", mean(bytes));
    std::printf("stall_s_mean: %.6f\n", mean(stall));
    // The compute thread's time in the hooks besides the stall (the busiest stage's).
    std::printf("log_s_mean: %.6f\nstep_hooks_s_mean: %.6f\n", mean(log_s), mean(hooks_s));
    // What the captures cost the host's cores, which the wall clock of a shared host hides.
    const double cores = std::max(1u, std::thread::hardware_concurrency());
    std::printf(
        "capture_cpu_s_per_iteration: %.5f (%.2f%% of the host's %.0f cores x the "
        "median iteration)\n",
        mean(capture_cpu), 100.0 * mean(capture_cpu) / (cores * moe_median), cores);
    // The actor threads' offers, maps and answers (the window tuner counts them too).
    std::printf("replication_cpu_s_per_iteration: %.5f (%.2f%% of the cores x the iteration)\n",
                mean(replication_cpu), 100.0 * mean(replication_cpu) / (cores * moe_median));
    summary.capture_share_pct = 100.0 * mean(capture_cpu) / (cores * moe_median);
    std::printf("peak_snapshot_log_host_bytes: %.0f\n",
                *std::max_element(host.begin(), host.end()));
  }
};

// One run of the benchmark as `o` says (see the header).
policies_summary run_bench(const options& o, const std::string& bin, const fs::path& log) {
  policies_summary summary;
  const policies_bench bench{o, bin, log};
  bench.print_config();
  if (!o.fault_free_compare) {
    bench.compare_recoveries_only();
    fs::remove(log);
    return summary;
  }
  const fault_free_runs runs = bench.run_fault_free();
  // Counted: past the warm-up windows and the last change of W, in every moevement run.
  const long skip = counted_from(runs.moe);
  const moevement_samples samples(runs.moe, skip);
  const double moe_median = median(samples.moe_s);
  std::printf("# counted iterations: %ld..%d of each run\n", skip, o.iterations - 1);
  print_w_sparse(runs.moe, summary);
  if (o.fault_free_compare) {
    samples.compare_with_none(runs.none, skip, moe_median, summary);
  } else {
    std::printf("iteration_time_moevement: %.5f\n", moe_median);
  }
  samples.print_costs(moe_median, summary);
  if (o.durable) bench.report_durable(runs.moe, runs.plain, skip, moe_median);

  const std::vector<run_result> faulty = bench.run_recovery(runs.moe);
  std::printf("# load after: %s\n", loadavg().c_str());
  bench.write_profile(runs, faulty, skip);
  fs::remove(log);
  return summary;
}

// --matrix: the fault-free part for each placement of the matrix (see the header), then one
// line each.
void run_matrix(const options& o, const std::string& bin, const fs::path& log) {
  struct placement {
    const char* config;
    int pp, dp;
  };
  const placement matrix[] = {{"examples/configs/demo.toml", 2, 1},
                              {"examples/configs/demo.toml", 3, 1},
                              {"examples/configs/demo.toml", 2, 2},
                              {"examples/configs/pipeline_tiny.toml", 3, 1}};
  std::vector<std::pair<const placement*, policies_summary>> rows;
  std::vector<std::pair<const placement*, std::string>> failed;
  for (const placement& p : matrix) {
    options e = o;
    e.config = p.config;
    e.pp = p.pp;
    e.dp = p.dp;
    e.recovery = false;
    try {  // one placement that cannot be measured (too few iterations) leaves the others
      rows.emplace_back(&p, run_bench(e, bin, log));
    } catch (const std::exception& x) {
      failed.emplace_back(&p, x.what());
    }
  }
  std::printf("# matrix, %d busy processes beside the job; load after: %s\n", o.load,
              loadavg().c_str());
  // The predicted ETTR at the defaults: checkpoint.mtbf_s (one hour), the failure timeout as
  // the detection (sim::window_ettr, what the head's ETTR rule predicts by).
  const engine::job_config defaults;
  for (const auto& [p, s] : rows) {
    const double ettr =
        sim::window_ettr(std::max(0.0, s.overhead_pct / 100), s.w_sparse, s.none_s,
                         double(defaults.failure_timeout_ms) / 1000.0, defaults.baseline.mtbf_s);
    std::printf(
        "matrix %s pp=%d dp=%d: w_sparse=%d (Algorithm 1: %d) overhead_vs_none=%.2f%% "
        "iteration_time: ours=%.5f theirs=%.5f capture_cpu_share=%.2f%% predicted_ettr=%.4f\n",
        fs::path(p->config).stem().c_str(), p->pp, p->dp, s.w_sparse, s.w_first, s.overhead_pct,
        s.moevement_s, s.none_s, s.capture_share_pct, ettr);
  }
  for (const auto& [p, why] : failed) {
    std::printf("matrix %s pp=%d dp=%d: not measured: %s\n", fs::path(p->config).stem().c_str(),
                p->pp, p->dp, why.c_str());
  }
  if (!failed.empty()) throw std::runtime_error("a placement of the matrix was not measured");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse_options(argc, argv);
    const busy_load busy(o.load);
    const auto bin = moevement_binary();
    const fs::path log = bench_log("policies");
    if (o.verify) {
      run_verify({o.config, o.sets, o.repeats, o.iterations, o.pp, std::max(o.dp, 2), o.spares,
                  o.w_sparse},
                 bin, log);
    } else if (o.matrix) {
      run_matrix(o, bin, log);
    } else {
      (void)run_bench(o, bin, log);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench policies: %s\n", e.what());
    return 1;
  }
  return 0;
}
