// The coordinator's side of a recovery (engine/head_recovery.hpp): a worker's loss handed to
// the recovery, and what the recovery asks of the job (the survivors aborted, the stages
// rewired, training going on once every stage is back). The recovery itself is recovery/'s.
#include <fmt/format.h>

#include <algorithm>

#include "actors/gather.hpp"
#include "engine/coordinator.hpp"
#include "engine/run_log_reader.hpp"
#include "engine/spare_choice.hpp"
#include "engine/takeover.hpp"

namespace moevement::engine {

namespace {

using actors::actor_ref;
using asio::awaitable;
using sclock = std::chrono::steady_clock;

// The slowest NCCL group abort of the survivors' answers (recovery_end's group_abort_s).
void note_aborts(const std::vector<result<actors::reply<wire::AbortAck>>>& acks, double& slowest) {
  for (const auto& a : acks) {
    if (a.ok()) slowest = std::max(slowest, a->get().getGroupAbortSeconds());
  }
}

}  // namespace

bool coordinator::loss_pending() const {
  if (phase_ == phase::admitting) return false;  // workers join the membership with their role
  // A lost spare that no recovery counts on changes nothing a recovery does (its turn only
  // drops it): waiting for it would leave the recovery held with no loss to go on from (a
  // host lost with a stage's worker and a spare on it).
  return std::any_of(workers_.begin(), workers_.end(), [&](const auto& kv) {
    // (Before training, only those that reported their stage have joined.)
    if (!started() && !ready_.contains(kv.first)) return false;
    const bool counts = kv.second.stage >= 0 || (recovery_ && recovery_->involves(kv.first));
    return counts && !system().last_heard(kv.first).has_value();
  });
}

awaitable<void> coordinator::worker_lost(transport::node_id n, std::string how) {
  if (finished_) co_return;
  if (!started()) {
    const bool placed = co_await lost_before_training(n, how);
    if (placed || finished_) co_return;
  }
  auto it = workers_.find(n);
  if (it == workers_.end()) co_return;
  const worker_info w = it->second;
  const std::string role =
      w.stage < 0 ? std::string("spare") : fmt::format("stage {}, replica {}", w.stage, w.replica);
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "worker_lost")
                    .add("node", std::int64_t{n})
                    .add("stage", w.stage)
                    .add("replica", w.replica)
                    .add("how", how)
                    .add("iteration", iteration_)
                    .add("time_s", log_->seconds()));
  }
  if (callbacks_.on_worker_lost) callbacks_.on_worker_lost(n, w.pid);
  if (recovery_ && recovery_->involves(n)) {
    // Working for the recovery (rebuilding or replaying a stage): the recovery's loss.
    workers_.erase(it);
    if (w.stage >= 0 && stages_[std::size_t(w.replica * job_.pp + w.stage)].node == n) {
      drop_stage(w.stage, w.replica);
    }
    co_await recovery_->lost_member(n);
    co_return;
  }
  if (w.stage < 0 && started()) {  // a spare: one fewer, training goes on
    const auto holders =
        replicates() ? snapshot_holders() : std::map<transport::node_id, std::vector<actor_ref>>{};
    workers_.erase(it);
    retarget_snapshots(holders, w.replicator);
    const auto left = std::count_if(workers_.begin(), workers_.end(),
                                    [](const auto& kv) { return kv.second.stage < 0; });
    notice(fmt::format("spare worker {} (pid {}) {}; training goes on with {} spare(s)", n, w.pid,
                       how, left));
    co_return;
  }
  const bool spare_left = std::any_of(workers_.begin(), workers_.end(), [&](const auto& kv) {
    return kv.second.stage < 0 && kv.first != n;
  });
  if (!recovery_ || !started() || !spare_left) {
    std::string why;
    if (!started() && !taken_over_.empty()) {
      why =
          "it was lost while the standby head took over, before every stage reported, and no "
          "spare is left to take its role; `moevement launch CONFIG --resume` goes on from the "
          "newest window on disk";
    } else if (!started()) {
      why =
          "it was lost before training started and no spare is left to take its role (raise "
          "cluster.spares)";
    } else if (!recovery_) {
      why = fmt::format("checkpoint.policy = {} cannot recover a lost worker",
                        policy_name(job_.policy));
    } else {
      why = "no spare worker is left (raise cluster.spares)";
    }
    // "was lost at iteration 2 (admission ... refused)": the iteration next to the verb, the
    // transport's words after it.
    const auto colon = how.find(": ");
    const std::string what = colon == std::string::npos
                                 ? fmt::format("{} at iteration {}", how, iteration_)
                                 : fmt::format("{} at iteration {} ({})", how.substr(0, colon),
                                               iteration_, how.substr(colon + 2));
    fail(fmt::format("worker {} ({}, pid {}) {}; {}, so the job stops", n, role, w.pid, what, why));
    co_return;
  }
  workers_.erase(it);
  drop_stage(w.stage, w.replica);
  co_await recovery_->lost(w);
}

