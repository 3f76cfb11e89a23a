#include "recovery/region_recovery.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <utility>

#include "engine/spare_choice.hpp"
#include "recovery/region_supervisor.hpp"

namespace moevement::recovery {

namespace {

using actors::actor_ref;
using asio::awaitable;

std::string ordinal(int n) {
  const int tens = n % 100, ones = n % 10;
  const char* suffix = tens >= 11 && tens <= 13 ? "th"
                       : ones == 1              ? "st"
                       : ones == 2              ? "nd"
                       : ones == 3              ? "rd"
                                                : "th";
  return fmt::format("{}{}", n, suffix);
}

}  // namespace

std::pair<const region_recovery::region*, const region_recovery::member*>
region_recovery::member_of(transport::node_id spare) const {
  if (state_ && spare != 0) {
    for (const region& r : state_->regions) {
      for (const member& m : r.members) {
        if (m.spare == spare) return {&r, &m};
      }
    }
  }
  return {nullptr, nullptr};
}

std::pair<region_recovery::region*, region_recovery::member*> region_recovery::member_of(
    transport::node_id spare) {
  // The same search, on this (non-const) recovery's own state.
  const auto [r, m] = std::as_const(*this).member_of(spare);
  return {const_cast<region*>(r), const_cast<member*>(m)};
}

region_recovery::region* region_recovery::region_by_id(std::uint64_t id) {
  if (!state_) return nullptr;
  for (region& r : state_->regions) {
    if (r.id == id) return &r;
  }
  return nullptr;
}

awaitable<void> region_recovery::lost(worker_info w) {
  if (!state_) {
    state_.emplace();
    state_->detected = sclock::now();
  }
  state_->pending.push_back(std::move(w));
  co_await recover();
}

bool region_recovery::involves(transport::node_id n) const {
  return state_ && (member_of(n).first != nullptr || state_->replaced.contains(n));
}

awaitable<void> region_recovery::lost_member(transport::node_id n) {
  // A region member's worker: its region's supervisor saw its child there end and restarts
  // the region (region_restart gives the role a spare).
  if (auto [reg, m] = member_of(n); m != nullptr) {
    reg->restarting = true;
    m->ready = false;
  }
  // A recovery that waited for every queued loss (loss_pending) places the others now.
  if (state_ && !state_->pending.empty()) co_await recover();
}

awaitable<void> region_recovery::recover() {
  if (job_.finished() || !state_) co_return;
  if (!state_->begun) {
    // While the survivors step, let them finish: the lost stages are then rebuilt one
    // iteration further (its step plan is known), and nothing is recomputed outside them.
    if (job_.stepping()) {
      co_await job_.finish_stepping();  // go_on() once they have
      co_return;
    }
    state_->begun = true;
    state_->resume_validation = job_.validating();
    state_->target = job_.iteration();
    // (false: the job ended, or stages lost meanwhile, whose turns place every loss at once)
    if (!co_await job_.hold_training(state_->group_abort_s)) co_return;
  }
  // Past silent corruption (roll_back_before): the whole job goes back to before it.
  if (clean_ && !state_->durable) {
    co_await start_durable_rollback(clean_->why);
    co_return;
  }
  if (state_->pending.empty()) co_return;
  // Every loss already declared is placed at once, after its own turn: a merge then sees each
  // region as it is (a region's member lost too is restarting; placed first, its merge kept
  // the other region and stopped this one's supervisor, its escalation lost).
  if (job_.loss_pending()) co_return;
  place_losses();
  // No window of this head's has persisted since a standby took over: the journal's durable
  // window is the newest whole one (the stages' copies and logs in memory are older or
  // newer), so the job rolls back to it.
  if (!state_->durable && windows_.persisted_on_disk_only()) {
    co_await start_durable_rollback(
        "a stage was lost before a window persisted under the standby head that took over");
    co_return;
  }
  // Nothing to restore from: no window persisted since a resume at another layout (and the
  // steps from the initial state are gone).
  const auto& steps = windows_.steps();
  if (!state_->durable && !windows_.persisted() && !steps.empty() && steps.begin()->first > 0) {
    job_.fail(
        "a stage was lost before the job, resumed at another layout, persisted its first "
        "window; the job stops (launch it again with --resume)");
    co_return;
  }
  // Each new region gets its supervisor, each grown one grows its supervisor's children: a
  // supervisor asks for the region's next generation before it starts them (region_restart).
  for (region& r : state_->regions) {
    if (!r.dirty) continue;
    r.dirty = false;
    add_group_survivors(r);
    supervise(r);
  }
}

void region_recovery::place_losses() {
  // A region member's loss never comes here: its region's supervisor restarts the region.
  // Every other lost stage starts a region of its own, and regions that overlap or touch
  // merge (contiguous lost stages recover jointly: the logs between them are gone).
  for (const worker_info& w : state_->pending) {
    region r;
    r.id = ++region_ids_;
    r.first = r.last = w.stage;
    r.members.push_back(member{w});
    r.died.push_back(fmt::format("stage {} replica {} (worker {})", w.stage, w.replica, w.node));
    r.dirty = true;
    state_->regions.push_back(std::move(r));
  }
  state_->pending.clear();
  auto& regions = state_->regions;
  // A region whose supervisor gave up (gone, its RegionEscalated still to come) or is about to
  // (restarting past the limit) is escalating: a merge keeps it and its id, so that the
  // escalation covers the merged region (it was stopped or erased, the escalation dropped as
  // stale, and the merged region restarted past the limit on a fresh budget).
  auto& sys = job_.actor().system();
  const int limit = job_.job().region_restarts;
  // 2: its supervisor gave up (its RegionEscalated on the way); 1: it will (restarting past
  // the limit); 0: neither.
  const auto escalating = [&](const region& r) {
    if (!r.supervisor.valid()) return 0;
    if (!sys.alive(r.supervisor)) return 2;
    return r.restarting && r.restarts >= limit ? 1 : 0;
  };
  for (bool merged = true; merged;) {
    merged = false;
    for (std::size_t i = 0; i < regions.size() && !merged; ++i) {
      for (std::size_t j = i + 1; j < regions.size() && !merged; ++j) {
        region& a = regions[i];
        region& b = regions[j];
        if (std::max(a.first, b.first) > std::min(a.last, b.last) + 1) continue;
        // The escalating one absorbs the other, else the supervised one (the other's
        // supervisor, if any, stops).
        const int ea = escalating(a), eb = escalating(b);
        if (ea != eb ? eb > ea : (!a.supervisor.valid() && b.supervisor.valid())) std::swap(a, b);
        tree_.stop_region(b.supervisor);
        a.first = std::min(a.first, b.first);
        a.last = std::max(a.last, b.last);
        for (auto& m : b.members) a.members.push_back(std::move(m));
        for (auto& d : b.died) a.died.push_back(std::move(d));
        a.dirty = true;
        a.restarts = std::max(a.restarts, b.restarts);
        regions.erase(regions.begin() + std::ptrdiff_t(j));
        merged = true;
      }
    }
  }
  std::sort(regions.begin(), regions.end(),
            [](const region& a, const region& b) { return a.first < b.first; });
}

void region_recovery::supervise(region& r) {
  auto& self = job_.actor();
  if (!r.supervisor.valid()) {
    r.nodes = std::make_shared<std::vector<transport::node_id>>();
    r.supervised = r.members.size();
    r.supervisor = tree_.start_region(r.id, r.nodes, r.supervised);
    return;
  }
  r.restarting = true;
  const std::size_t more = r.members.size() - r.supervised;
  auto specs = region_supervisor::member_specs(r.nodes, r.supervised, more);
  r.supervised = r.members.size();
  (void)region_supervisor::grow(self.system(), r.supervisor, std::move(specs), true);
}

void region_recovery::stop_supervisors() {
  if (!state_) return;
  for (region& r : state_->regions) tree_.stop_region(r.supervisor);
}

awaitable<void> region_recovery::escalated(std::uint64_t id, std::string reason) {
  region* r = state_ ? region_by_id(id) : nullptr;
  if (job_.finished() || r == nullptr || !r->supervisor.valid()) co_return;  // stale
  r->supervisor = {};
  ++r->restarts;  // the restart it could not make
  co_await escalate(*r, reason);
}

awaitable<void> region_recovery::region_restart(engine::wire::RegionRestart::Reader m,
                                                engine::wire::RegionMembers::Builder out) {
  region* r = region_by_id(m.getRegion());
  if (job_.finished() || r == nullptr) {
    out.setError(job_.finished() ? "the job ended" : "the region's recovery ended");
    co_return;
  }
  const std::uint64_t id = r->id;
  if (!co_await restart_region(*r)) {
    out.setError("the job stops");
    co_return;
  }
  r = region_by_id(id);  // the regions may have changed while it awaited
  if (r == nullptr) {
    out.setError("the region's recovery ended");
    co_return;
  }
  auto nodes = out.initNodes(static_cast<unsigned>(r->members.size()));
  for (unsigned i = 0; i < r->members.size(); ++i) nodes.set(i, r->members[i].spare);
}

awaitable<bool> region_recovery::restart_region(region& r) {
  // Members whose worker is gone (the supervisor's children saw it) get a spare.
  r.restarting = false;
  r.cause = r.generation == 0 ? "started" : "grew";
  const auto& workers = job_.worker_roles();
  for (member& m : r.members) {
    if (m.spare == 0) continue;
    if (workers.contains(m.spare) && job_.actor().system().last_heard(m.spare).has_value()) {
      continue;
    }
    state_->replaced.insert(m.spare);
    if (r.generation != 0) r.cause = "restarted";
    r.died.push_back(
        m.spare == m.lost.node
            ? fmt::format("stage {} replica {} (worker {})", m.lost.stage, m.lost.replica, m.spare)
            : fmt::format("spare worker {} (rebuilding stage {} replica {})", m.spare, m.lost.stage,
                          m.lost.replica));
    m.spare = 0;
  }
  if (r.generation != 0) ++r.restarts;
  if (state_->durable) {
    const std::uint64_t id = r.id;
    const bool chosen = co_await choose_durable_window(r);  // (bound first: see hold_training)
    if (!chosen || region_by_id(id) == nullptr) co_return false;
  }
  if (!assign_spares(r)) co_return false;
  r.generation = ++generations_;
  r.started = sclock::now();
  send_restores(r);
  r.died.clear();
  co_return true;
}

bool region_recovery::group_replay(const region& r) const {
  // Under expert parallelism the group replays spread over its workers, the EP groups' rows
  // passing between them (each member's replay router), when each member replays one stage:
  // a single-stage region, or a joint one replayed as a pipeline. Otherwise it replays whole
  // on each restored worker, whose EP groups exchange their rows in that process
  // (recovery/sparse_to_dense.hpp): one replay thread serving the routers of several stages
  // could wait on a peer that waits on it.
  const auto& job = job_.job();
  if (!job.spread_replay || job.dp < 2) return false;
  if (job.ep > 1 && r.first != r.last && !job.pipelined_replay) return false;
  for (const auto& [n, w] : job_.workers()) {
    if (w.stage >= 0 && !w.group_exchange.valid()) return false;  // a worker of an older build
  }
  return true;
}

void region_recovery::add_group_survivors(region& r) {
  if (!group_replay(r)) return;
  for (int s = r.first; s <= r.last; ++s) {
    for (int d = 0; d < job_.job().dp; ++d) {
      const bool in = std::any_of(r.members.begin(), r.members.end(), [&](const member& m) {
        return m.lost.stage == s && m.lost.replica == d;
      });
      if (in) continue;
      for (const auto& [n, w] : job_.workers()) {
        if (w.stage != s || w.replica != d || member_of(n).first != nullptr) continue;
        member m;
        m.lost = w;  // not lost: the survivor rolls back and replays its replica on its worker
        m.spare = n;
        r.members.push_back(m);
        break;
      }
    }
  }
}

bool region_recovery::assign_spares(region& r) {
  // Every role without a worker gets a spare; roles whose spare already restored an older
  // generation restore again (same worker) with the enlarged region.
  auto& workers = job_.worker_roles();
  for (member& m : r.members) {
    if (m.spare == 0) {
      // (Not one declared lost whose turn is still queued: its Restore would fail, a restart
      // spent on nothing.)
      const std::string& avoid = m.spare_domain.empty() ? m.lost.domain : m.spare_domain;
      m.spare = choose_spare(workers, avoid, [&](transport::node_id n) {
        return job_.actor().system().last_heard(n).has_value();
      });
      if (m.spare != 0) {
        workers.at(m.spare).stage = m.lost.stage;
        workers.at(m.spare).replica = m.lost.replica;
        m.spare_domain = workers.at(m.spare).domain;
      }
    }
    if (m.spare == 0) {
      // Every role of the region left without one (losses of the same iteration read as if
      // only the last happened), and what the job had.
      std::string roles;
      for (const member& o : r.members) {
        if (o.spare != 0) continue;
        roles += fmt::format("{}stage {} replica {} (worker {})", roles.empty() ? "" : ", ",
                             o.lost.stage, o.lost.replica, o.lost.node);
      }
      job_.fail(fmt::format(
          "{} lost and no spare worker is left for it (cluster.spares = {}, each in use or lost; "
          "raise cluster.spares)",
          roles, job_.job().spares));
      return false;
    }
    m.ready = false;
    worker_info& sw = workers.at(m.spare);
    if (sw.stage_actor.valid()) {  // reported an older generation, or a survivor's stage
      sw.stage_actor = actor_ref{};
      job_.drop_stage(m.lost.stage, m.lost.replica);
    }
  }
  return true;
}

awaitable<void> region_recovery::escalate(const region& r, const std::string& reason) {
  const auto& job = job_.job();
  const std::string stages = r.first == r.last ? fmt::format("stage {}", r.first)
                                               : fmt::format("stages {}..{}", r.first, r.last);
  if (state_->durable) {
    // The job's own rollback could not go on either: nothing is left to fall back to.
    job_.fail(fmt::format("the rollback of the whole job to the durable tier gave up: {}", reason));
    co_return;
  }
  const std::string why = fmt::format(
      "the recovery of {} would restart a {} time (after {} restart{}), past "
      "checkpoint.region_restarts = {}",
      stages, ordinal(r.restarts), r.restarts - 1, r.restarts == 2 ? "" : "s", job.region_restarts);
  const bool durable = windows_.durable();
  if (auto* log = job_.log()) {
    log->write(engine::json_record{}
                   .add("kind", "event")
                   .add("event", "region_escalated")
                   .add("region", std::int64_t(r.id))
                   .add("first_stage", r.first)
                   .add("last_stage", r.last)
                   .add("restarts", r.restarts)
                   .add("limit", job.region_restarts)
                   .add("reason", reason.substr(0, 1024))
                   .add("to", durable ? "durable_rollback" : "stop")
                   .add("time_s", log->seconds()));
  }
  if (durable) {
    co_await start_durable_rollback(why);
    co_return;
  }
  job_.fail(why +
            "; the job stops (with checkpoint.durable = true the whole job would roll back to "
            "the durable tier instead)");
}

bool region_recovery::rebuilding(transport::node_id n) const {
  return member_of(n).second != nullptr;
}

bool region_recovery::current(transport::node_id n, std::uint64_t generation) const {
  // Not an older generation's report, nor one of a region about to restart.
  const auto [reg, m] = member_of(n);
  return m != nullptr && generation == reg->generation && !reg->restarting;
}

awaitable<void> region_recovery::restore_failed(transport::node_id n, const std::string& message,
                                                bool snapshot_lost) {
  const auto [reg, m] = member_of(n);
  if (reg == nullptr) co_return;  // (the coordinator passes on current reports only)
  const std::uint64_t id = reg->id, generation = reg->generation;
  // A restore usually fails because a worker it pulled from died: the head learns of that
  // within the failure timeout and a heartbeat, and the region then grows (cascading) and
  // restarts. Looked at again then, on a timer: a sleep here held the coordinator's every
  // message (other regions' reports, their restarts) for as long.
  const auto wait =
      std::chrono::milliseconds(job_.job().failure_timeout_ms + job_.job().heartbeat_ms + 200);
  actors::actor_system* sys = &job_.actor().system();  // the timer's: it lives while it can run
  auto& time = sys->time();
  (void)time.call_at(time.now() + wait, [sys, me = job_.actor().self(), self = this, id, generation,
                                         message, snapshot_lost] {
    look_again_at_failed_restore(*sys, me, self, id, generation, message, snapshot_lost);
  });
  co_return;
}

void region_recovery::look_again_at_failed_restore(actors::actor_system& sys,
                                                   actors::actor_ref coordinator,
                                                   region_recovery* self, std::uint64_t region,
                                                   std::uint64_t generation, std::string message,
                                                   bool snapshot_lost) {
  // `self` is touched only in the coordinator's turn: post_call fails harmlessly once the
  // coordinator, which owns this recovery, is gone (a timer may outlive both).
  (void)sys.post_call(coordinator,
                      [self, region, generation, message = std::move(message),
                       snapshot_lost](actors::actor&) -> awaitable<void> {
                        co_await self->restore_failed_after_losses(region, generation, message,
                                                                   snapshot_lost);
                      });
}

awaitable<void> region_recovery::restore_failed_after_losses(std::uint64_t region,
                                                             std::uint64_t generation,
                                                             std::string message,
                                                             bool snapshot_lost) {
  if (job_.finished() || !state_) co_return;
  if (job_.loss_pending()) {
    // Declared, its turn queued behind this one: look again after it. (Returning here left the
    // region waiting for ever where that loss was elsewhere: a disjoint region.)
    look_again_at_failed_restore(job_.actor().system(), job_.actor().self(), this, region,
                                 generation, std::move(message), snapshot_lost);
    co_return;
  }
  // Merged into another, restarted or grown since: its new generation is what counts now.
  const struct region* r = region_by_id(region);
  if (r == nullptr || r->generation != generation || r->restarting) co_return;
  if (snapshot_lost && windows_.durable()) {
    co_await start_durable_rollback(message + "; every copy of a needed snapshot is gone");
    co_return;
  }
  job_.fail(message);
}

awaitable<void> region_recovery::restored(transport::node_id n,
                                          engine::wire::StageReady::Reader m) {
  const auto [reg, mem] = member_of(n);
  if (mem == nullptr) co_return;
  mem->ready = true;
  mem->pull_s = m.getPullSeconds();
  mem->replay_s = m.getReplaySeconds();
  mem->replay_threads = m.getReplayThreads();
  mem->replayed = m.getIterationsReplayed();
  mem->slots_mapped = m.getSlotsMapped();
  mem->slots_pulled = m.getSlotsPulled();
  mem->handles_refused = m.getHandlesRefused();
  mem->copies_refused = m.getCopiesRefused();
  mem->log_pieces = m.getLogPieces();
  reg->ready_at = sclock::now();
  co_await maybe_finish();
}

awaitable<void> region_recovery::maybe_finish() {
  if (!state_ || !state_->pending.empty()) co_return;
  for (const region& r : state_->regions) {
    if (r.restarting || r.generation == 0) co_return;
    for (const member& m : r.members) {
      if (!m.ready) co_return;
    }
  }
  // A loss during the rewiring makes rewire() false; its turn, queued behind this one, grows
  // or adds a region.
  const bool wired = co_await job_.rewire();
  if (!wired || job_.finished()) co_return;
  // Every region is back: the tree under the job goes (the stages it rebuilt stay).
  stop_supervisors();
  const state rec = std::move(*state_);
  state_.reset();
  report_end(rec);
  engine::recovery_done done;
  if (clean_ && rec.durable && windows_.scaler_before(rec.target)) {
    // Rolled back past silent corruption: the job goes on at the target, under its scaler.
    done.rolled_back = windows_.scaler_before(rec.target);
    windows_.rolled_back(rec.durable_window, rec.target, *done.rolled_back);
  } else {
    windows_.recovered(rec.target, rec.window_pp != 0);
  }
  clean_.reset();
  done.target = rec.target;
  done.validation = rec.resume_validation;
  done.counts = !rec.resume;
  co_await job_.recovered(done);
}

}  // namespace moevement::recovery
