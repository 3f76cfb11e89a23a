#include "recovery/window_book.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <thread>

#include "engine/window_budget.hpp"
#include "recovery/moevement_policy.hpp"

namespace moevement::recovery {

using actors::actor_ref;

namespace {

// A window still not on every stage's replicators this many windows' worth of iterations
// after it began is reported (replication usually trails capture by about one window).
constexpr std::int64_t stall_windows = 3;

}  // namespace

window_book::window_book(engine::head_control& job)
    : job_(job),
      durable_(engine::durable_tier(job.job())),
      shadow_(job.job().pp, job.job().shadow_every > 0 && job.job().shadow_full) {}

engine::checkpoint_place window_book::planned(const engine::planned_iteration& it) {
  if (w_sparse_ == 0) choose_window_size(it);
  if (plan_.empty()) plan_.start(it.iteration, w_sparse_);
  // A step planned again (a recovery went back over it) goes where it went the first time.
  if (it.iteration > planned_max_ && plan_.at(it.iteration).slot == 0) retune(it.iteration);
  planned_max_ = std::max(planned_max_, it.iteration);
  steps_[it.iteration] = it.step;
  scalers_[it.iteration + 1] = it.scaler;  // it.scaler: after this step
  report_stall(it.iteration);
  return plan_.at(it.iteration);
}

void window_book::stepped(const engine::iteration_cost& c) {
  if (tuner_) tuner_->add(c);
}

void window_book::retune(std::int64_t step) {
  if (!tuner_) return;
  for (const auto& [n, w] : job_.workers()) tuner_->raise_ceiling(int(w.op_sizes.size()));
  const engine::checkpoint_place at = plan_.at(step);
  const auto d = tuner_->decide(at.w_sparse);
  if (!d) return;
  if (auto* log = job_.log()) {
    engine::json_record r;
    r.add("kind", "event")
        .add("event", "window_tuned")
        .add("w_sparse", d->w)
        .add("previous", d->previous)
        .add("window", std::int64_t(at.window))
        .add("overhead", d->overhead)
        .add("rule", d->ettr_rule ? "ettr" : "overhead")
        .add("max_overhead", job_.job().max_overhead)
        .add("measured_iterations", d->iterations)
        .add("measured_s", d->seconds)
        .add("stall_s", d->stall_s)
        .add("log_s", d->log_s)
        .add("capture_cpu_s", d->capture_cpu_s)
        .add("replication_cpu_s", d->replication_cpu_s)
        .add("cpu_share_s", d->cpu_share_s)
        .add("iteration", step);
    if (d->ettr_rule) {
      r.add("mtbf_s", job_.job().baseline.mtbf_s)
          .add("predicted_ettr", d->predicted_ettr)
          .add("predicted_ettr_unchanged", d->previous_ettr);
    }
    log->write(r);
  }
  if (d->w == d->previous) return;
  plan_.start(step, d->w);
  w_sparse_ = d->w;
  const std::string why =
      d->capped ? fmt::format("no stage has more than {} operators, one per slot", d->w)
      : d->ettr_rule
          ? fmt::format(
                "predicted ETTR {:.4f} against {:.4f} at W {} with checkpoint.mtbf_s "
                "= {:g}",
                d->predicted_ettr, d->previous_ettr, d->previous, job_.job().baseline.mtbf_s)
          : fmt::format("checkpoint.max_overhead is {:g}%", 100 * job_.job().max_overhead);
  job_.notice(fmt::format(
      "checkpoint windows: W_sparse {} -> {} from window {} on (capturing cost {:.2f}% of the "
      "iteration time over the last {} iterations; {})",
      d->previous, d->w, at.window, 100 * d->overhead, d->iterations, why));
}

int window_book::w_of(std::uint64_t window) const {
  if (const int w = plan_.w_of(window); w > 0) return w;
  const auto it = resumed_sizes_.find(window);
  return it != resumed_sizes_.end() ? it->second : w_sparse_;
}

void window_book::report_stall(std::int64_t iteration) {
  // The oldest window some stage replica has not replicated yet (one no stage has begun to
  // replicate shows up once any stage has), reported once.
  const auto& job = job_.job();
  for (const auto& [window, done] : replicated_) {
    if (std::all_of(done.begin(), done.end(), [](bool b) { return b; })) continue;
    const std::int64_t first = window_first_[window];
    const int w = w_of(window);
    if (iteration - first < stall_windows * w) return;
    if (stall_reported_ && *stall_reported_ >= window) return;
    stall_reported_ = window;
    std::string missing;
    for (std::size_t i = 0; i < done.size(); ++i) {
      if (done[i]) continue;
      const int s = int(i) % job.pp, d = int(i) / job.pp;
      missing += fmt::format("{}stage {} replica {}", missing.empty() ? "" : ", ", s, d);
    }
    job_.notice(fmt::format(
        "snapshot replication is behind: window {} (iterations {}..{}) is not on the "
        "replicators of {} at iteration {}; a recovery now replays from {}",
        window, first, first + w - 1, missing, iteration,
        persisted_ ? fmt::format("window {}", *persisted_) : std::string("the initial state")));
    if (auto* log = job_.log()) {
      log->write(engine::json_record{}
                     .add("kind", "event")
                     .add("event", "window_stalled")
                     .add("window", std::int64_t(window))
                     .add("missing", missing)
                     .add("persisted", persisted_ ? std::int64_t(*persisted_) : std::int64_t{-1})
                     .add("iteration", iteration));
    }
    return;
  }
}

std::int64_t window_book::replication_lag(std::int64_t iteration) const {
  return persisted_ ? iteration - (persisted_first_ + w_of(*persisted_) - 2) : -1;
}

void window_book::recovered(std::int64_t target, bool layout_changed) {
  // A durable write in flight may never be answered by a lost stage: the next persisted
  // window is written instead, unpaced (the rebuilt stages' state on disk soon).
  durable_inflight_.reset();
  durable_next_ = {};
  shadow_.restart();            // a rebuilt stage holds no window or log from before `target`
  if (tuner_) tuner_->clear();  // what was measured before the loss is not the steady state
  if (layout_changed) {
    // Resumed at another layout: the windows on disk are of the old one, which no restore of
    // this job reads again. Until the first window of this layout persists, a loss stops the
    // job (region_recovery says so); a new --resume brings it back.
    durable_windows_.clear();
    newest_whole_.reset();
    persisted_.reset();
    persisted_first_ = 0;
  }
  durable_from_ = target;  // the rebuilt stages capture from here on
  maybe_persist();         // windows the stages finished replicating meanwhile
  // The others that began before the target never complete: every stage drops them.
  for (auto it = replicated_.begin(); it != replicated_.end();) {
    if (window_first_[it->first] >= target) {
      ++it;
      continue;
    }
    window_first_.erase(it->first);
    schedule_digests_.erase(it->first);
    it = replicated_.erase(it);
  }
  tell_abandoned(target);
}

std::set<std::uint64_t> window_book::durable_kept() const {
  std::set<std::uint64_t> kept;
  // The newest whole window: a stage whose writes keep failing must not leave the others to
  // prune, by count, the last window the job can resume or roll back from.
  if (newest_whole_ && durable_windows_.contains(*newest_whole_)) kept.insert(*newest_whole_);
  for (const std::int64_t from : shadow_.retained_firsts()) {
    std::optional<std::uint64_t> newest;
    for (const auto& [w, first] : durable_windows_) {
      if (first + w_of(w) - 2 < from) newest = w;  // (window_book::clean's test)
    }
    if (newest) kept.insert(*newest);
  }
  return kept;
}

void window_book::tell_abandoned(std::int64_t before) {
  for (const auto& [n, w] : job_.workers()) {
    if (!w.checkpoint.valid()) continue;
    (void)job_.actor().tell<engine::wire::WindowsAbandoned>(
        w.checkpoint, [&](engine::wire::WindowsAbandoned::Builder b) { b.setBefore(before); });
  }
}

void window_book::tell_persisted(std::uint64_t window, std::int64_t first, bool durable) {
  // (What the shadow checks retain: shadow_windows.)
  const std::vector<std::uint64_t> retained = shadow_.retained();
  const std::set<std::uint64_t> on_disk = durable_kept();
  for (const auto& [n, w] : job_.workers()) {
    for (const actor_ref& r : {w.checkpoint, w.replicator}) {
      if (!r.valid()) continue;
      (void)job_.actor().tell<engine::wire::WindowPersisted>(
          r, [&](engine::wire::WindowPersisted::Builder b) {
            b.setWindow(window);
            b.setFirstIteration(first);
            b.setDurable(durable && r == w.checkpoint);
            auto l = b.initRetained(unsigned(retained.size()));
            for (unsigned i = 0; i < retained.size(); ++i) l.set(i, retained[i]);
            b.setRetainedFirst(shadow_.retained_from());
            auto d = b.initDurableKept(unsigned(on_disk.size()));
            unsigned i = 0;
            for (const std::uint64_t k : on_disk) d.set(i++, k);
          });
    }
  }
}

void window_book::tell_restarted(std::uint64_t window) {
  for (const auto& [n, w] : job_.workers()) {
    if (!w.replicator.valid()) continue;
    (void)job_.actor().tell<engine::wire::WindowPersisted>(
        w.replicator, [&](engine::wire::WindowPersisted::Builder b) {
          b.setWindow(window);
          b.setRestart(true);
        });
  }
}

void window_book::go_on_from(const engine::resume_point& p) {
  w_sparse_ = p.w_sparse;
  resumed_sizes_ = p.window_sizes;
  // Windows go on from the journal's, W as it was there (its first step is first - 1); the
  // stages drop any newer window on disk as they restore.
  plan_ = window_plan{};
  plan_.start(p.windows.at(p.window) - 1, p.w_sparse, p.window);
  planned_max_ = p.target_iteration - 1;
  make_tuner();
  steps_ = p.steps;
  scalers_ = {{p.target_iteration, p.scaler}};
  durable_windows_ = p.windows;
  newest_whole_ = p.window;
  persisted_ = p.window;
  persisted_first_ = p.windows.at(p.window);
}

void window_book::resume_from(const engine::resume_point& p) {
  go_on_from(p);
  shadow_.restart();
  // Windows are numbered on from the journal's: a standby head going back to disk finds the
  // workers' replicators past it (the lost head's windows), which would refuse them all.
  tell_restarted(p.window);
  // A W fixed by the resume's config (checkpoint.w_sparse) holds from the first window that
  // begins at or after where training goes on; the windows before it are the journal's.
  if (const int w = job_.job().w_sparse; w > 0 && w != p.w_sparse) {
    const std::int64_t first_step = p.windows.at(p.window) - 1;
    const std::int64_t behind = p.target_iteration - first_step;
    const std::int64_t step =
        first_step + (behind + p.w_sparse - 1) / p.w_sparse * std::int64_t(p.w_sparse);
    plan_.start(step, w);
    w_sparse_ = w;
    job_.notice(fmt::format(
        "checkpoint windows: W_sparse {} -> {} from window {} on (checkpoint.w_sparse; the "
        "journal's windows were of {})",
        p.w_sparse, w, plan_.at(step).window, p.w_sparse));
  }
}

void window_book::take_over(const engine::resume_point& p, const engine::live_takeover& t) {
  go_on_from(p);  // then the live stages' plan (the journal's W, or the fixed one, is theirs)
  shadow_.restart();
  for (const auto& [id, first] : p.windows) resumed_sizes_.try_emplace(id, p.w_sparse);
  w_sparse_ = t.w_sparse;
  plan_ = window_plan{};
  plan_.start(t.target, t.w_sparse, t.next_window);
  planned_max_ = t.target - 1;
  steps_ = t.steps;
  durable_from_ = t.target;
  on_disk_only_ = !t.persisted;
  if (t.persisted) {
    // The lost head's newest persisted window, in memory on every stage's replicators: the
    // stages that had not heard of it yet are told (before the abandonment, which spares it).
    persisted_ = t.persisted->first;
    persisted_first_ = t.persisted->second;
    tell_persisted(persisted_.value(), persisted_first_, false);
  }
  tell_abandoned(t.target);
}

void window_book::replicated(engine::wire::WindowReplicated::Reader m, bool recovering) {
  const auto& job = job_.job();
  const int s = m.getStage(), d = m.getReplica();
  if (s < 0 || s >= job.pp || d < 0 || d >= job.dp) return;
  const std::uint64_t window = m.getWindow();
  if ((persisted_ && window <= *persisted_) || window < first_live_window_) return;
  auto& done = replicated_[window];
  done.resize(std::size_t(job.pp * job.dp), false);
  done[std::size_t(d * job.pp + s)] = true;
  window_first_[window] = m.getFirstIteration();
  // A stage's replicas must schedule alike (under expert parallelism, those of one EP rank,
  // which hold the same operators), or converting their windows together fails later: say so
  // now, in the run log, rather than at a recovery.
  const int ep = std::max(job.ep, 1);
  auto& digests = schedule_digests_[window];
  digests.resize(std::size_t(job.pp * ep), 0);
  std::uint64_t& first = digests[std::size_t(s * ep + d % ep)];
  if (first == 0) {
    first = m.getScheduleDigest();
  } else if (first != m.getScheduleDigest()) {
    if (auto* log = job_.log()) {
      log->write(engine::json_record{}
                     .add("kind", "event")
                     .add("event", "schedule_mismatch")
                     .add("stage", s)
                     .add("replica", d)
                     .add("window", std::int64_t(window)));
    }
  }
  if (!recovering) maybe_persist();
}

void window_book::maybe_persist() {
  const auto& job = job_.job();
  std::optional<std::uint64_t> newest;
  for (const auto& [w, done] : replicated_) {
    if (std::all_of(done.begin(), done.end(), [](bool b) { return b; })) newest = w;
  }
  if (!newest) return;
  // Every stage has this window on its replicators: it is the one a recovery starts from.
  const std::uint64_t window = *newest;
  persisted_ = window;
  on_disk_only_ = false;
  const std::int64_t first = window_first_[window];
  persisted_first_ = first;
  replicated_.erase(replicated_.begin(), replicated_.upper_bound(window));
  window_first_.erase(window_first_.begin(), window_first_.upper_bound(window));
  schedule_digests_.erase(schedule_digests_.begin(), schedule_digests_.upper_bound(window));
  // The durable tier writes one window at a time: this one when the one before is written
  // everywhere (a disk slower than the windows skips windows, never stalls a step).
  // Not a window begun before the last recovery's target: a stage rebuilt there never held
  // all of it (its copies on the replicators serve a recovery; its writer has nothing).
  // On CPU stages, not before the last write's CPU time is checkpoint.durable_share of the
  // cores' time since it began (windows persisted meanwhile are not written).
  const auto now = std::chrono::steady_clock::now();
  const bool durable = durable_ && !durable_inflight_ && first >= durable_from_ &&
                       (durable_soon_ || now >= durable_next_);
  if (durable) {
    durable_inflight_ = window;
    durable_reported_.assign(std::size_t(job.pp * job.dp), false);
    durable_bytes_ = 0;
    durable_seconds_ = 0.0;
    durable_errors_ = 0;
    durable_cpu_s_ = 0.0;
    durable_started_ = now;
    durable_windows_[window] = first;
    // What the stages keep on disk (checkpoint.keep + 1) and the one being written, and the
    // one kept for the shadow checks.
    const auto kept = durable_kept();
    for (auto it = durable_windows_.begin();
         durable_windows_.size() > std::size_t(job.baseline.keep) + 2 + kept.size() &&
         it != durable_windows_.end();) {
      it = kept.contains(it->first) ? std::next(it) : durable_windows_.erase(it);
    }
  }
  // Step plans stay from the oldest window a recovery may start from: this one, or a durable
  // one still on disk (or one a shadow check replays from: shadow_windows).
  std::int64_t keep_from =
      durable_windows_.empty() ? first : std::min(first, durable_windows_.begin()->second);
  if (const std::int64_t f = shadow_.retained_from(); f >= 0) keep_from = std::min(keep_from, f);
  steps_.erase(steps_.begin(), steps_.lower_bound(keep_from));
  scalers_.erase(scalers_.begin(), scalers_.lower_bound(keep_from));
  std::uint64_t oldest =
      durable_windows_.empty() ? window : std::min(window, durable_windows_.begin()->first);
  for (const std::uint64_t w : shadow_.retained()) oldest = std::min(oldest, w);
  plan_.forget_before(oldest);
  tell_persisted(window, first, durable);
  if (auto* log = job_.log()) {
    log->write(engine::json_record{}
                   .add("kind", "event")
                   .add("event", "window_persisted")
                   .add("window", std::int64_t(window))
                   .add("first_iteration", first)
                   .add("iteration", job_.iteration()));
  }
}

void window_book::durable_written(engine::wire::DurableWritten::Reader m) {
  const auto& job = job_.job();
  const int s = m.getStage(), d = m.getReplica();
  if (!durable_ || s < 0 || s >= job.pp || d < 0 || d >= job.dp) return;
  const std::string error = m.getError();
  if (auto* log = job_.log()) {
    engine::json_record r;
    r.add("kind", "event")
        .add("event", "durable_written")
        .add("stage", s)
        .add("replica", d)
        .add("window", std::int64_t(m.getWindow()))
        .add("bytes", std::int64_t(m.getBytes()))
        .add("seconds", m.getSeconds());
    if (!error.empty()) r.add("error", error.substr(0, 512));
    log->write(r);
  }
  if (!error.empty()) {
    auto& f = durable_failed_[{s, d}];
    ++f.count;
    const auto now = std::chrono::steady_clock::now();
    const std::string why = error.substr(0, 512);
    if (f.count == 1 || now - f.noticed_at >= std::chrono::minutes(1)) {
      job_.notice(fmt::format(
          "durable tier: stage {} replica {} did not write window {} ({} failed so far): {}", s, d,
          m.getWindow(), f.count, why));
      f.noticed_at = now;
    }
  }
  if (!durable_inflight_ || m.getWindow() != *durable_inflight_) return;
  const std::size_t i = std::size_t(d * job.pp + s);
  if (durable_reported_[i]) return;
  durable_reported_[i] = true;
  durable_bytes_ += m.getBytes();
  durable_seconds_ = std::max(durable_seconds_, m.getSeconds());
  durable_errors_ += !error.empty();
  // From the wire: one writer thread uses no more CPU than the time since the write began
  // (more, or not a number, counts as that).
  const double since =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - durable_started_).count();
  const double cpu = m.getCpuSeconds();
  durable_cpu_s_ += std::isnan(cpu) ? since : std::clamp(cpu, 0.0, since);
  if (!std::all_of(durable_reported_.begin(), durable_reported_.end(), [](bool b) { return b; })) {
    return;
  }
  // Every stage replica answered: one persisted durable window, its bytes in all and the
  // slowest stage's seconds (they write in parallel). Written everywhere: a resume may start
  // from it, once the journal has what the windows do not.
  if (durable_errors_ == 0) {
    newest_whole_ = *durable_inflight_;
    // The scaler is the one after the last planned step: training goes on right after it.
    job_.durable_window(journal_point(
        *durable_inflight_, steps_.empty() ? job_.iteration() : steps_.rbegin()->first + 1,
        job_.scaler()));
  }
  // A stop waiting for a window on disk (durable_soon) waits no gap after a write that failed.
  if (durable_errors_ == 0) durable_soon_ = false;
  const double gap = durable_gap_s(durable_cpu_s_, cpu_cores(), job.durable_share);
  durable_next_ =
      durable_started_ + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                             std::chrono::duration<double>(gap));
  if (auto* log = job_.log()) {
    log->write(engine::json_record{}
                   .add("kind", "event")
                   .add("event", "durable_window")
                   .add("window", std::int64_t(*durable_inflight_))
                   .add("bytes", std::int64_t(durable_bytes_))
                   .add("seconds", durable_seconds_)
                   .add("cpu_s", durable_cpu_s_)
                   .add("next_after_s", gap)
                   .add("failed", durable_errors_)
                   .add("iteration", job_.iteration()));
  }
  durable_inflight_.reset();
}