awaitable<bool> coordinator::lost_before_training(transport::node_id n, const std::string& how) {
  const auto it = workers_.find(n);
  if (phase_ == phase::admitting) {
    // Not yet anyone's peer: admission goes on without it, and roles_complete() gives its role
    // to a spare (a fresh start's roles go by node: one that never said hello held the role of
    // its number; under a standby that took over, an unheard one's role is the one nobody
    // claims).
    if (it == workers_.end() && !taken_over_.contains(n) && !awaits_hello(n)) co_return true;
    const bool takeover = !taken_over_.empty();
    if (takeover && taken_over_.size() == 1) co_return false;  // (nobody left to take over)
    // (Unheard: a fresh start's role by its number; a takeover's, unknown.)
    const bool had_a_role =
        it != workers_.end() ? it->second.stage >= 0 : takeover || int(n) <= job_.workers();
    const int role =
        it != workers_.end() ? it->second.replica * job_.pp + it->second.stage : int(n) - 1;
    if (had_a_role && (it != workers_.end() || !takeover)) {
      lost_roles_[role] = {it != workers_.end() ? it->second.domain : std::string(),
                           it != workers_.end()
                               ? fmt::format("worker {} (pid {}) {}", n, it->second.pid, how)
                               : fmt::format("worker {} {}", n, how)};
    }
    std::string then = "one spare fewer";
    if (had_a_role) {
      then = fmt::format("its role{} goes to a spare, if one is left",
                         it == workers_.end() ? std::string()
                                              : fmt::format(" (stage {}, replica {})",
                                                            it->second.stage, it->second.replica));
    }
    // Ended by the pid its hello carried, as any loss under this head: a worker cut off, not
    // dead, must not run on beside the spare that takes its role.
    if (it != workers_.end() && callbacks_.on_worker_lost) {
      callbacks_.on_worker_lost(n, it->second.pid);
    }
    if (it != workers_.end()) system().fence(n, it->second.agent.incarnation, how);
    if (it != workers_.end()) workers_.erase(it);
    taken_over_.erase(n);
    lost_before_start_.insert(n);
    --expected_workers_;
    notice(fmt::format("worker {} {} {}; {}", n, how,
                       takeover ? "while the standby head took over" : "before training started",
                       then));
    log_loss_before_training(n, how, takeover ? "takeover" : "admission", 0);
    admitted();
    co_return true;
  }
  if (it == workers_.end()) co_return true;
  const worker_info w = it->second;
  transport::node_id spare = 0;
  if (w.stage >= 0) {
    // A spare that reported and is heard first (not one declared lost since, its turn still
    // queued), else one still starting.
    spare = choose_spare(workers_, w.domain, [&](transport::node_id s) {
      return s != n && ready_.contains(s) && system().last_heard(s).has_value();
    });
    if (spare == 0) {
      spare = choose_spare(workers_, w.domain,
                           [&](transport::node_id s) { return s != n && !ready_.contains(s); });
    }
    if (spare == 0) co_return false;  // the caller ends the job, saying so
  }
  if (callbacks_.on_worker_lost) callbacks_.on_worker_lost(n, w.pid);
  // Late, not dead maybe (a slow build, a hang on another host): a member is told it is lost
  // and stops; one not joined yet is refused when it comes (never beside the spare).
  system().fence(n, w.agent.incarnation, how);
  workers_.erase(it);
  taken_over_.erase(n);
  lost_before_start_.insert(n);
  ready_.erase(n);
  --expected_workers_;
  log_loss_before_training(n, how, "start", spare);
  if (w.stage < 0) {
    notice(fmt::format("spare worker {} (pid {}) {} before training started; {} spare(s) left", n,
                       w.pid, how,
                       std::count_if(workers_.begin(), workers_.end(),
                                     [](const auto& kv) { return kv.second.stage < 0; })));
    co_await start_when_ready();  // (it may have been the last to report)
    co_return true;
  }
  // Nothing is trained yet: the spare starts the role as the lost worker would have (the
  // initial state, or the durable Restore a resume sends every stage). The stages it will be
  // wired to are wired once it reported.
  worker_info& sw = workers_.at(spare);
  sw.stage = w.stage;
  sw.replica = w.replica;
  sw.stage_actor = actor_ref{};
  ready_.erase(spare);
  role_given_at_[spare] = system().now();  // (its start deadline counts from now)
  drop_stage(w.stage, w.replica);
  held_start_ = false;  // (its report starts training, or holds it for the standby again)
  send_assign(sw);
  notice(fmt::format(
      "worker {} (stage {}, replica {}, pid {}) {} before training started; spare worker {} "
      "takes its role",
      n, w.stage, w.replica, w.pid, how, spare));
  co_return true;
}

