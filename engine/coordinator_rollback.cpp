// The coordinator's global rollback: how policies dense-memory, dense-disk and pec recover a
// lost worker (docs/policies.md). A spare takes the lost stage's role with a fresh stage;
// then every stage (survivors and the replacement) offers the checkpoints it can load,
// verified; the newest one every stage offers is loaded everywhere and the job recomputes
// from there. The checkpoint interval k is the coordinator's too: one k job-wide, so that one
// iteration is checkpointed on every stage.
#include <fmt/format.h>

#include <algorithm>
#include <set>

#include "engine/coordinator.hpp"

#include "actors/gather.hpp"

namespace moevement::engine {

namespace {

using actors::actor_ref;
using actors::write_ref;
using asio::awaitable;
using sclock = std::chrono::steady_clock;

// Loading a checkpoint can mean reading it from disk: longer than an ordinary ask.
constexpr auto rollback_timeout = std::chrono::seconds(300);
// Loss scaler states kept for checkpoint points (a rollback goes back to one of the newest).
constexpr std::size_t scalers_kept = 64;

}  // namespace

models::loss_scaler coordinator::initial_scaler() const {
  models::loss_scaler s;
  s.enabled = job_.model.compute_dtype == models::dtype::f16;
  s.scale = s.enabled ? job_.train.loss_scale : 1.0f;
  s.window = job_.train.loss_scale_window;
  return s;
}

int coordinator::checkpoint_interval() {
  if (interval_ == 0) {
    double snapshot_s = 0.0;
    const double iteration_s =
        std::chrono::duration<double>(sclock::now() - iteration_start_).count();
    if (job_.baseline.interval > 0) {
      interval_ = job_.baseline.interval;
    } else {
      // Young's C: the slowest stage's full snapshot (master, m, v of every operator) at the
      // bandwidth it measured; the stages checkpoint in parallel.
      for (const auto& [n, w] : workers_) {
        if (w.stage < 0 || w.snapshot_bandwidth <= 0) continue;
        double bytes = 0;
        for (const auto& o : w.op_sizes) bytes += double(o.master_bytes + o.optim_bytes);
        snapshot_s = std::max(snapshot_s, bytes / w.snapshot_bandwidth);
      }
      interval_ = callbacks_.choose_interval && iteration_s > 0
                      ? std::max(1, callbacks_.choose_interval(snapshot_s, iteration_s))
                      : 1;
    }
    scaler_at_[0] = initial_scaler();
    if (log_ != nullptr) {
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "interval_chosen")
                      .add("interval", interval_)
                      .add("snapshot_s", snapshot_s)
                      .add("profile_iteration_s", iteration_s)
                      .add("mtbf_s", job_.baseline.mtbf_s)
                      .add("iteration", iteration_));
    }
  }
  // The scaler after this step is the one a rollback to iteration_ + 1 resumes with.
  if ((iteration_ + 1) % interval_ == 0) {
    scaler_at_[iteration_ + 1] = scaler_;
    while (scaler_at_.size() > scalers_kept) scaler_at_.erase(std::next(scaler_at_.begin()));
  }
  return interval_;
}