double durable_gap_s(double cpu_s, double cores, double share) {
  if (!(share > 0) || !(cores > 0) || !(cpu_s > 0)) return 0.0;
  // At most a week: the wait is added to a clock of nanoseconds.
  return std::min(cpu_s / (cores * share), 7 * 24 * 3600.0);
}

double window_book::cpu_cores() const {
  if (job_.job().train.device != models::device::cpu) return 0.0;
  std::map<std::string, double> hosts;  // the cores of each host with a stage
  const double cores = std::max(1u, std::thread::hardware_concurrency());
  for (const auto& [n, w] : job_.workers()) {
    if (w.stage >= 0) hosts[w.host] = cores;
  }
  double sum = 0.0;
  for (const auto& [h, k] : hosts) sum += k;
  return sum;
}

void window_book::make_tuner() {
  const auto& job = job_.job();
  if (job.w_sparse > 0 || (!(job.max_overhead > 0) && !job.window_by_ettr)) return;
  tuner_config c;
  c.max_overhead = job.max_overhead;
  c.mtbf_s = job.window_by_ettr ? job.baseline.mtbf_s : 0.0;
  c.restart_s = double(job.failure_timeout_ms) / 1000.0;  // detection; the rest is not known yet
  c.cores = cpu_cores();
  for (const auto& [n, w] : job_.workers()) c.ceiling = std::max(c.ceiling, int(w.op_sizes.size()));
  tuner_.emplace(c);
}

