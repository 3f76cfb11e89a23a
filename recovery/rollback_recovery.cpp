#include "recovery/rollback_recovery.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include "actors/gather.hpp"
#include "engine/spare_choice.hpp"
#include "recovery/dense_capture.hpp"
#include "recovery/policy_config.hpp"
#include "recovery/region_recovery.hpp"
#include "recovery/region_supervisor.hpp"

namespace moevement::recovery {

namespace {

using actors::actor_ref;
using actors::write_ref;
using asio::awaitable;

// Loading a checkpoint can mean reading it from disk: longer than an ordinary ask.
constexpr auto rollback_timeout = std::chrono::seconds(300);
// Loss scaler states kept for checkpoint points (a rollback goes back to one of the newest).
constexpr std::size_t scalers_kept = 64;

models::loss_scaler initial_scaler(const engine::job_config& job) {
  models::loss_scaler s;
  s.enabled = job.model.compute_dtype == models::dtype::f16;
  s.scale = s.enabled ? job.train.loss_scale : 1.0f;
  s.window = job.train.loss_scale_window;
  return s;
}

}  // namespace

engine::head_recovery_factory any_head_recovery(engine::policy_kind policy) {
  switch (engine::recovery_of(policy)) {
    case engine::recovery_kind::localized:
      return [](engine::head_control& job) { return std::make_unique<region_recovery>(job); };
    case engine::recovery_kind::rollback:
      return [](engine::head_control& job) { return std::make_unique<rollback_recovery>(job); };
    default:
      return {};
  }
}

engine::checkpoint_place rollback_recovery::planned(const engine::planned_iteration& it) {
  const auto& job = job_.job();
  if (interval_ == 0) {
    // One k job-wide, decided after the first iteration's profile, so that one iteration is
    // checkpointed on every stage.
    double snapshot_s = 0.0;
    if (job.baseline.interval > 0) {
      interval_ = job.baseline.interval;
    } else {
      // Young's C: the slowest stage's full snapshot (master, m, v of every operator) at the
      // bandwidth it measured; the stages checkpoint in parallel.
      for (const auto& [n, w] : job_.workers()) {
        if (w.stage < 0 || w.snapshot_bandwidth <= 0) continue;
        double bytes = 0;
        for (const auto& o : w.op_sizes) bytes += double(o.master_bytes + o.optim_bytes);
        snapshot_s = std::max(snapshot_s, bytes / w.snapshot_bandwidth);
      }
      interval_ = it.seconds > 0 ? std::max(1, resolve_interval(policy_config_of(job.baseline),
                                                                snapshot_s, it.seconds))
                                 : 1;
    }
    scaler_at_[0] = initial_scaler(job);
    if (auto* log = job_.log()) {
      log->write(engine::json_record{}
                     .add("kind", "event")
                     .add("event", "interval_chosen")
                     .add("interval", interval_)
                     .add("snapshot_s", snapshot_s)
                     .add("profile_iteration_s", it.seconds)
                     .add("mtbf_s", job.baseline.mtbf_s)
                     .add("iteration", it.iteration));
    }
  }
  // The scaler after this step is the one a rollback to iteration + 1 resumes with.
  if ((it.iteration + 1) % interval_ == 0) {
    scaler_at_[it.iteration + 1] = it.scaler;
    while (scaler_at_.size() > scalers_kept) scaler_at_.erase(std::next(scaler_at_.begin()));
  }
  return {interval_, 0, 0};
}

awaitable<void> rollback_recovery::lost(engine::worker_info w) {
  if (!state_) {
    state_.emplace();
    state_->detected = sclock::now();
  }
  state_->pending.push_back(std::move(w));
  co_await start();
}

bool rollback_recovery::involves(transport::node_id n) const {
  if (!state_) return false;
  return state_->replaced.contains(n) || std::any_of(state_->roles.begin(), state_->roles.end(),
                                                     [&](const role& r) { return r.worker == n; });
}

awaitable<void> rollback_recovery::lost_member(transport::node_id n) {
  // Its child under the region's supervisor ends with it: the supervisor restarts the region
  // (region_restart gives the role a spare), and a loading in progress gives up.
  state_->restarting = true;
  for (role& r : state_->roles) {
    if (r.worker == n) r.ready = false;
  }
  co_return;
}

bool rollback_recovery::rebuilding(transport::node_id n) const {
  return state_ && std::any_of(state_->roles.begin(), state_->roles.end(),
                               [&](const role& r) { return r.worker == n && r.fresh; });
}

bool rollback_recovery::current(transport::node_id n, std::uint64_t generation) const {
  // Not an older generation's report. One that comes while the region is about to restart
  // counts: a restart gives a fresh stage still up no new Restore, so it never reports again
  // (maybe_finish waits for the restart's own Restores).
  if (!state_) return false;
  return std::any_of(state_->roles.begin(), state_->roles.end(), [&](const role& r) {
    return r.worker == n && r.fresh && r.generation == generation;
  });
}

awaitable<void> rollback_recovery::resume(const engine::resume_point&) {
  job_.fail("--resume needs checkpoint.policy = \"moevement\" with checkpoint.durable = true");
  co_return;
}

awaitable<void> rollback_recovery::restore_failed(transport::node_id, const std::string& message,
                                                  bool) {
  // Its stage could not be built, usually because a peer died meanwhile: that loss, within
  // the failure timeout, restarts the rollback (any loss does: it spans the pipeline).
  co_await job_.actor().system().sleep_for(
      std::chrono::milliseconds(job_.job().failure_timeout_ms + 200));
  if (job_.finished() || job_.loss_pending() || !state_) co_return;
  job_.fail(message);
}

awaitable<void> rollback_recovery::restored(transport::node_id n,
                                            engine::wire::StageReady::Reader) {
  if (!state_) co_return;
  for (role& r : state_->roles) {
    if (r.worker == n && r.fresh) r.ready = true;
  }
  co_await maybe_finish();
}

awaitable<void> rollback_recovery::maybe_finish() {
  if (!state_ || state_->restarting || state_->attempt == 0) co_return;
  for (const role& r : state_->roles) {
    if (r.fresh && !r.ready) co_return;
  }
  co_await finish();
}

awaitable<void> rollback_recovery::start() {
  if (job_.finished() || !state_) co_return;
  if (!state_->begun) {
    // The whole job goes back, once the survivors stepped.
    if (job_.stepping()) {
      co_await job_.finish_stepping();  // go_on() once they have
      co_return;
    }
    state_->begun = true;
    state_->target = job_.iteration();
    // (false: the job ended, or stages lost meanwhile, whose turns place every loss at once)
    if (!co_await job_.hold_training(state_->group_abort_s)) co_return;
  }
  if (state_->pending.empty() || state_->supervisor.valid()) co_return;
  // One region: every role of the pipeline (the survivors load the checkpoint too), the lost
  // ones without a worker until the supervisor's first start gives them spares.
  for (const auto& [n, w] : job_.workers()) {
    if (w.stage >= 0) state_->roles.push_back({w, n});
  }
  for (const engine::worker_info& w : state_->pending) state_->roles.push_back({w, 0});
  state_->pending.clear();
  state_->nodes = std::make_shared<std::vector<transport::node_id>>();
  state_->supervisor = tree_.start_region(++region_ids_, state_->nodes, state_->roles.size());
}

void rollback_recovery::stop_supervisor() {
  if (state_) tree_.stop_region(state_->supervisor);
}

awaitable<void> rollback_recovery::escalated(std::uint64_t region, std::string reason) {
  if (!state_ || region != region_ids_ || !state_->supervisor.valid()) co_return;  // stale
  state_->supervisor = {};
  job_.fail(fmt::format(
      "the rollback of the whole job restarted {} times, past checkpoint.region_restarts = {}: "
      "{}",
      state_->attempt, job_.job().region_restarts, reason));
  co_return;
}

awaitable<void> rollback_recovery::region_restart(engine::wire::RegionRestart::Reader m,
                                                  engine::wire::RegionMembers::Builder out) {
  if (!state_ || m.getRegion() != region_ids_ || !state_->supervisor.valid()) {
    out.setError("the rollback ended");
    co_return;
  }
  // A new attempt: every role whose worker is gone gets a spare and a fresh stage; the fresh
  // stages still up keep theirs; the loading starts over once all of them report.
  state_->restarting = false;
  ++state_->attempt;
  if (!give_spares()) {
    out.setError("the job stops");
    co_return;
  }
  auto nodes = out.initNodes(static_cast<unsigned>(state_->roles.size()));
  for (unsigned i = 0; i < state_->roles.size(); ++i) nodes.set(i, state_->roles[i].worker);
}

bool rollback_recovery::give_spares() {
  const auto& job = job_.job();
  const bool again = state_->attempt > 1;
  const std::int64_t failed_at = state_->target;
  for (role& r : state_->roles) {
    if (r.worker != 0) {
      if (job_.workers().contains(r.worker) &&
          job_.actor().system().last_heard(r.worker).has_value()) {
        continue;
      }
      state_->replaced.insert(r.worker);
      r.lost.node = r.worker;  // the worker that died, for the notice
      if (!r.worker_domain.empty()) r.lost.domain = r.worker_domain;
    }
    const transport::node_id spare = engine::choose_spare(
        job_.workers(), r.lost.domain,
        [&](transport::node_id n) { return job_.actor().system().last_heard(n).has_value(); });
    if (spare == 0) {
      job_.fail(
          fmt::format("stage {} replica {} was lost and no spare worker is left (raise "
                      "cluster.spares)",
                      r.lost.stage, r.lost.replica));
      return false;
    }
    engine::worker_info& sw = job_.worker_roles().at(spare);
    sw.stage = r.lost.stage;
    sw.replica = r.lost.replica;
    r.worker = spare;
    r.worker_domain = sw.domain;
    r.fresh = true;
    r.ready = false;
    r.generation = state_->attempt;
    job_.notice(fmt::format(
        "stage {} replica {} lost (worker {}) at iteration {}{}; policy {}: a fresh stage on "
        "spare worker {}, then every stage rolls back to the last checkpoint",
        r.lost.stage, r.lost.replica, r.lost.node, failed_at, again ? ", during the rollback" : "",
        engine::policy_name(job.policy), spare));
    if (auto* log = job_.log()) {
      log->write(engine::json_record{}
                     .add("kind", "event")
                     .add("event", "recovery_start")
                     .add("recovery", "rollback")
                     .add("policy", engine::policy_name(job.policy))
                     .add("stage", r.lost.stage)
                     .add("replica", r.lost.replica)
                     .add("lost_node", std::int64_t{r.lost.node})
                     .add("spare_node", std::int64_t{spare})
                     .add("target_iteration", failed_at)
                     .add("attempt", std::int64_t(state_->attempt)));
    }
    const actor_ref me = job_.actor().self();
    const int st = r.lost.stage, rep = r.lost.replica;
    const std::uint64_t generation = state_->attempt;
    (void)job_.actor().tell<engine::wire::Restore>(sw.agent, [&](engine::wire::Restore::Builder b) {
      b.setStage(st);
      b.setReplica(rep);
      b.setGeneration(generation);
      b.setTargetIteration(failed_at);
      b.setHasWindow(false);
      write_ref(b.initCoordinator(), me);
    });
    if (!again) job_.recovery_event("recovery_start", failed_at);
  }
  return true;
}

awaitable<std::optional<rollback_recovery::chosen>> rollback_recovery::choose_checkpoint(
    const std::vector<actor_ref>& agents, const std::vector<actor_ref>& holders,
    std::int64_t target) {
  const int pp = job_.job().pp;
  std::map<std::int64_t, int> offered;
  std::vector<std::string> rejected;
  auto fill = [&](std::size_t, engine::wire::RollbackQuery::Builder b) {
    auto l = b.initHolders(static_cast<unsigned>(holders.size()));
    for (unsigned i = 0; i < holders.size(); ++i) write_ref(l[i], holders[i]);
  };
  auto replies = co_await actors::ask_all<engine::wire::RollbackQuery, engine::wire::RollbackOffer>(
      job_.actor(), agents, rollback_timeout, fill);
  if (job_.finished() || !state_) co_return std::nullopt;
  for (std::size_t i = 0; i < replies.size(); ++i) {
    const int s = int(i) % pp, d = int(i) / pp;
    auto& r = replies[i];
    if (!r.ok()) {
      if (co_await job_.loss_follows() || job_.finished()) co_return std::nullopt;
      job_.fail(fmt::format("asking stage {} replica {} for its checkpoints failed: {}", s, d,
                            r.err().message));
      co_return std::nullopt;
    }
    std::set<std::int64_t> mine;  // each stage counts once per iteration
    for (auto it : r->get().getIterations()) mine.insert(it);
    for (auto it : mine) ++offered[it];
    for (auto t : r->get().getRejected()) {
      rejected.push_back(fmt::format("stage {} replica {}: {}", s, d, std::string(t)));
    }
  }
  std::int64_t c = -1;
  for (const auto& [it, n] : offered) {
    if (n == int(agents.size()) && it <= target && scaler_at_.contains(it)) c = it;
  }
  job_.report_rejected("checkpoint_rejected", "checkpoint", rejected);
  if (c < 0) {
    job_.fail(fmt::format("no checkpoint is loadable on every stage ({} rejected); the job stops",
                          rejected.size()));
    co_return std::nullopt;
  }
  co_return chosen{c, std::int64_t(rejected.size())};
}

awaitable<void> rollback_recovery::finish() {
  const state rec = *state_;
  const auto& job = job_.job();
  // A loss not placed yet, or one while this runs (its ask fails, or its node leaves the
  // membership), leaves the rest to its turn: the lost stage is rebuilt and this starts over.
  auto superseded = [&] {
    return job_.finished() || !state_ || state_->attempt != rec.attempt || state_->restarting ||
           !state_->pending.empty() || job_.loss_pending();
  };
  if (superseded()) co_return;
  const bool wired = co_await job_.rewire();
  if (!wired || superseded()) co_return;
  // Detection to a wired job (the replacement built, every link up) vs. the checkpoint's query
  // and load: the simulator's restart and load (docs/simulator.md, "Profile file").
  const auto t_wired = sclock::now();
  std::vector<actor_ref> holders;
  for (const auto& [n, w] : job_.workers()) {
    if (w.replicator.valid()) holders.push_back(w.replicator);
  }
  auto agent_at = [&](int s, int d) -> actor_ref {
    for (const auto& [n, w] : job_.workers()) {
      if (w.stage == s && w.replica == d) return w.checkpoint;
    }
    return {};
  };
  std::vector<actor_ref> agents;  // index d * pp + s
  for (int d = 0; d < job.dp; ++d) {
    for (int s = 0; s < job.pp; ++s) agents.push_back(agent_at(s, d));
  }
  // 1. What each stage can load, verified by the stage itself (every stage at once).
  const auto pick = co_await choose_checkpoint(agents, holders, rec.target);
  if (!pick || superseded()) co_return;
  const std::int64_t c = pick->iteration;
  // 2. Every stage loads it, all at once.
  loaded got;
  {
    const int k = std::max(interval_, 1);
    auto fill = [&](std::size_t, engine::wire::RollbackLoad::Builder b) {
      b.setIteration(c);
      b.setInterval(k);
    };
    auto replies =
        co_await actors::ask_all<engine::wire::RollbackLoad, engine::wire::RollbackLoaded>(
            job_.actor(), agents, rollback_timeout, fill);
    if (superseded()) co_return;
    std::vector<std::vector<std::int64_t>> stage_lost(std::size_t(job.pp));  // pec: by layer
    for (std::size_t i = 0; i < replies.size(); ++i) {
      const int s = int(i) % job.pp, d = int(i) / job.pp;
      auto& r = replies[i];
      if (!r.ok() && (co_await job_.loss_follows() || superseded())) co_return;
      if (!r.ok() || r->get().getError().size() > 0) {
        job_.fail(fmt::format("stage {} replica {} could not roll back to iteration {}: {}", s, d,
                              c, r.ok() ? std::string(r->get().getError()) : r.err().message));
        co_return;
      }
      got.bytes += r->get().getBytes();
      if (d < job.ep) {
        // Replicas count the same tokens (summed over replicas), and the first EP group's
        // ranks hold every expert once (one rank, all of them, without EP).
        const auto lost = r->get().getLostTokens();
        auto& layers = stage_lost[std::size_t(s)];
        layers.resize(std::max<std::size_t>(layers.size(), lost.size()));
        for (unsigned l = 0; l < lost.size(); ++l) layers[l] += lost[l];
        got.stale += r->get().getStaleExperts();
      }
      got.sources += (got.sources.empty() ? "" : "; ") + std::string(r->get().getSource());
    }
    for (const auto& layers : stage_lost) {
      got.lost_per_layer.insert(got.lost_per_layer.end(), layers.begin(), layers.end());
    }
  }
  stop_supervisor();  // the region is back: its tree goes (the stages it rebuilt stay)
  state_.reset();
  report_end(rec, c, pick->rejected, got, t_wired);
  engine::recovery_done done;
  done.target = c;
  done.rolled_back = scaler_at_.at(c);
  co_await job_.recovered(done);
}

void rollback_recovery::report_end(const state& rec, std::int64_t c, std::int64_t rejected,
                                   const loaded& got, sclock::time_point t_wired) {
  const auto& job = job_.job();
  const auto t_loaded = sclock::now();
  const double secs = std::chrono::duration<double>(t_loaded - rec.detected).count();
  std::string rebuilt;  // stage/replica@worker of every stage rebuilt
  std::vector<const role*> fresh;
  for (const role& r : rec.roles) {
    if (r.fresh) fresh.push_back(&r);
  }
  for (const role* b : fresh) {
    rebuilt += fmt::format("{}{}/{}@{}", rebuilt.empty() ? "" : ",", b->lost.stage, b->lost.replica,
                           b->worker);
  }
  engine::json_record end;
  end.add("kind", "event")
      .add("event", "recovery_end")
      .add("recovery", "rollback")
      .add("policy", engine::policy_name(job.policy))
      .add("stage", fresh.front()->lost.stage)
      .add("replica", fresh.front()->lost.replica)
      .add("spare_node", std::int64_t{fresh.front()->worker})
      .add("rebuilt", rebuilt)
      .add("restarts", std::int64_t(rec.attempt) - 1)
      .add("group_abort_s", rec.group_abort_s)
      .add("target_iteration", rec.target)
      .add("rollback_to", c)
      .add("replay_from", c)
      .add("iterations_recomputed", rec.target - c)
      .add("checkpoint_bytes", got.bytes)
      .add("rejected", rejected)
      .add("sources", got.sources)
      .add("seconds", secs)
      .add("restore_s", std::chrono::duration<double>(t_wired - rec.detected).count())
      .add("load_s", std::chrono::duration<double>(t_loaded - t_wired).count());
  std::string pec_line;
  if (job.policy == engine::policy_kind::pec) {
    // PLT (seed 002): mean over MoE layers of the tokens routed to stale experts over the
    // tokens x top_k the layer saw: of this fault over iterations [0, failed), and of the run
    // so far over the whole training's tokens.
    const double per_iteration = double(job.train.micro_batches) * job.train.micro_batch_size *
                                 job.train.seq_len * job.dp * job.model.top_k;
    std::int64_t lost = 0;
    double plt = 0.0;
    for (auto n : got.lost_per_layer) {
      lost += n;
      if (rec.target > 0) plt += double(n) / (per_iteration * double(rec.target));
    }
    const double layers = double(std::max<std::size_t>(got.lost_per_layer.size(), 1));
    plt /= layers;
    lost_tokens_total_ += lost;
    const double run_plt =
        double(lost_tokens_total_) / (layers * per_iteration * double(job.train.iterations));
    std::string per_layer;
    for (auto n : got.lost_per_layer) {
      per_layer += (per_layer.empty() ? "" : ",") + std::to_string(n);
    }
    end.add("lost_tokens", lost)
        .add("lost_tokens_per_layer", per_layer)
        .add("stale_experts", got.stale)
        .add("moe_layers", std::int64_t(got.lost_per_layer.size()))
        .add("plt", plt)
        .add("run_plt", run_plt);
    pec_line = fmt::format(
        "; {} stale expert(s), {} token routings lost (over every MoE layer), PLT {:.6f}",
        got.stale, lost, plt);
  }
  if (auto* log = job_.log()) log->write(end);
  job_.notice(fmt::format(
      "{} rebuilt ({}); every stage rolled back to iteration {} in {:.2f} s ({} iteration(s) to "
      "recompute){}",
      fresh.size() == 1 ? fmt::format("stage {} replica {}", fresh.front()->lost.stage,
                                      fresh.front()->lost.replica)
                        : fmt::format("{} stages", fresh.size()),
      rebuilt, c, secs, rec.target - c, pec_line));
}

}  // namespace moevement::recovery
