// The Restores of a region's generation (what each member restores from, and from whom), and
// what the operator and the run log hear of a recovery's start and end.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <utility>

#include "recovery/region_recovery.hpp"

namespace moevement::recovery {

using actors::actor_ref;

std::map<std::string, int> region_recovery::restores_per_host() const {
  const auto& workers = job_.worker_roles();
  std::map<std::string, int> out;
  if (!state_) return out;
  for (const region& r : state_->regions) {
    for (const member& m : r.members) {
      const auto w = workers.find(m.spare);
      if (m.spare != 0 && !m.ready && w != workers.end()) ++out[w->second.host];
    }
  }
  return out;
}

region_recovery::restore_from region_recovery::restore_point() const {
  restore_from p;
  p.target = state_->target;
  p.durable = state_->durable;
  p.has_window = p.durable || windows_.persisted().has_value();
  p.window = p.durable ? state_->durable_window : windows_.persisted().value_or(0);
  p.first = p.durable ? state_->durable_first : p.has_window ? windows_.persisted_first() : 0;
  return p;
}

void region_recovery::announce_restart(const region& r) {
  engine::run_log* const log = job_.log();
  const auto [target, durable, has_window, window, first] = restore_point();
  std::string roles, spares, replacements;
  for (const member& m : r.members) {
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
  {
    // Who died for this generation (placed by recover()); every role's first loss otherwise.
    std::string lost;
    for (const std::string& d : r.died) lost += (lost.empty() ? "" : ", ") + d;
    if (lost.empty()) {
      for (const member& m : r.members) {
        lost += fmt::format("{}stage {} replica {} (worker {})", lost.empty() ? "" : ", ",
                            m.lost.stage, m.lost.replica, m.lost.node);
      }
    }
    // "iterations 5..7", or nothing when the window holds the target's state already.
    const std::string replaying =
        first <= target - 1 ? fmt::format("replaying iterations {}..{}", first, target - 1)
                            : std::string("nothing to replay");
    job_.notice(
        durable ? fmt::format("{} durable window {} on workers {} ({})",
                              state_->resume ? "resuming from" : "rolling the whole job back to",
                              window, spares, replaying)
                : fmt::format("{} lost; {}rebuilding {} on spare worker{} {}{} from {} ({})", lost,
                              r.restarts == 0                       ? ""
                              : std::string_view(r.cause) == "grew" ? "the recovery grew: "
                                                                    : "the recovery restarts: ",
                              stages, rebuilt > 1 ? "s" : "", replacements,
                              replacements == spares
                                  ? std::string()
                                  : fmt::format(", the group replaying on workers {}", spares),
                              has_window ? fmt::format("window {}", window)
                                         : std::string("the initial state"),
                              replaying));
  }
  if (log != nullptr) {
    const member& m0 = r.members.front();
    log->write(engine::json_record{}
                   .add("kind", "event")
                   .add("event", "recovery_start")
                   .add("recovery", state_->resume ? "resume"
                                    : durable      ? "durable"
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
                   .add("time_s", log->seconds()));
  }
}

bool region_recovery::replays_as_group(const region& r) const {
  return group_replay(r) && state_->window_pp == 0 &&
         r.members.size() == std::size_t((r.last - r.first + 1) * job_.job().dp);
}

bool region_recovery::replays_as_pipeline(const region& r) const {
  // A joint region replays as a pipeline: each member its own stage, the tensors between the
  // region's stages passing live between their members (every role a member, each with an
  // exchange; recovery/group_replay.hpp boundary_exchange).
  const int k = r.last - r.first + 1, dp = job_.job().dp;
  const bool group = replays_as_group(r);
  const auto& workers = job_.workers();
  return job_.job().pipelined_replay && k > 1 && state_->window_pp == 0 && (group || dp == 1) &&
         r.members.size() == std::size_t(k * (group ? dp : 1)) &&
         std::all_of(r.members.begin(), r.members.end(), [&](const member& m) {
           const auto w = workers.find(m.spare);
           return w != workers.end() && w->second.group_exchange.valid();
         });
}

actor_ref region_recovery::outside_agent(int s, int d) const {
  if (s < 0 || s >= job_.job().pp) return {};
  for (const auto& [n, w] : job_.worker_roles()) {
    if (w.stage == s && w.replica == d && member_of(n).first == nullptr) return w.checkpoint;
  }
  return {};
}

void region_recovery::write_sources(engine::wire::Restore::Builder b, const region& r,
                                    const std::vector<actor_ref>& holders, bool peers,
                                    std::int64_t first) const {
  const int dp = job_.job().dp, k = r.last - r.first + 1;
  auto src = b.initSources(static_cast<unsigned>(k * dp));
  for (int j = 0; j < k; ++j) {
    for (int d = 0; d < dp; ++d) {
      auto e = src[unsigned(j * dp + d)];
      auto h = e.initSlotHolders(static_cast<unsigned>(holders.size()));
      for (unsigned i = 0; i < holders.size(); ++i) actors::write_ref(h[i], holders[i]);
      actors::write_ref(e.initUpstream(),
                        j == 0 && peers ? outside_agent(r.first - 1, d) : actor_ref{});
      actors::write_ref(e.initDownstream(),
                        j == k - 1 && peers ? outside_agent(r.last + 1, d) : actor_ref{});
      actors::write_ref(e.initSurvivor(), peers ? outside_agent(r.first + j, d) : actor_ref{});
      // A replica fenced for silent corruption: its windows from before are not trusted.
      const auto u = untrusted_.find({r.first + j, d});
      if (peers && u != untrusted_.end() && first <= u->second.through) {
        e.setSlotsFrom(u->second.from);
      }
      // From disk: another replica's files where the role's own do not serve.
      if (!peers && state_ && state_->window_pp == 0) {  // (another layout: its workers')
        const auto f = state_->durable_from.find({r.first + j, d});
        if (f != state_->durable_from.end()) e.setSlotsFrom(f->second);
      }
    }
  }
}

void region_recovery::write_steps(engine::wire::Restore::Builder b, std::int64_t first,
                                  std::int64_t target) const {
  std::vector<std::pair<std::int64_t, engine::planned_step>> steps;
  for (auto it = windows_.steps().lower_bound(first);
       it != windows_.steps().end() && it->first < target; ++it) {
    steps.emplace_back(it->first, it->second);
  }
  auto l = b.initSteps(static_cast<unsigned>(steps.size()));
  for (unsigned i = 0; i < steps.size(); ++i) {
    l[i].setIteration(steps[i].first);
    l[i].setLossScale(steps[i].second.loss_scale);
    l[i].setApply(steps[i].second.plan.apply);
    l[i].setGradMul(steps[i].second.plan.grad_mul);
    l[i].setGradNorm(steps[i].second.plan.grad_norm);
  }
}

void region_recovery::send_restores(const region& r) {
  const auto& workers = job_.worker_roles();
  const auto& job = job_.job();
  const auto [target, durable, has_window, window, first] = restore_point();
  announce_restart(r);
  // Where the region's stage replicas find their windows, and the logs of the healthy stages
  // just outside it (no region touches another, so those are never being rebuilt).
  std::vector<actor_ref> holders;
  for (const auto& [n, w] : workers) {
    if (w.replicator.valid()) holders.push_back(w.replicator);
  }
  // The restored window's own W (it changes at a window's start: window_plan).
  const int w_sparse = has_window ? windows_.w_of(window) : windows_.w_sparse();
  const int k = r.last - r.first + 1;
  const actor_ref me = job_.actor().self();
  const std::map<std::string, int> per_host = restores_per_host();
  // Every replica of the region's stages is a member (add_group_survivors): each replays its
  // own. Not for a resume at another layout (it replays the old layout whole).
  const bool group = replays_as_group(r), pipeline = replays_as_pipeline(r);
  // A member's agent may still be in the previous generation's replay, waiting for a peer
  // this one replaced: its exchange hears first, and that wait ends. Also when this generation
  // replays otherwise (under expert parallelism a region grown to several stages replays whole
  // on each member, while the previous one replayed spread).
  for (const member& m : r.members) {
    const actor_ref exchange = workers.at(m.spare).group_exchange;
    if (!exchange.valid()) continue;
    (void)job_.actor().tell<engine::wire::ReplayGeneration>(
        exchange,
        [&](engine::wire::ReplayGeneration::Builder b) { b.setGeneration(r.generation); });
  }
  for (const member& m : r.members) {
    auto fill = [&](engine::wire::Restore::Builder b) {
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
      const auto share = per_host.find(workers.at(m.spare).host);
      b.setHostShare(share == per_host.end() ? 1 : share->second);
      b.setWindowStages(state_->window_pp);
      b.setWindowReplicas(state_->window_dp);
      b.setWindowEp(state_->window_ep);
      // The durable tier: everything from files; no peer is pulled from, and no survivor's
      // schedule is taken over (every replica of every stage starts a fresh one alike).
      write_sources(b, r, durable ? std::vector<actor_ref>{} : holders, !durable, first);
      write_steps(b, first, target);
      actors::write_ref(b.initCoordinator(), me);
      if (pipeline) {
        // The exchanges of this member's replica's region stages, by stage.
        auto l = b.initPipeline(static_cast<unsigned>(k));
        for (const member& o : r.members) {
          if (o.lost.replica == m.lost.replica) {
            actors::write_ref(l[unsigned(o.lost.stage - r.first)],
                              workers.at(o.spare).group_exchange);
          }
        }
      }
      if (group) {
        // The exchanges of this member's stage's group: replica d's worker, by replica.
        auto g = b.initGroup(static_cast<unsigned>(job.dp));
        for (const member& o : r.members) {
          if (o.lost.stage == m.lost.stage) {
            actors::write_ref(g[unsigned(o.lost.replica)], workers.at(o.spare).group_exchange);
          }
        }
      }
    };
    (void)job_.actor().tell<engine::wire::Restore>(workers.at(m.spare).agent, fill);
  }
  job_.recovery_event("recovery_start", target);
}

void region_recovery::report_end(const state& rec) const {
  engine::run_log* const log = job_.log();
  const auto now = sclock::now();
  const double secs = std::chrono::duration<double>(now - rec.detected).count();
  auto since = [](sclock::time_point a, sclock::time_point b) {
    return std::chrono::duration<double>(b - a).count();
  };
  for (const region& r : rec.regions) {
    double pull = 0.0, replay = 0.0;
    std::int64_t replayed = 0, mapped = 0, pulled = 0, refused = 0, corrupt = 0, pieces = 0;
    std::string spares, replays, replacements;
    for (const member& m : r.members) {
      if (m.spare != m.lost.node) {
        replacements += fmt::format("{}{}", replacements.empty() ? "" : ",", m.spare);
      }
      // Who replayed what: stage/replica@worker, its replay seconds and GEMM threads.
      replays += fmt::format("{}{}/{}@{}:{:.3f}s:{}t", replays.empty() ? "" : ",", m.lost.stage,
                             m.lost.replica, m.spare, m.replay_s, m.replay_threads);
      mapped += m.slots_mapped;
      pulled += m.slots_pulled;
      refused += m.handles_refused;
      corrupt += m.copies_refused;
      pieces += m.log_pieces;
      pull = std::max(pull, m.pull_s);
      replay = std::max(replay, m.replay_s);
      replayed = std::max(replayed, m.replayed);
      spares += fmt::format("{}{}", spares.empty() ? "" : ",", m.spare);
    }
    if (log != nullptr) {
      const member& m0 = r.members.front();
      // seconds = detect .. resume; spawn = until this generation's Restores went out (the
      // survivors' abort, earlier generations of the region); pull and replay as the slowest
      // replacement reported them; rejoin = its report .. everyone rewired.
      log->write(engine::json_record{}
                     .add("kind", "event")
                     .add("event", "recovery_end")
                     .add("recovery", rec.resume    ? "resume"
                                      : rec.durable ? "durable"
                                                    : "region")
                     // The window restored from, as recovery_start said (no window persists
                     // while a recovery pulls one).
                     .add("window", rec.durable            ? std::int64_t(rec.durable_window)
                                    : windows_.persisted() ? std::int64_t(*windows_.persisted())
                                                           : std::int64_t{-1})
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
                     .add("pipelined", replays_as_pipeline(r))
                     .add("rejoin_s", since(r.ready_at, now))
                     .add("slots_mapped", mapped)
                     .add("slots_pulled", pulled)
                     .add("handles_refused", refused)
                     .add("copies_refused", corrupt)
                     .add("log_pieces", pieces)
                     .add("group_abort_s", rec.group_abort_s)
                     .add("time_s", log->seconds()));
    }
    if (rec.resume) {
      job_.notice(fmt::format(
          "resumed from window {} in {:.2f} s (replay {:.3f} s, {} iterations replayed); "
          "training goes on at iteration {}",
          rec.durable_window, secs, replay, replayed, rec.target));
    } else {
      const bool group = replacements != spares;
      // A rollback past silent corruption with no worker replaced restores every stage in
      // place.
      const std::string where =
          replacements.empty()
              ? fmt::format("in place on workers {}", spares)
              : fmt::format("on worker{} {}{}",
                            replacements.find(',') != std::string::npos ? "s" : "", replacements,
                            group ? fmt::format(" (its group replayed on workers {})", spares)
                                  : std::string());
      job_.notice(
          fmt::format("{} recovered {} in {:.2f} s (pull {:.3f} s, replay {:.3f} s, {} iteration{} "
                      "replayed); training resumes at iteration {}",
                      r.first == r.last ? fmt::format("stage {}", r.first)
                                        : fmt::format("stages {}..{}", r.first, r.last),
                      where, secs, pull, replay, replayed, replayed == 1 ? "" : "s", rec.target));
    }
  }
}

}  // namespace moevement::recovery
