// The coordinator's side of `moevement launch --resume` (docs/recovery.md "Resuming a killed
// job"): every stage restores from the newest durable window all of them verify and that the
// journal knows, replays to where the journal says training was, and the job goes on from
// there as if it had never stopped. It is the durable tier's whole-job rollback
// (coordinator_regions.cpp) with no loss behind it: every role keeps its worker.
#include <fmt/format.h>

#include "engine/coordinator.hpp"

namespace moevement::engine {

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

}  // namespace moevement::engine