awaitable<void> coordinator::start_rollback() {
  if (!recovery_->begun) {
    recovery_->begun = true;
    phase_ = phase::recovering;
    recovery_->target = iteration_;
    // Every surviving stage drops the iteration in progress (all at once): the whole job
    // goes back.
    const std::uint64_t e = epoch_;
    std::vector<actor_ref> alive;
    for (const actor_ref& r : stages_) {
      if (r.valid()) alive.push_back(r);
    }
    auto fill = [e](std::size_t, wire::Abort::Builder b) { b.setEpoch(e); };
    auto res =
        co_await actors::ask_all<wire::Abort, wire::AbortAck>(*this, alive, rollback_timeout, fill);
    if (finished_) co_return;
    note_group_aborts(res);
    const auto failed = std::find_if(res.begin(), res.end(), [](const auto& r) { return !r.ok(); });
    if (failed != res.end() && !(co_await loss_follows())) {
      if (finished_) co_return;
      fail("aborting the iteration for a rollback failed: " + failed->err().message);
      co_return;
    }
    if (finished_) co_return;
    // Stages lost meanwhile: their turns, queued behind this one, place every loss at once.
    if (loss_pending()) co_return;
  }
  if (recovery_->pending.empty()) co_return;  // placed by an earlier turn
  // A loss during the rollback (a survivor, or a spare being rebuilt) starts its loading over
  // once the new spare is ready: a finish_rollback in progress gives up (`attempt`).
  ++recovery_->attempt;
  const std::vector<worker_info> lost = std::move(recovery_->pending);
  recovery_->pending.clear();
  auto& rebuilds = recovery_->rebuilds;
  for (const worker_info& w : lost) {
    std::erase_if(rebuilds, [&](const recovery_state::rebuild& b) { return b.spare == w.node; });
    if (std::any_of(rebuilds.begin(), rebuilds.end(), [&](const recovery_state::rebuild& b) {
          return b.lost.stage == w.stage && b.lost.replica == w.replica;
        })) {
      continue;  // already being rebuilt
    }
    transport::node_id spare = 0;
    for (const auto& [n, sw] : workers_) {
      if (sw.stage < 0) {
        spare = n;
        break;
      }
    }
    if (spare == 0) {
      fail(
          fmt::format("stage {} replica {} was lost and no spare worker is left (raise "
                      "cluster.spares)",
                      w.stage, w.replica));
      co_return;
    }
    worker_info& sw = workers_.at(spare);
    sw.stage = w.stage;
    sw.replica = w.replica;
    rebuilds.push_back({w, spare, false});
    const std::int64_t failed_at = recovery_->target;
    const bool again = recovery_->attempt > 1;
    if (callbacks_.on_notice) {
      callbacks_.on_notice(fmt::format(
          "stage {} replica {} lost (worker {}) at iteration {}{}; policy {}: a fresh stage on "
          "spare worker {}, then every stage rolls back to the last checkpoint",
          w.stage, w.replica, w.node, failed_at, again ? ", during the rollback" : "",
          policy_name(job_.policy), spare));
    }
    if (log_ != nullptr) {
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "recovery_start")
                      .add("recovery", "rollback")
                      .add("policy", policy_name(job_.policy))
                      .add("stage", w.stage)
                      .add("replica", w.replica)
                      .add("lost_node", std::int64_t{w.node})
                      .add("spare_node", std::int64_t{spare})
                      .add("target_iteration", failed_at)
                      .add("attempt", std::int64_t(recovery_->attempt)));
    }
    const actor_ref me = self();
    const int st = w.stage, rep = w.replica;
    (void)tell<wire::Restore>(sw.agent, [&](wire::Restore::Builder b) {
      b.setStage(st);
      b.setReplica(rep);
      b.setTargetIteration(failed_at);
      b.setHasWindow(false);
      write_ref(b.initCoordinator(), me);
    });
    if (callbacks_.on_recovery && !again) callbacks_.on_recovery("recovery_start", failed_at);
  }
}

