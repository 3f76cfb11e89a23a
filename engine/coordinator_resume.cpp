// The coordinator's share of the durable tier (docs/recovery.md "Resuming a killed job"): what
// the journal keeps beside a durable window (journal_point), and `moevement launch --resume`:
// the coordinator's state as the journal says, then its recovery restores every stage from
// the newest durable window all of them verify (recovery/durable_rollback.cpp).
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
  p.w_sparse = book_.w_sparse;
  // The scaler is the one after the last planned step: training goes on right after it.
  p.target_iteration = book_.steps.empty() ? iteration_ : book_.steps.rbegin()->first + 1;
  p.scaler = scaler_;
  p.pp = job_.pp;
  p.dp = job_.dp;
  for (const auto& [w, first] : book_.durable_windows) {
    if (w <= p.window) p.windows[w] = first;
  }
  const std::int64_t from = p.windows.empty() ? p.target_iteration : p.windows.begin()->second;
  for (auto it = book_.steps.lower_bound(from); it != book_.steps.end(); ++it) p.steps.insert(*it);
  return p;
}

asio::awaitable<void> coordinator::start_resume() {
  const resume_point p = std::move(*resume_);
  resume_.reset();
  if (!book_.durable || !recovery_ || !p.windows.contains(p.window)) {
    fail("--resume needs checkpoint.policy = \"moevement\" with checkpoint.durable = true");
    co_return;
  }
  // The coordinator's state as it was at the journal's point: where training goes on, the
  // loss scaler, the window size, the steps a replay applies and the windows on disk.
  iteration_ = p.target_iteration;
  scaler_ = p.scaler;
  book_.w_sparse = p.w_sparse;
  book_.steps = p.steps;
  book_.durable_windows = p.windows;
  book_.persisted = p.window;
  book_.persisted_first = p.windows.at(p.window);
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
  // Every stage restores from the durable tier (the recovery's resume: one region of the
  // whole pipeline, restored from the newest window every stage verifies).
  co_await recovery_->resume(p);
}

}  // namespace moevement::engine