std::vector<transport::node_id> coordinator::late_at_start(
    actors::clock::time_point now, std::optional<actors::clock::time_point>& next) const {
  const auto timeout = std::chrono::milliseconds(job_.start_timeout_ms);
  std::vector<transport::node_id> late;
  const auto judge = [&](transport::node_id n) {
    auto deadline = start_began_ + timeout;
    if (const auto it = role_given_at_.find(n); it != role_given_at_.end()) {
      deadline = std::max(deadline, it->second + timeout);
    }
    if (now >= deadline) {
      late.push_back(n);
    } else if (!next || deadline < *next) {
      next = deadline;
    }
  };
  if (phase_ == phase::admitting && taken_over_.empty()) {
    for (transport::node_id n = 1; int(n) <= job_.workers() + job_.spares; ++n) {
      if (awaits_hello(n)) judge(n);
    }
  } else if (phase_ == phase::admitting) {
    for (const transport::node_id n : taken_over_) {
      if (!workers_.contains(n)) judge(n);
    }
  } else if (phase_ == phase::starting) {
    for (const auto& [n, w] : workers_) {
      if (!ready_.contains(n)) judge(n);
    }
  }
  return late;
}

bool coordinator::spares_cover(const std::vector<transport::node_id>& late) const {
  const auto is_late = [&](transport::node_id n) {
    return std::find(late.begin(), late.end(), n) != late.end();
  };
  // Roles whose worker was lost during admission: roles_complete() gives them spares first.
  std::size_t roles = phase_ == phase::admitting ? lost_roles_.size() : 0;
  for (const transport::node_id n : late) {
    const auto it = workers_.find(n);
    // (Unheard: a fresh start's role by its number; a takeover's, unknown: counted as one.)
    roles += it != workers_.end() ? it->second.stage >= 0
                                  : !taken_over_.empty() || int(n) <= job_.workers();
  }
  const auto on_time = std::count_if(workers_.begin(), workers_.end(), [&](const auto& kv) {
    return kv.second.stage < 0 && !is_late(kv.first) &&
           (phase_ == phase::admitting || ready_.contains(kv.first));
  });
  return !late.empty() && roles <= std::size_t(on_time);
}

void coordinator::check_start(std::function<void(const start_check&)> then) {
  (void)system().post_call(
      self(), [this, then = std::move(then)](actors::actor&) -> awaitable<void> {
        start_check out;
        if (finished_ || started()) {
          out.started = true;
          then(out);
          co_return;
        }
        const auto now = system().now();
        std::optional<actors::clock::time_point> next;
        const auto late = late_at_start(now, next);
        if (!late.empty() && (!taken_over_.empty() || !spares_cover(late))) {
          out.short_of_spares = true;
          then(out);
          co_return;
        }
        const bool admitting = phase_ == phase::admitting;
        for (const transport::node_id n : late) {
          if (!said_hello(n)) out.unheard.push_back(n);
          const std::string how =
              fmt::format("did not {} within cluster.start_timeout_ms = {} ms",
                          admitting ? "say hello" : "report its stage", job_.start_timeout_ms);
          co_await lost_before_training(n, how);
          if (finished_) break;
        }
        // (A spare given a role just now has its own deadline, from now.)
        std::optional<actors::clock::time_point> after;
        (void)late_at_start(system().now(), after);
        const auto wait =
            after ? *after - system().now() : std::chrono::milliseconds(job_.start_timeout_ms);
        out.next = std::max(std::chrono::milliseconds(1),
                            std::chrono::duration_cast<std::chrono::milliseconds>(wait));
        out.started = finished_ || started();
        then(out);
      });
}