awaitable<void> coordinator::finish_rollback() {
  const recovery_state rec = *recovery_;
  // A loss not placed yet, or one while this runs (its ask fails, or its node leaves the
  // membership), leaves the rest to its turn: the lost stage is rebuilt and this starts over.
  auto superseded = [&] {
    return finished_ || !recovery_ || !recovery_->pending.empty() || loss_pending();
  };
  if (superseded()) co_return;
  const bool wired = co_await wire_all();
  if (!wired || superseded()) co_return;
  // Detection to a wired job (the replacement built, every link up) vs. the checkpoint's query
  // and load: the simulator's restart and load (docs/simulator.md, "Profile file").
  const auto t_wired = sclock::now();
  std::vector<actor_ref> holders;
  for (const auto& [n, w] : workers_) {
    if (w.replicator.valid()) holders.push_back(w.replicator);
  }
  auto agent_at = [&](int s, int d) -> actor_ref {
    for (const auto& [n, w] : workers_) {
      if (w.stage == s && w.replica == d) return w.checkpoint;
    }
    return {};
  };

  // 1. What each stage can load, verified by the stage itself (every stage at once).
  std::vector<actor_ref> agents;  // index d * pp + s
  for (int d = 0; d < job_.dp; ++d) {
    for (int s = 0; s < job_.pp; ++s) agents.push_back(agent_at(s, d));
  }
  std::map<std::int64_t, int> offered;
  std::vector<std::string> rejected;
  {
    auto fill = [&](std::size_t, wire::RollbackQuery::Builder b) {
      auto l = b.initHolders(static_cast<unsigned>(holders.size()));
      for (unsigned i = 0; i < holders.size(); ++i) write_ref(l[i], holders[i]);
    };
    auto replies = co_await actors::ask_all<wire::RollbackQuery, wire::RollbackOffer>(
        *this, agents, rollback_timeout, fill);
    if (superseded()) co_return;
    for (std::size_t i = 0; i < replies.size(); ++i) {
      const int s = int(i) % job_.pp, d = int(i) / job_.pp;
      auto& r = replies[i];
      if (!r.ok()) {
        if (co_await loss_follows() || superseded()) co_return;
        fail(fmt::format("asking stage {} replica {} for its checkpoints failed: {}", s, d,
                         r.err().message));
        co_return;
      }
      std::set<std::int64_t> mine;  // each stage counts once per iteration
      for (auto it : r->get().getIterations()) mine.insert(it);
      for (auto it : mine) ++offered[it];
      for (auto t : r->get().getRejected()) {
        rejected.push_back(fmt::format("stage {} replica {}: {}", s, d, std::string(t)));
      }
    }
  }
  std::int64_t c = -1;
  for (const auto& [it, n] : offered) {
    if (n == job_.pp * job_.dp && it <= rec.target && scaler_at_.contains(it)) c = it;
  }
  report_rejected("checkpoint_rejected", "checkpoint", rejected);
  if (c < 0) {
    fail(fmt::format("no checkpoint is loadable on every stage ({} rejected); the job stops",
                     rejected.size()));
    co_return;
  }

  // 2. Every stage loads it, all at once.
  std::uint64_t bytes = 0;
  std::vector<std::int64_t> lost_per_layer;
  std::int64_t stale = 0;
  std::string sources;
  {
    const int k = interval_ > 0 ? interval_ : 1;
    auto fill = [&](std::size_t, wire::RollbackLoad::Builder b) {
      b.setIteration(c);
      b.setInterval(k);
    };
    auto replies = co_await actors::ask_all<wire::RollbackLoad, wire::RollbackLoaded>(
        *this, agents, rollback_timeout, fill);
    if (superseded()) co_return;
    for (std::size_t i = 0; i < replies.size(); ++i) {
      const int s = int(i) % job_.pp, d = int(i) / job_.pp;
      auto& r = replies[i];
      if (!r.ok() && (co_await loss_follows() || superseded())) co_return;
      if (!r.ok() || r->get().getError().size() > 0) {
        fail(fmt::format("stage {} replica {} could not roll back to iteration {}: {}", s, d, c,
                         r.ok() ? std::string(r->get().getError()) : r.err().message));
        co_return;
      }
      bytes += r->get().getBytes();
      if (d == 0) {
        // Replicas hold the same experts and count the same tokens (summed over replicas).
        for (auto n : r->get().getLostTokens()) lost_per_layer.push_back(n);
        stale += r->get().getStaleExperts();
      }
      sources += (sources.empty() ? "" : "; ") + std::string(r->get().getSource());
    }
  }
  iteration_ = c;
  scaler_ = scaler_at_.at(c);
  recovery_.reset();
  ++recoveries_;
  const auto t_loaded = sclock::now();
  const double secs = std::chrono::duration<double>(t_loaded - rec.detected).count();
  const double restore_s = std::chrono::duration<double>(t_wired - rec.detected).count();
  const double load_s = std::chrono::duration<double>(t_loaded - t_wired).count();
  const std::int64_t recomputed = rec.target - c;
  std::string rebuilt;  // stage/replica@worker of every stage rebuilt
  for (const auto& b : rec.rebuilds) {
    rebuilt += fmt::format("{}{}/{}@{}", rebuilt.empty() ? "" : ",", b.lost.stage, b.lost.replica,
                           b.spare);
  }
  json_record end;
  end.add("kind", "event")
      .add("event", "recovery_end")
      .add("recovery", "rollback")
      .add("policy", policy_name(job_.policy))
      .add("stage", rec.rebuilds.front().lost.stage)
      .add("replica", rec.rebuilds.front().lost.replica)
      .add("spare_node", std::int64_t{rec.rebuilds.front().spare})
      .add("rebuilt", rebuilt)
      .add("restarts", std::int64_t(rec.attempt) - 1)
      .add("group_abort_s", rec.group_abort_s)
      .add("target_iteration", rec.target)
      .add("rollback_to", c)
      .add("replay_from", c)
      .add("iterations_recomputed", recomputed)
      .add("checkpoint_bytes", bytes)
      .add("rejected", std::int64_t(rejected.size()))
      .add("sources", sources)
      .add("seconds", secs)
      .add("restore_s", restore_s)
      .add("load_s", load_s);
  std::string pec_line;
  if (job_.policy == policy_kind::pec) {
    // PLT (seed 002): mean over MoE layers of the tokens routed to stale experts over the
    // tokens x top_k the layer saw: of this fault over iterations [0, failed), and of the run
    // so far over the whole training's tokens.
    const double per_iteration = double(job_.train.micro_batches) * job_.train.micro_batch_size *
                                 job_.train.seq_len * job_.dp * job_.model.top_k;
    std::int64_t lost = 0;
    double plt = 0.0;
    for (auto n : lost_per_layer) {
      lost += n;
      if (rec.target > 0) plt += double(n) / (per_iteration * double(rec.target));
    }
    const double layers = double(std::max<std::size_t>(lost_per_layer.size(), 1));
    plt /= layers;
    lost_tokens_total_ += lost;
    const double run_plt =
        double(lost_tokens_total_) / (layers * per_iteration * double(job_.train.iterations));
    std::string per_layer;
    for (auto n : lost_per_layer) per_layer += (per_layer.empty() ? "" : ",") + std::to_string(n);
    end.add("lost_tokens", lost)
        .add("lost_tokens_per_layer", per_layer)
        .add("stale_experts", stale)
        .add("moe_layers", std::int64_t(lost_per_layer.size()))
        .add("plt", plt)
        .add("run_plt", run_plt);
    pec_line = fmt::format("; {} stale expert(s), {} token(s) lost, PLT {:.6f}", stale, lost, plt);
  }
  if (log_ != nullptr) log_->write(end);
  if (callbacks_.on_notice) {
    callbacks_.on_notice(
        fmt::format("{} rebuilt ({}); every stage rolled back to iteration {} in {:.2f} s ({} "
                    "iteration(s) to recompute){}",
                    rec.rebuilds.size() == 1
                        ? fmt::format("stage {} replica {}", rec.rebuilds.front().lost.stage,
                                      rec.rebuilds.front().lost.replica)
                        : fmt::format("{} stages", rec.rebuilds.size()),
                    rebuilt, c, secs, recomputed, pec_line));
  }
  phase_ = phase::running;
  if (callbacks_.on_recovery) callbacks_.on_recovery("recovery_end", c);
  start_iteration();
}

}  // namespace moevement::engine