void window_book::choose_window_size(const engine::planned_iteration& it) {
  const auto& job = job_.job();
  double bandwidth = 0.0, budget_s = 0.0;  // Algorithm 1's inputs
  // Algorithm 1 with this first iteration as the profile (forward, backward and reduction:
  // what a snapshot copy overlaps with).
  if (job.w_sparse > 0) {
    w_sparse_ = job.w_sparse;
  } else {
    // The snapshot bandwidth each stage measured for a plain copy, shared with the r
    // replications of every captured byte; on the CPU, the time those copies may take is
    // the host's idle core time (engine/window_budget.hpp).
    std::map<std::string, engine::host_load> hosts;
    const double cores = std::max(1u, std::thread::hardware_concurrency());
    std::vector<std::vector<engine::op_size>> sizes(std::size_t(job.pp));
    for (const auto& [n, w] : job_.workers()) {
      engine::host_load& h = hosts[w.host];
      h.cores = cores;
      ++h.processes;
      if (w.stage < 0) continue;
      sizes[std::size_t(w.stage)] = w.op_sizes;
      h.compute_s.push_back(it.compute_s[std::size_t(w.replica * job.pp + w.stage)]);
      if (w.snapshot_bandwidth > 0 &&
          (h.copy_bytes_per_s == 0 || w.snapshot_bandwidth < h.copy_bytes_per_s)) {
        h.copy_bytes_per_s = w.snapshot_bandwidth;
      }
    }
    std::vector<engine::host_load> loads;
    for (auto& [name, h] : hosts) loads.push_back(std::move(h));
    // Replicas that map a slot (checkpoint.share_memory, on the owner's host) copy nothing;
    // those on other hosts are a NIC's work, which the paper's model takes as free.
    const engine::window_inputs in =
        engine::window_budget(loads, it.seconds, job.share_memory ? 0 : job.snapshot_replicas,
                              job.train.device == models::device::cpu);
    bandwidth = in.bandwidth;
    budget_s = in.seconds;
    // No idle time at all: the smallest time, so that Algorithm 1 stops at its own limit.
    w_sparse_ = bandwidth > 0
                    ? std::max(1, choose_window(sizes, std::max(in.seconds, 1e-9), bandwidth))
                    : 1;
    make_tuner();
  }
  if (auto* log = job_.log()) {
    log->write(engine::json_record{}
                   .add("kind", "event")
                   .add("event", "window_chosen")
                   .add("w_sparse", w_sparse_)
                   .add("profile_iteration_s", it.seconds)
                   .add("profile_bandwidth", bandwidth)
                   .add("profile_budget_s", budget_s)
                   .add("tuned", tuner_.has_value())
                   .add("iteration", job_.iteration()));
  }
}