void coordinator::log_loss_before_training(transport::node_id n, const std::string& how,
                                           const char* during, transport::node_id spare) {
  if (log_ == nullptr) return;
  json_record r;
  r.add("kind", "event")
      .add("event", "worker_lost")
      .add("node", std::int64_t{n})
      .add("how", how)
      .add("during", during);
  if (spare != 0) r.add("spare", std::int64_t{spare});
  log_->write(r.add("time_s", log_->seconds()));
}

void coordinator::notice(const std::string& line) {
  if (callbacks_.on_notice) callbacks_.on_notice(line);
}

void coordinator::recovery_event(const std::string& event, std::int64_t target) {
  if (callbacks_.on_recovery) callbacks_.on_recovery(event, target);
}

void coordinator::resume_instead(const resume_point& p) {
  iteration_ = p.target_iteration;
  first_iteration_ = iteration_;
  scaler_ = p.scaler;
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "resume_instead")
                    .add("resume_window", std::int64_t(p.window))
                    .add("resume_iteration", p.target_iteration)
                    .add("time_s", log_->seconds()));
  }
}

void coordinator::durable_window(const resume_point& p) {
  if (callbacks_.on_durable_window) callbacks_.on_durable_window(p);
}

void coordinator::report_rejected(const char* event, const char* what,
                                  const std::vector<std::string>& reasons) {
  for (const auto& reason : reasons) {
    if (callbacks_.on_notice) callbacks_.on_notice(fmt::format("{} rejected: {}", what, reason));
    if (log_ != nullptr) {
      log_->write(json_record{}.add("kind", "event").add("event", event).add("reason", reason));
    }
  }
}

awaitable<bool> coordinator::loss_follows() {
  // The transport often sees a peer die before the head's membership does: give the loss the
  // failure timeout to arrive.
  if (!loss_pending()) {
    co_await system().sleep_for(std::chrono::milliseconds(job_.failure_timeout_ms + 200));
  }
  co_return loss_pending();
}

void coordinator::drop_stage(int stage, int replica) {
  stages_[std::size_t(replica * job_.pp + stage)] = actor_ref{};
}

awaitable<bool> coordinator::hold_training(double& group_abort_s) {
  enter_recovery();
  // (The result bound first: g++ 12 compiled `if (!co_await ...) co_return false;` here into
  // an illegal instruction.)
  const bool aborted = co_await abort_survivors(group_abort_s);
  co_return aborted && !loss_pending();
}

awaitable<bool> coordinator::abort_survivors(double& group_abort_s) {
  // Drop the iteration in progress everywhere else (it is re-run once the stages are back),
  // and clear what failed in the survivors because of the lost peers: every stage at once.
  const std::uint64_t e = epoch_;
  auto fill = [e](std::size_t, wire::Abort::Builder b) { b.setEpoch(e); };
  const std::vector<actor_ref> alive = stages_;
  auto res = co_await actors::ask_all<wire::Abort, wire::AbortAck>(*this, alive, ask_timeout, fill);
  if (finished_) co_return false;
  note_aborts(res, group_abort_s);
  // Failed asks to workers still in the membership: they may be dying (their loss not yet
  // known) or slow. Those already gone need no second ask: their losses are queued.
  std::vector<actor_ref> retry;
  for (std::size_t i = 0; i < alive.size(); ++i) {
    if (alive[i].valid() && !res[i].ok() && system().last_heard(alive[i].node)) {
      retry.push_back(alive[i]);
    }
  }
  // A stage that could not be aborted usually died too, and the transport knew before the
  // head did: give its loss the failure timeout to arrive (it then joins the recovery).
  if (!retry.empty()) {
    co_await system().sleep_for(std::chrono::milliseconds(job_.failure_timeout_ms + 200));
    if (finished_) co_return false;
    std::erase_if(retry, [&](const actor_ref& r) {
      return !system().last_heard(r.node).has_value();  // lost meanwhile: its loss follows
    });
    auto again =
        co_await actors::ask_all<wire::Abort, wire::AbortAck>(*this, retry, ask_timeout, fill);
    if (finished_) co_return false;
    for (std::size_t i = 0; i < retry.size(); ++i) {
      const bool still_there = system().last_heard(retry[i].node).has_value();
      if (!again[i].ok() && still_there) {
        fail("aborting the iteration for a recovery failed: " + again[i].err().message);
        co_return false;
      }
    }
  }
  co_return !finished_;
}

