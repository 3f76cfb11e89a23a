// The coordinator's localized recovery (policy moevement, docs/recovery.md): losses placed in
// regions of contiguous lost stages, a region's replacements restored on spares (Restore) by
// generation, a loss in or next to a recovering region growing and restarting it, and the
// escalation to the job. The fallback to the durable tier is engine/coordinator_resume.cpp;
// the baselines' global rollback is engine/coordinator_rollback.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "actors/gather.hpp"
#include "engine/coordinator.hpp"
#include "engine/region_supervisor.hpp"

namespace moevement::engine {

namespace {

using actors::actor_ref;
using actors::write_ref;
using asio::awaitable;
using sclock = std::chrono::steady_clock;

}  // namespace

std::pair<coordinator::region*, coordinator::region_member*> coordinator::member_of(
    transport::node_id spare) {
  if (recovery_) {
    for (region& r : recovery_->regions) {
      for (region_member& m : r.members) {
        if (m.spare == spare && spare != 0) return {&r, &m};
      }
    }
  }
  return {nullptr, nullptr};
}

awaitable<void> coordinator::recover() {
  if (finished_ || !recovery_) co_return;
  // dense-memory, dense-disk, pec: the whole job goes back (once the survivors stepped).
  if (rolls_back_ && (recovery_->begun || phase_ != phase::stepping)) {
    co_await start_rollback();
    co_return;
  }
  if (!recovery_->begun) {
    // While the survivors step, let them finish: the lost stages are then rebuilt one
    // iteration further (its step plan is known), and nothing is recomputed outside them.
    if (phase_ == phase::stepping) {
      co_await maybe_stepped_all();  // the lost stages' Stepped are no longer waited for
      co_return;
    }
    recovery_->begun = true;
    recovery_->resume_validation = phase_ == phase::validating;
    recovery_->target = iteration_;
    phase_ = phase::recovering;
    if (!co_await abort_survivors()) co_return;
    // Stages lost meanwhile: their turns, queued behind this one, place every loss at once.
    if (loss_pending()) co_return;
  }
  if (recovery_->pending.empty()) co_return;

  // Place the new losses (a region member's loss never comes here: its region's supervisor
  // restarts the region). Every other lost stage starts a region of its own, and regions that
  // overlap or touch merge (contiguous lost stages recover jointly: the logs between them are
  // gone).
  for (const worker_info& w : recovery_->pending) {
    region r;
    r.id = ++region_ids_;
    r.first = r.last = w.stage;
    r.members.push_back(region_member{w});
    r.died.push_back(fmt::format("stage {} replica {} (worker {})", w.stage, w.replica, w.node));
    r.dirty = true;
    recovery_->regions.push_back(std::move(r));
  }
  recovery_->pending.clear();
  auto& regions = recovery_->regions;
  for (bool merged = true; merged;) {
    merged = false;
    for (std::size_t i = 0; i < regions.size() && !merged; ++i) {
      for (std::size_t j = i + 1; j < regions.size() && !merged; ++j) {
        region& a = regions[i];
        region& b = regions[j];
        if (std::max(a.first, b.first) > std::min(a.last, b.last) + 1) continue;
        // The supervised one absorbs the other (whose supervisor, if any, stops).
        if (!a.supervisor.valid() && b.supervisor.valid()) std::swap(a, b);
        if (b.supervisor.valid()) {
          retired_supervisors_.push_back(b.supervisor);
          system().stop(b.supervisor);
        }
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
  // Nothing to restore from: no window persisted since a resume at another layout (and the
  // steps from the initial state are gone).
  if (!recovery_->durable && !persisted_ && !steps_.empty() && steps_.begin()->first > 0) {
    fail(
        "a stage was lost before the job, resumed at another layout, persisted its first "
        "window; the job stops (launch it again with --resume)");
    co_return;
  }
  // Each new region gets its supervisor, each grown one grows its supervisor's children: a
  // supervisor asks for the region's next generation before it starts them (region_restart).
  for (region& r : regions) {
    if (!r.dirty) continue;
    r.dirty = false;
    add_group_survivors(r);
    supervise(r);
  }
}

void coordinator::supervise(region& r) {
  if (!r.supervisor.valid()) {
    r.nodes = std::make_shared<std::vector<transport::node_id>>();
    r.supervised = r.members.size();
    r.supervisor =
        system()
            .spawn<region_supervisor>(r.id, self(), r.nodes, r.supervised, job_.region_restarts)
            .ref;
    link(r.supervisor);
    return;
  }
  r.restarting = true;
  const std::size_t more = r.members.size() - r.supervised;
  auto specs = region_supervisor::member_specs(r.nodes, r.supervised, more);
  r.supervised = r.members.size();
  (void)region_supervisor::grow(system(), r.supervisor, std::move(specs), true);
}

void coordinator::stop_supervisors() {
  if (!recovery_) return;
  for (region& r : recovery_->regions) {
    if (!r.supervisor.valid()) continue;
    retired_supervisors_.push_back(r.supervisor);
    system().stop(r.supervisor);
    r.supervisor = {};
  }
}

coordinator::region* coordinator::region_by_id(std::uint64_t id) {
  if (!recovery_) return nullptr;
  for (region& r : recovery_->regions) {
    if (r.id == id) return &r;
  }
  return nullptr;
}

awaitable<void> coordinator::on_exit(actor_ref who, actors::exit_reason why) {
  if (std::erase(retired_supervisors_, who) != 0 || finished_ || !recovery_) co_return;
  for (region& r : recovery_->regions) {
    if (r.supervisor != who) continue;
    r.supervisor = {};
    ++r.restarts;  // the restart it could not make
    co_await escalate(r, why.to_string());
    co_return;
  }
}

awaitable<void> coordinator::region_restart(wire::RegionRestart::Reader m,
                                            wire::RegionMembers::Builder out) {
  region* r = region_by_id(m.getRegion());
  if (finished_ || r == nullptr) {
    out.setError(finished_ ? "the job ended" : "the region's recovery ended");
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

awaitable<bool> coordinator::restart_region(region& r) {
  // Members whose worker is gone (the supervisor's children saw it) get a spare.
  r.restarting = false;
  r.cause = r.generation == 0 ? "started" : "grew";
  for (region_member& m : r.members) {
    if (m.spare == 0) continue;
    if (workers_.contains(m.spare) && system().last_heard(m.spare).has_value()) continue;
    recovery_->replaced.insert(m.spare);
    if (r.generation != 0) r.cause = "restarted";
    r.died.push_back(
        m.spare == m.lost.node
            ? fmt::format("stage {} replica {} (worker {})", m.lost.stage, m.lost.replica, m.spare)
            : fmt::format("spare worker {} (rebuilding stage {} replica {})", m.spare, m.lost.stage,
                          m.lost.replica));
    m.spare = 0;
  }
  if (r.generation != 0) ++r.restarts;
  if (recovery_->durable) {
    const std::uint64_t id = r.id;
    if (!co_await choose_durable_window(r)) co_return false;
    if (region_by_id(id) == nullptr) co_return false;
  }
  if (!assign_spares(r)) co_return false;
  r.generation = ++generations_;
  r.started = sclock::now();
  send_restores(r);
  r.died.clear();
  co_return true;
}

awaitable<bool> coordinator::abort_survivors() {
  // Drop the iteration in progress everywhere else (it is re-run once the stages are back),
  // and clear what failed in the survivors because of the lost peers: every stage at once.
  const std::uint64_t e = epoch_;
  auto fill = [e](std::size_t, wire::Abort::Builder b) { b.setEpoch(e); };
  const std::vector<actor_ref> alive = stages_;
  auto res = co_await actors::ask_all<wire::Abort, wire::AbortAck>(*this, alive, ask_timeout, fill);
  if (finished_) co_return false;
  note_group_aborts(res);
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

bool coordinator::group_replay() const {
  if (job_.dp < 2) return false;
  for (const auto& [n, w] : workers_) {
    if (w.stage >= 0 && !w.group_exchange.valid()) return false;  // a worker of an older build
  }
  return true;
}

void coordinator::add_group_survivors(region& r) {
  if (!group_replay()) return;
  for (int s = r.first; s <= r.last; ++s) {
    for (int d = 0; d < job_.dp; ++d) {
      const bool member = std::any_of(r.members.begin(), r.members.end(), [&](const auto& m) {
        return m.lost.stage == s && m.lost.replica == d;
      });
      if (member) continue;
      for (const auto& [n, w] : workers_) {
        if (w.stage != s || w.replica != d || member_of(n).first != nullptr) continue;
        region_member m;
        m.lost = w;  // not lost: the survivor rolls back and replays its replica on its worker
        m.spare = n;
        r.members.push_back(m);
        break;
      }
    }
  }
}

bool coordinator::assign_spares(region& r) {
  // Every role without a worker gets a spare; roles whose spare already restored an older
  // generation restore again (same worker) with the enlarged region.
  for (region_member& m : r.members) {
    if (m.spare == 0) {
      for (auto& [n, w] : workers_) {
        if (w.stage < 0) {
          m.spare = n;
          w.stage = m.lost.stage;
          w.replica = m.lost.replica;
          break;
        }
      }
    }
    if (m.spare == 0) {
      fail(fmt::format(
          "stage {} replica {} was lost and no spare worker is left (raise cluster.spares)",
          m.lost.stage, m.lost.replica));
      return false;
    }
    m.ready = false;
    worker_info& sw = workers_.at(m.spare);
    if (sw.stage_actor.valid()) {  // reported an older generation, or a survivor's stage
      sw.stage_actor = actor_ref{};
      stages_[std::size_t(m.lost.replica * job_.pp + m.lost.stage)] = actor_ref{};
    }
  }
  return true;
}

void coordinator::note_group_aborts(
    const std::vector<result<actors::reply<wire::AbortAck>>>& acks) {
  for (const auto& a : acks) {
    if (a.ok()) {
      recovery_->group_abort_s =
          std::max(recovery_->group_abort_s, a->get().getGroupAbortSeconds());
    }
  }
}

awaitable<void> coordinator::escalate(const region& r, const std::string& reason) {
  const std::string stages = r.first == r.last ? fmt::format("stage {}", r.first)
                                               : fmt::format("stages {}..{}", r.first, r.last);
  if (recovery_->durable) {
    // The job's own rollback could not go on either: nothing is left to fall back to.
    fail(fmt::format("the rollback of the whole job to the durable tier gave up: {}", reason));
    co_return;
  }
  const std::string why =
      fmt::format("the recovery of {} restarted {} times, past checkpoint.region_restarts = {}",
                  stages, r.restarts, job_.region_restarts);
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "region_escalated")
                    .add("first_stage", r.first)
                    .add("last_stage", r.last)
                    .add("restarts", r.restarts)
                    .add("limit", job_.region_restarts)
                    .add("reason", reason.substr(0, 1024))
                    .add("to", durable_ ? "durable_rollback" : "stop")
                    .add("time_s", log_->seconds()));
  }
  if (durable_) {
    co_await start_durable_rollback(why);
    co_return;
  }
  fail(why +
       "; the job stops (with checkpoint.durable = true the whole job would roll back to "
       "the durable tier instead)");
}

std::map<std::string, int> coordinator::restores_per_host() const {
  std::map<std::string, int> out;
  if (!recovery_) return out;
  for (const region& r : recovery_->regions) {
    for (const region_member& m : r.members) {
      const auto w = workers_.find(m.spare);
      if (m.spare != 0 && !m.ready && w != workers_.end()) ++out[w->second.host];
    }
  }
  return out;
}

coordinator::restore_from coordinator::restore_point() const {
  restore_from p;
  p.target = recovery_->target;
  p.durable = recovery_->durable;
  p.has_window = p.durable || persisted_.has_value();
  p.window = p.durable ? recovery_->durable_window : persisted_.value_or(0);
  p.first = p.durable ? recovery_->durable_first : p.has_window ? persisted_first_ : 0;
  return p;
}

void coordinator::announce_restart(const region& r) {
  const auto [target, durable, has_window, window, first] = restore_point();
  std::string roles, spares, replacements;
  for (const region_member& m : r.members) {
    roles += fmt::format("{}{}/{}", roles.empty() ? "" : ",", m.lost.stage, m.lost.replica);
    spares += fmt::format("{}{}", spares.empty() ? "" : ",", m.spare);
    if (m.spare != m.lost.node) {
      replacements += fmt::format("{}{}", replacements.empty() ? "" : ",", m.spare);
    }
  }
  const std::size_t rebuilt =
      std::size_t(std::count(replacements.begin(), replacements.end(), ',')) + 1;
  const std::string stages = r.first == r.last
                                 ? fmt::format("stage {}", r.first)
                                 : fmt::format("stages {}..{} (jointly)", r.first, r.last);
  if (callbacks_.on_notice) {
    // Who died for this generation (placed by recover()); every role's first loss otherwise.
    std::string lost;
    for (const std::string& d : r.died) lost += (lost.empty() ? "" : ", ") + d;
    if (lost.empty()) {
      for (const region_member& m : r.members) {
        lost += fmt::format("{}stage {} replica {} (worker {})", lost.empty() ? "" : ", ",
                            m.lost.stage, m.lost.replica, m.lost.node);
      }
    }
    callbacks_.on_notice(
        durable ? fmt::format("{} durable window {} on workers {} (replaying iterations {}..{})",
                              recovery_->resume ? "resuming from" : "rolling the whole job back to",
                              window, spares, first, target - 1)
                : fmt::format("{} lost; {}rebuilding {} on spare worker{} {}{} from {} (replaying "
                              "iterations {}..{})",
                              lost, r.restarts > 0 ? "the recovery grew: " : "", stages,
                              rebuilt > 1 ? "s" : "", replacements,
                              replacements == spares
                                  ? std::string()
                                  : fmt::format(", the group replaying on workers {}", spares),
                              has_window ? fmt::format("window {}", window)
                                         : std::string("the initial state"),
                              first, target - 1));
  }
  if (log_ != nullptr) {
    const region_member& m0 = r.members.front();
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "recovery_start")
                    .add("recovery", recovery_->resume ? "resume"
                                     : durable         ? "durable"
                                                       : "region")
                    .add("stage", m0.lost.stage)
                    .add("replica", m0.lost.replica)
                    .add("lost_node", std::int64_t{m0.lost.node})
                    .add("spare_node", std::int64_t{m0.spare})
                    .add("first_stage", r.first)
                    .add("last_stage", r.last)
                    .add("roles", roles)
                    .add("spares", spares)
                    .add("generation", std::int64_t(r.generation))
                    .add("restarts", r.restarts)
                    .add("region", std::int64_t(r.id))
                    .add("supervision", r.cause)
                    .add("target_iteration", target)
                    .add("window", has_window ? std::int64_t(window) : std::int64_t{-1})
                    .add("replay_from", first)
                    .add("time_s", log_->seconds()));
  }
}

void coordinator::send_restores(const region& r) {
  const auto [target, durable, has_window, window, first] = restore_point();
  announce_restart(r);
  // Where the region's stage replicas find their windows, and the logs of the healthy stages
  // just outside it (no region touches another, so those are never being rebuilt).
  std::vector<actor_ref> holders;
  for (const auto& [n, w] : workers_) {
    if (w.replicator.valid()) holders.push_back(w.replicator);
  }
  auto agent_of = [&](int s, int d) -> actor_ref {
    if (s < 0 || s >= job_.pp) return {};
    for (const auto& [n, w] : workers_) {
      if (w.stage == s && w.replica == d && member_of(n).first == nullptr) return w.checkpoint;
    }
    return {};
  };
  std::vector<std::pair<std::int64_t, planned_step>> steps;
  for (auto it = steps_.lower_bound(first); it != steps_.end() && it->first < target; ++it) {
    steps.emplace_back(it->first, it->second);
  }
  const int w_sparse = w_sparse_, dp = job_.dp, k = r.last - r.first + 1;
  const actor_ref me = self();
  const std::map<std::string, int> per_host = restores_per_host();
  // Every replica of the region's stages is a member (add_group_survivors): each replays its
  // own. Not for a resume at another layout (it replays the old layout whole).
  const bool group = group_replay() && recovery_->window_pp == 0 &&
                     r.members.size() == std::size_t((r.last - r.first + 1) * dp);
  if (group) {
    // A member's agent may still be in the previous generation's replay, waiting for a peer
    // this one replaced: its exchange hears first, and that wait ends.
    for (const region_member& m : r.members) {
      (void)tell<wire::ReplayGeneration>(
          workers_.at(m.spare).group_exchange,
          [&](wire::ReplayGeneration::Builder b) { b.setGeneration(r.generation); });
    }
  }
  for (const region_member& m : r.members) {
    auto fill = [&](wire::Restore::Builder b) {
      b.setStage(m.lost.stage);
      b.setReplica(m.lost.replica);
      b.setFirstStage(r.first);
      b.setLastStage(r.last);
      b.setGeneration(r.generation);
      b.setTargetIteration(target);
      b.setHasWindow(has_window);
      b.setWindow(window);
      b.setFirstIteration(first);
      b.setWSparse(w_sparse);
      b.setDurable(durable);
      const auto share = per_host.find(workers_.at(m.spare).host);
      b.setHostShare(share == per_host.end() ? 1 : share->second);
      b.setWindowStages(recovery_->window_pp);
      b.setWindowReplicas(recovery_->window_dp);
      auto src = b.initSources(static_cast<unsigned>(k * dp));
      for (int j = 0; j < k; ++j) {
        for (int d = 0; d < dp; ++d) {
          auto e = src[unsigned(j * dp + d)];
          // The durable tier: everything from files; no peer is pulled from, and no survivor's
          // schedule is taken over (every replica of every stage starts a fresh one alike).
          const auto& use = durable ? std::vector<actor_ref>{} : holders;
          auto h = e.initSlotHolders(static_cast<unsigned>(use.size()));
          for (unsigned i = 0; i < use.size(); ++i) write_ref(h[i], use[i]);
          write_ref(e.initUpstream(), j == 0 && !durable ? agent_of(r.first - 1, d) : actor_ref{});
          write_ref(e.initDownstream(),
                    j == k - 1 && !durable ? agent_of(r.last + 1, d) : actor_ref{});
          write_ref(e.initSurvivor(), durable ? actor_ref{} : agent_of(r.first + j, d));
        }
      }
      auto l = b.initSteps(static_cast<unsigned>(steps.size()));
      for (unsigned i = 0; i < steps.size(); ++i) {
        l[i].setIteration(steps[i].first);
        l[i].setLossScale(steps[i].second.loss_scale);
        l[i].setApply(steps[i].second.plan.apply);
        l[i].setGradMul(steps[i].second.plan.grad_mul);
        l[i].setGradNorm(steps[i].second.plan.grad_norm);
      }
      write_ref(b.initCoordinator(), me);
      if (group) {
        // The exchanges of this member's stage's group: replica d's worker, by replica.
        auto g = b.initGroup(static_cast<unsigned>(dp));
        for (const region_member& o : r.members) {
          if (o.lost.stage == m.lost.stage) {
            write_ref(g[unsigned(o.lost.replica)], workers_.at(o.spare).group_exchange);
          }
        }
      }
    };
    (void)tell<wire::Restore>(workers_.at(m.spare).agent, fill);
  }
  if (callbacks_.on_recovery) callbacks_.on_recovery("recovery_start", target);
}

void coordinator::report_recovery_end(const recovery_state& rec) {
  const auto now = sclock::now();
  const double secs = std::chrono::duration<double>(now - rec.detected).count();
  auto since = [](sclock::time_point a, sclock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  for (const region& r : rec.regions) {
    double pull = 0.0, replay = 0.0;
    std::int64_t replayed = 0, mapped = 0, pulled = 0, refused = 0;
    std::string spares, replays, replacements;
    for (const region_member& m : r.members) {
      if (m.spare != m.lost.node) {
        replacements += fmt::format("{}{}", replacements.empty() ? "" : ",", m.spare);
      }
      // Who replayed what: stage/replica@worker, its replay seconds and GEMM threads.
      replays += fmt::format("{}{}/{}@{}:{:.3f}s:{}t", replays.empty() ? "" : ",", m.lost.stage,
                             m.lost.replica, m.spare, m.replay_s, m.replay_threads);
      mapped += m.slots_mapped;
      pulled += m.slots_pulled;
      refused += m.handles_refused;
      pull = std::max(pull, m.pull_s);
      replay = std::max(replay, m.replay_s);
      replayed = std::max(replayed, m.replayed);
      spares += fmt::format("{}{}", spares.empty() ? "" : ",", m.spare);
    }
    if (log_ != nullptr) {
      const region_member& m0 = r.members.front();
      // seconds = detect .. resume; spawn = until this generation's Restores went out (the
      // survivors' abort, earlier generations of the region); pull and replay as the slowest
      // replacement reported them; rejoin = its report .. everyone rewired.
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "recovery_end")
                      .add("recovery", rec.resume    ? "resume"
                                       : rec.durable ? "durable"
                                                     : "region")
                      .add("window", rec.durable ? std::int64_t(rec.durable_window) : -1)
                      .add("stage", m0.lost.stage)
                      .add("replica", m0.lost.replica)
                      .add("spare_node", std::int64_t{m0.spare})
                      .add("first_stage", r.first)
                      .add("last_stage", r.last)
                      .add("spares", spares)
                      .add("generation", std::int64_t(r.generation))
                      .add("restarts", r.restarts)
                      .add("target_iteration", rec.target)
                      .add("iterations_replayed", replayed)
                      .add("seconds", secs)
                      .add("spawn_s", since(rec.detected, r.started))
                      .add("pull_s", pull)
                      .add("replay_s", replay)
                      .add("replays", replays)
                      .add("rejoin_s", since(r.ready_at, now))
                      .add("slots_mapped", mapped)
                      .add("slots_pulled", pulled)
                      .add("handles_refused", refused)
                      .add("group_abort_s", rec.group_abort_s)
                      .add("time_s", log_->seconds()));
    }
    if (callbacks_.on_notice && rec.resume) {
      callbacks_.on_notice(fmt::format(
          "resumed from window {} in {:.2f} s (replay {:.3f} s, {} iterations replayed); "
          "training goes on at iteration {}",
          rec.durable_window, secs, replay, replayed, rec.target));
    } else if (callbacks_.on_notice) {
      const bool group = replacements != spares;
      callbacks_.on_notice(fmt::format(
          "{} recovered on worker{} {}{} in {:.2f} s (pull {:.3f} s, replay {:.3f} s, {} "
          "iteration{} replayed); training resumes at iteration {}",
          r.first == r.last ? fmt::format("stage {}", r.first)
                            : fmt::format("stages {}..{}", r.first, r.last),
          replacements.find(',') != std::string::npos ? "s" : "", replacements,
          group ? fmt::format(" (its group replayed on workers {})", spares) : std::string(), secs,
          pull, replay, replayed, replayed == 1 ? "" : "s", rec.target));
    }
  }
}

awaitable<void> coordinator::maybe_finish_recovery() {
  if (!recovery_ || !recovery_->pending.empty()) co_return;
  if (rolls_back_) {
    for (const auto& b : recovery_->rebuilds) {
      if (!b.ready) co_return;
    }
    co_await finish_rollback();
    co_return;
  }
  for (const region& r : recovery_->regions) {
    if (r.restarting || r.generation == 0) co_return;
    for (const region_member& m : r.members) {
      if (!m.ready) co_return;
    }
  }
  // A loss during the rewiring makes wire_all() false; its turn, queued behind this one,
  // grows or adds a region.
  const bool wired = co_await wire_all();
  if (!wired || finished_) co_return;
  // Every region is back: the tree under the job goes (the stages it rebuilt stay).
  stop_supervisors();
  const recovery_state rec = std::move(*recovery_);
  recovery_.reset();
  if (!rec.resume) ++recoveries_;
  // A durable write in flight may never be answered by a lost stage: the next persisted
  // window is written instead.
  durable_inflight_.reset();
  if (rec.window_pp != 0) {
    // Resumed at another layout: the windows on disk are of the old one, which no restore of
    // this job reads again. Until the first window of this layout persists, a loss stops
    // the job (recover() says so); a new --resume brings it back.
    durable_windows_.clear();
    persisted_.reset();
    persisted_first_ = 0;
  }
  durable_from_ = rec.target;  // the rebuilt stages capture from here on
  maybe_persist();             // windows the stages finished replicating meanwhile
  if (can_recover_) {
    for (const auto& [n, w] : workers_) {
      if (!w.checkpoint.valid()) continue;
      (void)tell<wire::WindowsAbandoned>(
          w.checkpoint, [&](wire::WindowsAbandoned::Builder b) { b.setBefore(rec.target); });
    }
  }
  report_recovery_end(rec);
  phase_ = phase::running;
  if (callbacks_.on_recovery) callbacks_.on_recovery("recovery_end", rec.target);
  if (rec.resume_validation || iteration_ >= job_.train.iterations) {
    // The validation round is run again; or a resume of a job that had trained every
    // iteration: only what follows the last one (validation, the digests) is left.
    co_await after_iteration();
  } else {
    start_iteration();  // the target iteration, under a new epoch
  }
}

}  // namespace moevement::engine