engine::resume_point window_book::journal_point(std::uint64_t window, std::int64_t target,
                                                const models::loss_scaler& scaler) const {
  const auto& job = job_.job();
  engine::resume_point p;
  p.window = window;
  p.w_sparse = w_of(p.window);
  p.target_iteration = target;
  p.scaler = scaler;
  p.pp = job.pp;
  p.dp = job.dp;
  p.ep = std::max(job.ep, 1);
  for (const auto& [w, first] : durable_windows_) {
    if (w > p.window) continue;
    p.windows[w] = first;
    p.window_sizes[w] = w_of(w);
  }
  const std::int64_t from = p.windows.empty() ? p.target_iteration : p.windows.begin()->second;
  for (auto it = steps_.lower_bound(from); it != steps_.end() && it->first < target; ++it) {
    p.steps.insert(*it);
  }
  return p;
}

bool window_book::clean_window_before(std::int64_t clean_before) const {
  return std::any_of(durable_windows_.begin(), durable_windows_.end(), [&](const auto& w) {
    return (!persisted_ || w.first <= *persisted_) && clean(w.first, w.second, clean_before);
  });
}

std::optional<models::loss_scaler> window_book::scaler_before(std::int64_t target) const {
  const auto it = scalers_.find(target);
  if (it == scalers_.end()) return std::nullopt;
  return it->second;
}