awaitable<void> coordinator::recovered(const recovery_done& done) {
  if (done.counts) ++recoveries_;
  if (done.rolled_back) {  // every stage went back to a checkpoint: so does the job
    iteration_ = done.target;
    scaler_ = *done.rolled_back;
    // A state check after the target was of the timeline left: the iterations since run again.
    state_agreed_ = std::min(state_agreed_, done.target);
  }
  phase_ = phase::running;
  recovery_event("recovery_end", done.target);
  if (!done.rolled_back && (done.validation || iteration_ >= job_.train.iterations)) {
    // The validation round is run again; or a resume of a job that had trained every
    // iteration: only what follows the last one (validation, the digests) is left.
    co_await after_iteration();
  } else {
    start_iteration();  // the target iteration, under a new epoch
  }
}

awaitable<void> coordinator::on_exit(actor_ref who, actors::exit_reason why) {
  if (!recovery_ || finished_ || !why.abnormal() || who != recovery_->tree_root()) co_return;
  fail("the recovery tree's job supervisor stopped (" + why.to_string() + "); the job stops");
}

awaitable<void> coordinator::region_escalated(wire::RegionEscalated::Reader m) {
  if (!recovery_ || finished_) co_return;
  std::string reason = m.getReason();
  co_await recovery_->escalated(m.getRegion(), std::move(reason));
}

awaitable<void> coordinator::region_restart(wire::RegionRestart::Reader m,
                                            wire::RegionMembers::Builder out) {
  if (finished_ || !recovery_) {
    out.setError(finished_ ? "the job ended" : "this job recovers no region");
    co_return;
  }
  co_await recovery_->region_restart(m, out);
}

