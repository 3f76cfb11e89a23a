// The coordinator and the durable tier (docs/recovery.md "Fallback to the durable tier",
// "Resuming a killed job"): the whole-job rollback when every copy of a needed slot is gone
// or a region escalated (one region of every role, under a supervisor of its own, restored
// from the newest window every role verifies on disk), and `moevement launch --resume`,
// which is that rollback with no loss behind it: every stage restores from the newest
// durable window the journal knows, replays to where training was, and the job goes on.
#include <fmt/format.h>

#include <map>
#include <set>

#include "actors/gather.hpp"
#include "engine/coordinator.hpp"

namespace moevement::engine {

using actors::actor_ref;
using asio::awaitable;
using sclock = std::chrono::steady_clock;

resume_point coordinator::journal_point() const {
  resume_point p;
  p.window = durable_inflight_.value_or(0);
  p.w_sparse = w_sparse_;
  // The scaler is the one after the last planned step: training goes on right after it.
  p.target_iteration = steps_.empty() ? iteration_ : steps_.rbegin()->first + 1;
  p.scaler = scaler_;
  p.pp = job_.pp;
  p.dp = job_.dp;
  for (const auto& [w, first] : durable_windows_) {
    if (w <= p.window) p.windows[w] = first;
  }
  const std::int64_t from = p.windows.empty() ? p.target_iteration : p.windows.begin()->second;
  for (auto it = steps_.lower_bound(from); it != steps_.end(); ++it) p.steps.insert(*it);
  return p;
}

asio::awaitable<void> coordinator::start_resume() {
  const resume_point p = std::move(*resume_);
  resume_.reset();
  if (!durable_ || !can_recover_ || !p.windows.contains(p.window)) {
    fail("--resume needs checkpoint.policy = \"moevement\" with checkpoint.durable = true");
    co_return;
  }
  // The coordinator's state as it was at the journal's point: where training goes on, the
  // loss scaler, the window size, the steps a replay applies and the windows on disk.
  iteration_ = p.target_iteration;
  scaler_ = p.scaler;
  w_sparse_ = p.w_sparse;
  steps_ = p.steps;
  durable_windows_ = p.windows;
  persisted_ = p.window;
  persisted_first_ = p.windows.at(p.window);
  job_start_ = sclock::now();
  if (log_ != nullptr) {
    log_->write(job_start_record()
                    .add("resume_window", std::int64_t(p.window))
                    .add("resume_iteration", p.target_iteration));
  }
  if (callbacks_.on_notice) {
    callbacks_.on_notice(fmt::format(
        "resuming: the journal's newest window is {}, training goes on at iteration {} (W={})",
        p.window, p.target_iteration, p.w_sparse));
  }
  recovery_.emplace();
  recovery_->target = iteration_;
  recovery_->begun = true;
  recovery_->detected = sclock::now();
  recovery_->resume = true;
  if (p.pp != job_.pp || p.dp != job_.dp) {
    recovery_->window_pp = p.pp;
    recovery_->window_dp = p.dp;
    if (callbacks_.on_notice) {
      callbacks_.on_notice(fmt::format(
          "resuming at another layout: the windows are of pp={} dp={}, this job runs pp={} "
          "dp={}{}",
          p.pp, p.dp, job_.pp, job_.dp,
          p.dp == job_.dp
              ? std::string(" (the pipeline depth changes no bit)")
              : fmt::format("; the global batch changes from {} to {} micro-batches per "
                            "iteration from iteration {} on",
                            p.dp * job_.train.micro_batches, job_.dp * job_.train.micro_batches,
                            p.target_iteration)));
    }
  }
  phase_ = phase::recovering;
  // One region, the whole pipeline; every role is restored by the worker given it.
  region all;
  all.first = 0;
  all.last = job_.pp - 1;
  for (const auto& [n, w] : workers_) {
    if (w.stage < 0) continue;
    region_member m;
    m.lost = w;
    m.spare = n;
    all.members.push_back(m);
  }
  all.id = ++region_ids_;
  recovery_->regions.push_back(std::move(all));
  recovery_->durable = true;
  recovery_->durable_why = "resuming the job";
  // Its supervisor asks for the region's first generation (region_restart: the durable
  // window chosen, the Restores sent).
  supervise(recovery_->regions.front());
  co_return;
}

awaitable<void> coordinator::start_durable_rollback(std::string why) {
  if (!recovery_ || recovery_->durable || finished_) co_return;
  if (callbacks_.on_notice) {
    callbacks_.on_notice(
        fmt::format("{}: falling back to the durable tier, the whole job rolls back", why));
  }
  // One region: the whole pipeline, every role, under a supervisor of its own (the regions'
  // go). Lost roles keep the spare they have; every other role is restored by the worker that
  // holds it (survivors, and spares that rebuilt another region).
  stop_supervisors();
  region all;
  all.id = ++region_ids_;
  all.first = 0;
  all.last = job_.pp - 1;
  std::map<std::pair<int, int>, region_member> roles;
  for (region& r : recovery_->regions) {
    for (region_member& m : r.members) roles[{m.lost.stage, m.lost.replica}] = m;
    all.restarts = std::max(all.restarts, r.restarts + (r.generation != 0 ? 1 : 0));
    all.started = r.started;
  }
  for (const worker_info& w : recovery_->pending) {  // losses not placed yet: a spare each
    if (w.stage >= 0) roles[{w.stage, w.replica}] = region_member{w};
  }
  recovery_->pending.clear();
  for (const auto& [n, w] : workers_) {
    if (w.stage < 0 || roles.contains({w.stage, w.replica})) continue;
    region_member m;
    m.lost = w;
    m.spare = n;
    roles[{w.stage, w.replica}] = m;
  }
  for (auto& [role, m] : roles) all.members.push_back(m);
  recovery_->regions.clear();
  recovery_->regions.push_back(std::move(all));
  recovery_->durable = true;
  recovery_->durable_why = std::move(why);
  supervise(recovery_->regions.front());
}

awaitable<bool> coordinator::choose_durable_window(region& r) {
  const std::int64_t target = recovery_->target;
  const std::string why = recovery_->durable_why;
  const std::uint64_t id = r.id;
  // The newest window every role has complete and verified on disk. A role whose worker is
  // lost meanwhile gets a spare, and everyone is asked again.
  std::uint64_t window = 0;
  bool found = false;
  std::vector<std::string> rejected;
  for (bool ask_again = true; ask_again;) {
    ask_again = false;
    region* reg = region_by_id(id);
    if (reg == nullptr) co_return false;
    for (region_member& m : reg->members) {
      if (m.spare != 0 && !workers_.contains(m.spare)) m.spare = 0;
    }
    if (!assign_spares(*reg)) co_return false;
    std::map<std::uint64_t, int> offered;
    rejected.clear();
    // Every role's windows, each asked of a member's replicator at once: its own role's, or,
    // for a resume at another layout, the windows' roles spread over the members (the
    // directory is shared).
    const std::vector<region_member> members = reg->members;
    const int pp = recovery_->window_pp, dp = recovery_->window_dp;
    std::vector<std::pair<int, int>> roles;
    for (const region_member& m : members) roles.emplace_back(m.lost.stage, m.lost.replica);
    if (pp != 0) {
      roles.clear();
      for (int d = 0; d < dp; ++d) {
        for (int s = 0; s < pp; ++s) roles.emplace_back(s, d);
      }
    }
    std::vector<actor_ref> holders;
    for (std::size_t i = 0; i < roles.size(); ++i) {
      const auto it = workers_.find(members[i % members.size()].spare);
      holders.push_back(it == workers_.end() ? actor_ref{} : it->second.replicator);
    }
    auto fill = [&](std::size_t i, wire::DurableQuery::Builder b) {
      b.setStage(roles[i].first);
      b.setReplica(roles[i].second);
    };
    auto replies = co_await actors::ask_all<wire::DurableQuery, wire::DurableOffer>(
        *this, holders, std::chrono::seconds(300), fill);
    if (finished_ || !recovery_) co_return false;
    for (std::size_t i = 0; i < replies.size() && !ask_again; ++i) {
      const auto& res = replies[i];
      if (!res.ok()) {
        // Usually its worker died: its loss comes within the failure timeout.
        if (co_await loss_follows()) {
          ask_again = true;
          break;
        }
        if (finished_ || !recovery_) co_return false;
        fail(fmt::format("asking for the durable windows of stage {} replica {} failed: {}",
                         roles[i].first, roles[i].second, res.err().message));
        co_return false;
      }
      std::set<std::uint64_t> mine;
      for (auto w : res->get().getWindows()) mine.insert(w);
      for (auto w : mine) ++offered[w];
      for (auto t : res->get().getRejected()) rejected.push_back(std::string(t).substr(0, 1024));
    }
    if (ask_again) continue;
    for (const auto& [w, n] : offered) {
      const auto known = durable_windows_.find(w);
      if (n == int(roles.size()) && known != durable_windows_.end() && known->second <= target &&
          (persisted_ && w <= *persisted_)) {
        window = w;
        found = true;
      }
    }
  }
  report_rejected("durable_rejected", "durable window", rejected);
  if (!found && recovery_->resume) {
    fail(fmt::format(
        "nothing to resume: no durable window the journal knows is complete and verified on "
        "every stage ({} rejected)",
        rejected.size()));
    co_return false;
  }
  if (!found) {
    fail(fmt::format(
        "{}; every copy of a needed snapshot is gone and no durable window is complete and "
        "verified on every stage ({} rejected); the job stops",
        why, rejected.size()));
    co_return false;
  }
  recovery_->durable_window = window;
  recovery_->durable_first = durable_windows_.at(window);
  recovery_->durable_rejected = std::int64_t(rejected.size());
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "durable_rollback")
                    .add("window", std::int64_t(window))
                    .add("first_iteration", recovery_->durable_first)
                    .add("target_iteration", target)
                    .add("rejected", std::int64_t(rejected.size()))
                    .add("reason", why.substr(0, 1024))
                    .add("time_s", log_->seconds()));
  }
  co_return true;
}

}  // namespace moevement::engine