std::uint64_t window_book::next_window_number() const {
  std::uint64_t next = first_live_window_;
  for (const auto& seg : plan_.segments()) next = std::max(next, seg.window + 1);
  if (!plan_.empty() && planned_max_ >= 0) {
    next = std::max(next, plan_.at(planned_max_).window + 1);
  }
  if (persisted_) next = std::max(next, *persisted_ + 1);
  if (!durable_windows_.empty()) next = std::max(next, durable_windows_.rbegin()->first + 1);
  if (!replicated_.empty()) next = std::max(next, replicated_.rbegin()->first + 1);
  return next;
}

void window_book::rolled_back(std::uint64_t window, std::int64_t target,
                              const models::loss_scaler& scaler) {
  shadow_.restart();  // a timeline left: no window of it is replayed from again
  // The sizes of the windows kept, before the plan that knew them goes.
  for (const auto& [w, first] : durable_windows_) resumed_sizes_[w] = w_of(w);
  const std::uint64_t next = next_window_number();
  durable_windows_.erase(durable_windows_.upper_bound(window), durable_windows_.end());
  steps_.erase(steps_.lower_bound(target), steps_.end());
  scalers_.erase(scalers_.upper_bound(target), scalers_.end());
  replicated_.clear();
  window_first_.clear();
  schedule_digests_.clear();
  // The window restored from is on disk only: a loss before the next one persists rolls the
  // job back to the durable tier again (its replicas' copies in memory are gone).
  persisted_ = window;
  persisted_first_ = durable_windows_.at(window);
  newest_whole_ = window;
  on_disk_only_ = true;
  durable_inflight_.reset();
  durable_next_ = {};  // the new timeline's first window on disk soon
  durable_from_ = target;
  stall_reported_.reset();
  if (tuner_) tuner_->clear();
  plan_ = window_plan{};
  plan_.start(target, w_sparse_, next);
  first_live_window_ = next;
  planned_max_ = target - 1;
  engine::resume_point p = journal_point(window, target, scaler);
  p.drop_newer = true;
  job_.durable_window(p);
}

}  // namespace moevement::recovery