// --resume (docs/recovery.md "Resuming a killed job"): the coordinator's state as the journal
// says, then its recovery restores every stage from the newest durable window all of them
// verify (recovery/durable_rollback.cpp).
asio::awaitable<void> coordinator::start_resume(bool takeover) {
  const resume_point p = std::move(*resume_);
  resume_.reset();
  if (!recovery_) {
    fail("--resume needs checkpoint.policy = \"moevement\" with checkpoint.durable = true");
    co_return;
  }
  // The coordinator's state as it was at the journal's point: where training goes on and the
  // loss scaler (the windows are the recovery's).
  iteration_ = p.target_iteration;
  first_iteration_ = iteration_;
  scaler_ = p.scaler;
  job_start_ = sclock::now();
  if (log_ != nullptr) {
    auto r = job_start_record()
                 .add("resume_window", std::int64_t(p.window))
                 .add("resume_iteration", p.target_iteration);
    // A standby head that went back to disk: a takeover, not a --resume.
    if (takeover) r.add("takeover", "disk");
    log_->write(r);
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

awaitable<void> coordinator::start_takeover() {
  const std::string why = co_await go_on_live();
  if (finished_ || why.empty()) co_return;
  if (callbacks_.on_notice) {
    callbacks_.on_notice("the standby head cannot go on from the running stages (" + why +
                         "): every stage goes back to the journal's window");
  }
  // Their durable Restores stop the running stages: those are no longer the job's.
  for (auto& [n, w] : workers_) {
    if (w.stage >= 0) drop_stage(w.stage, w.replica);
    w.stage_actor = actor_ref{};
  }
  co_await start_resume(/*takeover=*/true);
}

awaitable<std::string> coordinator::go_on_live() {
  if (!recovery_) co_return "no recovery policy";
  if (std::any_of(stages_.begin(), stages_.end(), [](const actor_ref& r) { return !r.valid(); })) {
    co_return "a role's worker was lost: its spare is restored from disk";
  }
  auto replies = co_await actors::ask_all<wire::StageStateQuery, wire::StageState>(
      *this, stages_, ask_timeout, [](std::size_t, wire::StageStateQuery::Builder) {});
  if (finished_) co_return "";
  std::vector<stage_state> states;
  for (std::size_t i = 0; i < replies.size(); ++i) {
    const auto where = fmt::format("stage {} replica {}", int(i) % job_.pp, int(i) / job_.pp);
    if (!replies[i].ok()) co_return where + " did not answer: " + replies[i].err().message;
    try {
      states.push_back(read_stage_state(replies[i]->get()));
    } catch (const std::exception& e) {
      co_return where + ": " + e.what();
    }
  }
  const resume_point& journal = *resume_;
  auto t = plan_live_takeover(states, journal, job_.pp);
  if (!t.ok()) co_return t.err().message;
  // Reduced gradients no Step will come for go (each stage at its own epoch).
  if (!t->drop.empty()) {
    std::vector<actor_ref> to;
    for (const auto& [i, e] : t->drop) to.push_back(stages_[i]);
    auto acks = co_await actors::ask_all<wire::Abort, wire::AbortAck>(
        *this, to, ask_timeout,
        [&](std::size_t k, wire::Abort::Builder b) { b.setEpoch(t->drop[k].second); });
    if (finished_) co_return "";
    for (std::size_t k = 0; k < acks.size(); ++k) {
      if (!acks[k].ok()) co_return "a stage could not drop its reduced gradients";
    }
  }
  if (!recovery_->taken_over(journal, *t)) co_return "the recovery policy cannot";
  resume_.reset();
  // The coordinator's state where the stages are: the next iteration, the loss scaler
  // before it, epochs and wirings past every stage's.
  iteration_ = t->target;
  first_iteration_ = iteration_;
  scaler_ = t->scaler;
  epoch_ = t->epoch;
  wirings_ = t->wiring;
  job_start_ = sclock::now();
  const std::int64_t completed = t->unfinished ? t->unfinished->iteration : -1;
  // Iterations every stage stepped that the lost head died before logging: their records
  // (loss, times) are gone; the gap is said, not left for a reader to find.
  const auto logged = last_logged_iteration(job_.run_log);
  const std::int64_t unlogged = logged ? *logged + 1 : 0;
  if (log_ != nullptr) {
    auto r = job_start_record()
                 .add("resume_window", std::int64_t(journal.window))
                 .add("resume_iteration", t->target)
                 .add("takeover", "live")
                 .add("dropped_iteration", t->dropped)
                 .add("completed_step", completed);
    if (unlogged < t->target) {
      r.add("unlogged_from", unlogged).add("unlogged_to", t->target - 1);
    }
    log_->write(r);
  }
  if (unlogged < t->target && callbacks_.on_notice) {
    callbacks_.on_notice(fmt::format(
        "the lost head logged no record of iteration{} {}: stepped by every stage, so not run "
        "again (the run log says unlogged_from/unlogged_to)",
        unlogged < t->target - 1 ? "s" : "",
        unlogged < t->target - 1 ? fmt::format("{}..{}", unlogged, t->target - 1)
                                 : std::to_string(unlogged)));
  }
  if (callbacks_.on_notice) {
    callbacks_.on_notice(fmt::format(
        "the standby head goes on from the running stages at iteration {}{} (W={}); a recovery "
        "starts from {}",
        t->target,
        t->dropped       ? " (the iteration in flight runs again)"
        : completed >= 0 ? fmt::format(" (the step of iteration {} sent to the stages that "
                                       "lacked it)",
                                       completed)
                         : std::string(),
        t->w_sparse,
        t->persisted ? fmt::format("window {} in memory", t->persisted->first)
                     : fmt::format("window {} on disk until a window of this head persists",
                                   journal.window)));
  }
  if (t->unfinished) {
    // The stages that lack the lost head's last Step get it; once they have stepped, the
    // stages are wired and training goes on (maybe_stepped_all).
    const auto& u = *t->unfinished;
    phase_ = phase::stepping;
    epoch_ = u.epoch;
    iteration_ = u.iteration;
    last_ = iteration_record{};
    last_.iteration = u.iteration;
    stepped_flags_.assign(stages_.size(), true);
    completing_takeover_ = true;
    for (std::size_t k = 0; k < u.stages.size(); ++k) {
      stepped_flags_[u.stages[k]] = false;
      send_step(stages_[u.stages[k]], u.epoch, u.step.plan, u.place, recovery_->steps_kept_from(),
                u.popularity[k], wire::Verify::NONE);
    }
    co_return "";
  }
  // Training runs from here: a worker lost while the stages are wired is a loss the recovery
  // takes (from the window the stages named), not the end of a job that had not started.
  phase_ = phase::running;
  if (co_await wire_all()) co_await after_iteration();
  co_return "";
}

}  // namespace moevement::engine
