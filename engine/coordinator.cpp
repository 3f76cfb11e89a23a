#include "engine/coordinator.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <set>
#include <thread>
#include <utility>

#include "actors/gather.hpp"
#include "base/hash.hpp"
#include "engine/snapshot_placement.hpp"
#include "engine/spare_choice.hpp"
#include "engine/stage_model.hpp"
#include "engine/window_budget.hpp"

namespace moevement::engine {

namespace {

using actors::actor_ref;
using asio::awaitable;
using sclock = std::chrono::steady_clock;

using actors::read_ref;
using actors::write_ref;

}  // namespace

coordinator::coordinator(job_config job, models::config_map raw, coordinator_callbacks callbacks,
                         run_log* log, head_recovery_factory recovery,
                         std::optional<resume_point> resume,
                         std::set<transport::node_id> taken_over)
    : job_(std::move(job)),
      raw_(std::move(raw)),
      callbacks_(std::move(callbacks)),
      log_(log),
      expected_workers_(taken_over.empty() ? job_.workers() + job_.spares : int(taken_over.size())),
      abort_at_(job_.abort_at),
      taken_over_(std::move(taken_over)),
      resume_(std::move(resume)) {
  stages_.resize(std::size_t(job_.workers()));
  scaler_.enabled = job_.model.compute_dtype == models::dtype::f16;
  scaler_.scale = scaler_.enabled ? job_.train.loss_scale : 1.0f;
  scaler_.window = job_.train.loss_scale_window;
  on<wire::WorkerHello>(&coordinator::hello);
  on<wire::StandbyJoined>(&coordinator::standby_joined);
  on<wire::StageReady>(&coordinator::ready);
  on<wire::StageDone>(&coordinator::stage_done);
  on<wire::Stepped>(&coordinator::stepped);
  on<wire::StageFailed>(&coordinator::stage_failed);
  on<wire::ValLoss>(&coordinator::val_loss);
  on<wire::WindowReplicated>(&coordinator::window_replicated);
  on<wire::DurableWritten>(&coordinator::durable_written);
  on<wire::RegionRestart, wire::RegionMembers>(&coordinator::region_restart);
  on<wire::RegionEscalated>(&coordinator::region_escalated);
  if (recovery) recovery_ = recovery(*this);
}

awaitable<void> coordinator::on_start() {
  start_began_ = system().now();  // (the start's deadlines: check_start)
  trap_exit(true);  // the recovery tree's root is linked: its end comes as a message (on_exit)
  system().on_membership([this](transport::node_id n, actors::member_event e) {
    if (e == actors::member_event::up || e == actors::member_event::head_changed) return;
    if (n == system().node()) {  // this head is fenced: the standby took its place
      finished_ = true;
      if (callbacks_.on_replaced) callbacks_.on_replaced();
      return;
    }
    if (standby_.node == n) {
      const int pid = standby_.pid;
      standby_ = {};
      release_start();  // training goes on without one (the notice says what that means)
      const bool lost = e == actors::member_event::lost;
      // A lost standby is ended like a lost worker: one only cut off must not act on later.
      if (lost && callbacks_.on_worker_lost) callbacks_.on_worker_lost(n, pid);
      if (log_ != nullptr && !finished_) {
        log_->write(json_record{}
                        .add("kind", "event")
                        .add("event", "standby_lost")
                        .add("node", std::int64_t{n})
                        .add("how", lost ? system().why_lost(n) : std::string("left the job"))
                        .add("time_s", log_->seconds()));
      }
      if (callbacks_.on_notice && !finished_) {
        callbacks_.on_notice(
            fmt::format("the standby head (node {}) was lost: a loss of this "
                        "head now ends the job (`--resume` brings it back)",
                        n));
      }
      return;
    }
    if (e == actors::member_event::goodbye) {
      lose_worker(n, "left the job");
    } else {
      const std::string why = system().why_lost(n);
      const std::string how = why.empty() ? std::string("was lost") : "was lost: " + why;
      const auto at = sclock::now();  // (its turn may come later: a handler holds this actor)
      (void)system().post_call(self(), [this, n, how, at](actors::actor&) -> awaitable<void> {
        co_await member_lost(n, how, at);
      });
    }
  });
  system().on_stall([this](actors::clock::duration gap) {
    const double secs = std::chrono::duration<double>(gap).count();
    head_stall_s_ = std::max(head_stall_s_, secs);
    if (callbacks_.on_notice) {
      callbacks_.on_notice(fmt::format(
          "the head did not run for {:.1f} s (stopped, e.g. SIGSTOP, or starved of CPU); workers "
          "stop waiting for their head after cluster.failure_timeout_ms = {}",
          secs, job_.failure_timeout_ms));
    }
  });
  co_return;
}

awaitable<void> coordinator::member_lost(transport::node_id n, std::string how,
                                         sclock::time_point declared_at) {
  const auto until = sclock::now() + exit_wait;
  while (callbacks_.exit_of && !finished_) {
    const worker_exit e = callbacks_.exit_of(n);
    if (!e.watched) break;
    if (!e.how.empty()) {
      how = e.how;
      break;
    }
    if (sclock::now() >= until) break;  // running (hung, or cut off): the verdict stands
    co_await system().sleep_for(std::chrono::milliseconds(5));
  }
  if (how.find("no heartbeat") != std::string::npos) silent_losses_[n] = declared_at;
  co_await worker_lost(n, how);
}

std::string coordinator::cut_off_hint() const {
  // The most workers that fell silent within one failure timeout of each other, lately (not
  // silences spares recovered from long before).
  const auto window = std::chrono::milliseconds(job_.failure_timeout_ms);
  std::vector<sclock::time_point> at;
  for (const auto& [n, t] : silent_losses_) {
    if (sclock::now() - t < 3 * window) at.push_back(t);
  }
  std::sort(at.begin(), at.end());
  std::size_t most = 0;
  for (std::size_t first = 0, last = 0; last < at.size(); ++last) {
    while (at[last] - at[first] > window) ++first;
    most = std::max(most, last - first + 1);
  }
  std::set<transport::node_id> all;
  for (const auto& [n, w] : workers_) all.insert(n);
  for (const auto& [n, t] : silent_losses_) all.insert(n);
  // (Two at least, and a strict majority: the head's own rule for a cut with a standby.)
  if (most < 2 || 2 * most <= all.size()) return {};
  return fmt::format(
      "; {} of the {} workers fell silent at once, none seen to end: either they hung together "
      "(a host or a switch), or this head is the one cut off from them ({}with the durable tier, "
      "`moevement launch CONFIG --resume` goes on from disk)",
      most, all.size(),
      // (Not where one is set: a standby that took over, or one cut off with this head.)
      job_.standby_head ? "" : "a standby head, cluster.standby_head, takes over there; ");
}

void coordinator::lose_worker(transport::node_id n, const std::string& how) {
  // A message to this actor, never a change made here: this is called from the membership
  // callback and the launcher, possibly while a handler is suspended in an ask. A handler
  // that must know meanwhile asks the actor layer (loss_pending()).
  (void)system().post_call(
      self(), [this, n, how](actors::actor&) -> awaitable<void> { co_await worker_lost(n, how); });
}

void coordinator::on_stop(const actors::exit_reason& why) {
  if (overdue_timer_ != 0) system().time().cancel(std::exchange(overdue_timer_, 0));
  system().on_membership({});
  // A handler that threw stops this actor (actor_system's rule): the job ends saying why,
  // rather than idle for ever with its workers waiting for a head that no longer drives them.
  if (why.abnormal() && !finished_) {
    fail(
        fmt::format("the head's coordinator failed ({}): this is a bug, please report it with "
                    "the run log{}",
                    why.to_string(),
                    job_.policy == policy_kind::moevement && durable_tier(job_)
                        ? "; `moevement launch CONFIG --resume` goes on from disk"
                        : ""));
  }
}

void coordinator::fail(const std::string& message) {
  if (finished_) return;
  job_outcome o;
  o.ok = false;
  o.message = message;
  if (head_stall_s_ * 1000.0 > double(job_.failure_timeout_ms)) {
    // What the losses above came from: the workers gave up on a head that did not run.
    o.message += fmt::format(
        " (the head itself did not run for {:.1f} s before: its workers stopped waiting for it; "
        "with the durable tier, `moevement launch CONFIG --resume` goes on from disk)",
        head_stall_s_);
  }
  o.message += cut_off_hint();
  o.iterations = iteration_;
  finish_with(std::move(o));
}

void coordinator::stop_for_resume(const std::string& message, std::int64_t goes_on_at) {
  if (finished_) return;
  job_outcome o;
  o.stopped = true;
  o.message = message;
  o.iterations = goes_on_at;  // what is kept: the iterations after the window are trained again
  finish_with(std::move(o));
}

void coordinator::finish_with(job_outcome outcome) {
  if (finished_) return;
  finished_ = true;
  phase_ = phase::done;
  if (recovery_) recovery_->stop();     // its supervisors' members' workers shut down below
  if (outcome.ok || outcome.stopped) {  // a stop is a clean end too: its ETTR is measured
    outcome.wall_s =
        std::chrono::duration<double>(sclock::now() - job_start_).count() - validation_s_;
    for (const auto& [i, secs] : committed_s_) outcome.useful_s += secs;
    outcome.ettr = outcome.wall_s > 0 ? std::min(1.0, outcome.useful_s / outcome.wall_s) : 0.0;
  }
  if (log_ != nullptr) {
    json_record r;
    r.add("kind", "event")
        .add("event", outcome.ok        ? "job_end"
                      : outcome.stopped ? "job_stopped"
                                        : "job_failed");
    r.add("iterations", outcome.iterations);
    // The head's view of its members over the job: connections redialled, silences reported
    // to it, and its verdicts on those reports (docs/actors.md).
    const auto& st = system().stats();
    r.add("reconnects", std::int64_t(st.reconnects))
        .add("verdicts", std::int64_t(st.verdicts))
        .add("fenced", std::int64_t(st.fenced))
        .add("sdc_fenced", sdc_found_);
    if (st.reconnects > 0) r.add("last_reconnect", system().last_reconnect());
    if (outcome.ok) {
      r.add("state_hash", hex16(outcome.state_hash))
          .add("wall_s", outcome.wall_s)
          .add("useful_s", outcome.useful_s)
          .add("validation_s", validation_s_)
          .add("ettr", outcome.ettr);
    } else {
      r.add("message", outcome.message);
      if (outcome.stopped) {
        r.add("wall_s", outcome.wall_s).add("useful_s", outcome.useful_s).add("ettr", outcome.ettr);
      }
    }
    log_->write(r);
  }
  // Every worker process shuts down (those still there); a group replay still waiting for
  // its peers' gradients ends first (its agent would take the Shutdown only after it).
  for (const auto& [n, w] : workers_) {
    if (!w.group_exchange.valid()) continue;
    (void)tell<wire::ReplayGeneration>(w.group_exchange, [&](wire::ReplayGeneration::Builder b) {
      b.setGeneration((recovery_ ? recovery_->generations() : 0) + 1);
    });
  }
  for (const auto& [n, w] : workers_) {
    if (w.agent.valid()) (void)tell<wire::Shutdown>(w.agent);
  }
  if (standby_.agent.valid()) (void)tell<wire::Shutdown>(standby_.agent);
  if (callbacks_.on_finished) callbacks_.on_finished(outcome);
}

awaitable<void> coordinator::hello(wire::WorkerHello::Reader m) {
  const transport::node_id n = m.getNode();
  const actor_ref agent = read_ref(m.getAgent());
  const bool ours = taken_over_.empty() ? n >= 1 && int(n) <= job_.workers() + job_.spares &&
                                              !lost_before_start_.contains(n)
                                        : taken_over_.contains(n) && m.getTaken();
  const bool standby = m.getStandby() && job_.standby_head && taken_over_.empty() &&
                       n == standby_node(job_) && !standby_.agent.valid();
  if (phase_ != phase::admitting || (!ours && !standby) || workers_.contains(n) ||
      agent.node != n || m.getHost().size() > 255 || m.getDomain().size() > 255) {
    co_return;  // not one of ours, or twice: ignored
  }
  worker_info w;
  w.node = n;
  w.host = m.getHost();
  w.domain = m.getDomain().size() > 0 ? std::string(m.getDomain()) : w.host;
  w.port = m.getPort();
  w.pid = m.getPid();
  w.agent = agent;
  const int idx = int(n) - 1;
  if (!taken_over_.empty()) {  // a standby that took over: each keeps the role it holds
    if (m.getStage() >= job_.pp || m.getReplica() >= job_.dp ||
        (m.getStage() >= 0) != (m.getReplica() >= 0)) {
      co_return;
    }
    w.stage = m.getStage() >= 0 ? m.getStage() : -1;
    w.replica = m.getStage() >= 0 ? m.getReplica() : -1;
    // Its replays' generations go on past what the lost head numbered. (Bounded: from the
    // wire; no job makes a trillion generations.)
    if (recovery_ && m.getGeneration() < (std::uint64_t{1} << 40)) {
      recovery_->generations_past(m.getGeneration());
    }
  } else if (idx < job_.workers()) {
    w.stage = idx % job_.pp;
    w.replica = idx / job_.pp;
  }
  if (standby) {
    standby_ = w;
    standby_heard_ = true;
  } else {
    workers_[n] = w;
  }
  // So that a failed connection to it is redialled from here too: a reset costs no recovery,
  // and a dead worker refuses the redial (docs/actors.md "Only the head declares").
  system().add_peer_address(n, w.host, w.port);
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", standby ? "standby_up" : "worker_up")
                    .add("node", std::int64_t{n})
                    .add("pid", w.pid)
                    .add("stage", w.stage)
                    .add("replica", w.replica));
  }
  admitted();
}

void coordinator::admitted() {
  if (phase_ != phase::admitting || int(workers_.size()) < expected_workers_) return;
  if (waits_for_standby_hello()) return;
  if (!roles_complete()) return;
  phase_ = phase::starting;
  send_assigns();
}

void coordinator::standby_ended(const std::string& how) {
  if (finished_ || !job_.standby_head || !taken_over_.empty() || standby_heard_ ||
      std::exchange(standby_gone_, true)) {
    return;
  }
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "standby_lost")
                    .add("node", std::int64_t(standby_node(job_)))
                    .add("how", how + " before it joined")
                    .add("time_s", log_->seconds()));
  }
  notice(
      fmt::format("the standby head {} before it joined: a loss of this head now ends the job "
                  "(`--resume` brings it back)",
                  how));
  admitted();  // (no longer waiting for its hello)
}

void coordinator::send_assigns() {
  // Everyone is here: every worker learns every address, the config and its role.
  for (const auto& [node, info] : workers_) send_assign(info);
  if (standby_.agent.valid()) send_assign(standby_);
  if (callbacks_.on_assigned) callbacks_.on_assigned();
}

void coordinator::send_assign(const worker_info& to) {
  std::vector<const worker_info*> all;
  for (const auto& [node, info] : workers_) all.push_back(&info);
  if (standby_.agent.valid()) all.push_back(&standby_);
  (void)tell<wire::Assign>(to.agent, [&](wire::Assign::Builder b) {
    auto peers = b.initPeers(static_cast<unsigned>(all.size()));
    unsigned i = 0;
    for (const worker_info* p : all) {
      peers[i].setNode(p->node);
      peers[i].setHost(p->host);
      peers[i].setPort(p->port);
      ++i;
    }
    write_config(b.initConfig(), raw_);
    b.setStage(to.stage);
    b.setReplica(to.replica);
    write_ref(b.initCoordinator(), self());
    b.setResume(resume_.has_value());
  });
}

bool coordinator::roles_complete() {
  std::vector<int> held(std::size_t(job_.workers()), 0);
  for (const auto& [n, w] : workers_) {
    if (w.stage >= 0) ++held[std::size_t(w.replica * job_.pp + w.stage)];
  }
  const auto lost_role_of = [this](int i) {
    const auto it = lost_roles_.find(i);
    return it == lost_roles_.end() ? lost_role{} : it->second;
  };
  for (int i = 0; i < job_.workers(); ++i) {
    if (held[std::size_t(i)] == 0) {  // its worker was lost during admission: a spare's now
      const transport::node_id spare =
          choose_spare(workers_, lost_role_of(i).domain, [](transport::node_id) { return true; });
      if (spare != 0) {
        workers_.at(spare).stage = i % job_.pp;
        workers_.at(spare).replica = i / job_.pp;
        role_given_at_[spare] = system().now();  // (its start deadline counts from now)
        continue;
      }
    }
    if (held[std::size_t(i)] == 1) continue;
    if (taken_over_.empty()) {
      const std::string what = lost_role_of(i).what;
      fail(fmt::format(
          "stage {} replica {} has no worker: {} before training started and no spare is left "
          "to take its role (raise cluster.spares)",
          i % job_.pp, i / job_.pp, what.empty() ? std::string("its worker was lost") : what));
      return false;
    }
    fail(
        fmt::format("the standby head cannot take over: stage {} replica {} is held by {} "
                    "workers (the head was lost during a recovery, or the role's worker with it "
                    "and no spare is left); `moevement launch CONFIG --resume` goes on from the "
                    "newest window on disk",
                    i % job_.pp, i / job_.pp, held[std::size_t(i)]));
    return false;
  }
  return true;
}

awaitable<void> coordinator::ready(wire::StageReady::Reader m) {
  auto it = workers_.find(m.getNode());
  if (it == workers_.end()) co_return;
  worker_info& w = it->second;
  // A worker rebuilding a stage for the recovery, or one starting with the job.
  const bool replacement =
      phase_ == phase::recovering && recovery_ && recovery_->rebuilding(w.node);
  if (phase_ != phase::starting && !replacement) co_return;
  // An older generation's report, or one of a region about to restart.
  if (replacement && !recovery_->current(w.node, m.getGeneration())) co_return;
  if (m.getError().size() > 0) {
    std::string message =
        fmt::format("worker {} could not start its stage: {}", w.node, std::string(m.getError()));
    if (replacement && m.getReplayMismatch()) {
      // Silent corruption of what that stage sent then: it has reached every stage since, and
      // no replica holds the right bits (docs/recovery.md "Silent data corruption").
      if (log_ != nullptr) {
        log_->write(json_record{}
                        .add("kind", "event")
                        .add("event", "sdc_suspected")
                        .add("iteration", iteration_)
                        .add("digest", "replay")
                        .add("stage", m.getStage())
                        .add("replicas", fmt::format("{}", m.getReplica()))
                        .add("node", std::int64_t{w.node})
                        .add("sent_in", m.getMismatchIteration())
                        .add("time_s", log_->seconds()));
      }
      co_await replay_mismatch_found(w, m.getStage(), m.getReplica(), m.getMismatchIteration(),
                                     message);
    } else if (replacement) {
      co_await recovery_->restore_failed(w.node, message, m.getSnapshotLost());
    } else {
      fail(message);
    }
    co_return;
  }
  // A spare's report sent before it was given a lost worker's role (lost_before_training; an
  // error in it still ends the start, above).
  if (!replacement && m.getStage() != w.stage) co_return;
  const actor_ref ckpt = read_ref(m.getCheckpoint()), repl = read_ref(m.getReplicator());
  const actor_ref exchange = read_ref(m.getGroupExchange());
  const actor_ref experts = read_ref(m.getExperts());
  if ((ckpt.valid() && ckpt.node != w.node) || (repl.valid() && repl.node != w.node) ||
      (exchange.valid() && exchange.node != w.node) ||
      (experts.valid() && experts.node != w.node)) {
    fail(fmt::format("worker {} reported checkpoint actors of another node", w.node));
    co_return;
  }
  // (a stage is reported with its router; a resumed job's workers first report without
  // either, their stages come with the restore)
  if (w.stage >= 0 && job_.ep > 1 && read_ref(m.getActor()).valid() && !experts.valid()) {
    fail(fmt::format("worker {} reported no expert router (parallel.ep = {})", w.node, job_.ep));
    co_return;
  }
  w.experts = experts;
  w.checkpoint = ckpt;
  w.replicator = repl;
  w.group_exchange = exchange;
  w.op_sizes.clear();
  for (auto o : m.getOpSizes()) {
    w.op_sizes.push_back({o.getComputeBytes(), o.getMasterBytes(), o.getOptimBytes()});
  }
  w.snapshot_bandwidth = m.getSnapshotBandwidth();
  // A resume's workers build no stage from the initial state: they restore one from disk.
  // Under a standby that took over, a worker reports the stage it runs (a spare given a lost
  // worker's role reports none: it is restored).
  const bool resuming = resume_ && phase_ == phase::starting;
  const bool live = resuming && !taken_over_.empty() && read_ref(m.getActor()).valid();
  if (w.stage >= 0 && (!resuming || live)) {
    const actor_ref r = read_ref(m.getActor());
    if (r.node != w.node || m.getStage() != w.stage || m.getReplica() != w.replica) {
      fail(fmt::format("worker {} reported an inconsistent stage", w.node));
      co_return;
    }
    w.stage_actor = r;
    stages_[std::size_t(w.replica * job_.pp + w.stage)] = r;
    monitor(r);  // a stage actor that stops (its handler threw) ends the job, never a hang
  }
  if (replacement) {
    co_await recovery_->restored(w.node, m);
    co_return;
  }
  ready_.insert(w.node);
  co_await start_when_ready();
}

awaitable<void> coordinator::start_when_ready() {
  // (A start cut short by a loss, its wiring failed, is taken up again by the report of the
  // spare given the lost role.)
  if (finished_ || phase_ != phase::starting || int(ready_.size()) < expected_workers_) co_return;
  if (standby_.agent.valid() && !standby_joined_) {
    held_start_ = true;  // release_start() when the standby joined
    co_return;
  }
  co_await start_training();
}

awaitable<void> coordinator::start_training() {
  if (resume_ && !taken_over_.empty()) {
    co_await start_takeover();
  } else if (resume_) {
    co_await start_resume();
  } else {
    co_await wire_and_start();
  }
}

awaitable<void> coordinator::standby_joined(wire::StandbyJoined::Reader m) {
  if (!standby_.agent.valid() || m.getNode() != standby_.node) co_return;
  standby_joined_ = true;
  release_start();
}

void coordinator::release_start() {
  if (!std::exchange(held_start_, false) || finished_) return;
  (void)system().post_call(self(), [](actors::actor& a) -> awaitable<void> {
    co_await static_cast<coordinator&>(a).start_when_ready();
  });
}

std::map<transport::node_id, std::vector<actor_ref>> coordinator::snapshot_holders() const {
  // Every worker with a replicator (spares too) may hold copies: engine/snapshot_placement.hpp
  // places them so that one lost host or a contiguous run of up to half the pipeline leaves
  // a copy of every slot.
  std::vector<placement_candidate> candidates;
  for (const auto& [n, w] : workers_) {
    if (w.replicator.valid()) candidates.push_back({n, w.stage, w.domain});
  }
  std::map<transport::node_id, std::vector<actor_ref>> out;
  for (const auto& [owner, holders] :
       place_snapshot_copies(candidates, job_.pp, job_.snapshot_replicas)) {
    auto& refs = out[owner];
    for (transport::node_id h : holders) refs.push_back(workers_.at(h).replicator);
  }
  return out;
}

void coordinator::retarget_snapshots(
    const std::map<transport::node_id, std::vector<actor_ref>>& before, actor_ref lost) {
  if (!replicates() || !lost.valid()) return;
  const auto now = snapshot_holders();
  for (const auto& [owner, holders] : before) {
    if (std::find(holders.begin(), holders.end(), lost) == holders.end()) continue;
    const auto w = workers_.find(owner);
    const auto to = now.find(owner);
    if (w == workers_.end() || !w->second.checkpoint.valid() || to == now.end()) continue;
    (void)tell<wire::SnapshotTargets>(w->second.checkpoint, [&](wire::SnapshotTargets::Builder b) {
      auto l = b.initReplicators(static_cast<unsigned>(to->second.size()));
      for (unsigned j = 0; j < to->second.size(); ++j) write_ref(l[j], to->second[j]);
    });
    log_holders(w->second.stage, w->second.replica, owner, to->second);
  }
}

void coordinator::log_holders(int stage, int replica, transport::node_id owner,
                              const std::vector<actor_ref>& holders) const {
  if (log_ == nullptr) return;
  std::string names;
  for (const auto& r : holders) names += (names.empty() ? "" : ",") + std::to_string(r.node);
  log_->write(json_record{}
                  .add("kind", "event")
                  .add("event", "snapshot_holders")
                  .add("stage", stage)
                  .add("replica", replica)
                  .add("node", std::int64_t{owner})
                  .add("holders", names));
}

awaitable<bool> coordinator::wire_all() {
  std::map<int, transport::node_id> node_of;  // stage index -> node
  for (const auto& [n, w] : workers_) {
    if (w.stage >= 0) node_of[w.replica * job_.pp + w.stage] = n;
  }
  // What each stage is told (index d * pp + s), decided before any is sent: a loss during
  // the asks then looks like a loss just after the wiring, which its recovery rewires.
  struct wiring {
    actor_ref prev, next;
    std::vector<actor_ref> replicas, replicators, experts;
  };
  std::vector<wiring> plan(std::size_t(job_.workers()));
  // Whether the policy's workers hold copies for each other (dense-disk's do not).
  const bool copies =
      replicates() && std::any_of(workers_.begin(), workers_.end(),
                                  [](const auto& kv) { return kv.second.replicator.valid(); });
  const auto holders_of =
      copies ? snapshot_holders() : std::map<transport::node_id, std::vector<actor_ref>>{};
  for (int d = 0; d < job_.dp; ++d) {
    for (int s = 0; s < job_.pp; ++s) {
      wiring& w = plan[std::size_t(d * job_.pp + s)];
      w.prev = s > 0 ? stage_ref(s - 1, d) : actor_ref{};
      w.next = s + 1 < job_.pp ? stage_ref(s + 1, d) : actor_ref{};
      for (int r = 0; r < job_.dp; ++r) {
        w.replicas.push_back(stage_ref(s, r));
        if (job_.ep > 1) {
          const auto at = workers_.find(node_of[r * job_.pp + s]);
          w.experts.push_back(at != workers_.end() ? at->second.experts : actor_ref{});
        }
      }
      if (const auto h = holders_of.find(node_of[d * job_.pp + s]); h != holders_of.end()) {
        w.replicators = h->second;
      }
      if (copies) log_holders(s, d, node_of[d * job_.pp + s], w.replicators);
    }
  }
  if (copies && !fewer_copies_noticed_) {
    std::size_t fewest = std::size_t(job_.snapshot_replicas);
    for (const auto& w : plan) fewest = std::min(fewest, w.replicators.size());
    if (fewest < std::size_t(job_.snapshot_replicas)) {
      fewer_copies_noticed_ = true;
      notice(
          fewest == 0
              ? fmt::format("checkpoint.replicas = {}, but a snapshot has no copy here (no other "
                            "worker to hold one): each window is whole with its stage's own "
                            "capture{}",
                            job_.snapshot_replicas,
                            durable_tier(job_)
                                ? " and goes to the durable tier: a lost stage goes back to disk"
                                : ": a lost stage cannot be rebuilt (nor the job resumed) "
                                  "without the durable tier")
              : fmt::format("checkpoint.replicas = {}, but a snapshot can have only {} "
                            "cop{} here (one per other worker with a replicator); the run "
                            "log's snapshot_holders events say which",
                            job_.snapshot_replicas, fewest, fewest == 1 ? "y" : "ies"));
    }
  }
  const std::uint64_t wiring_count = ++wirings_;
  auto fill = [&](std::size_t i, wire::Wire::Builder b) {
    const wiring& w = plan[i];
    b.setWiring(wiring_count);
    write_ref(b.initPrev(), w.prev);
    write_ref(b.initNext(), w.next);
    auto l = b.initReplicas(static_cast<unsigned>(w.replicas.size()));
    for (unsigned j = 0; j < w.replicas.size(); ++j) write_ref(l[j], w.replicas[j]);
    auto rl = b.initReplicators(static_cast<unsigned>(w.replicators.size()));
    for (unsigned j = 0; j < w.replicators.size(); ++j) write_ref(rl[j], w.replicators[j]);
    auto el = b.initExperts(static_cast<unsigned>(w.experts.size()));
    for (unsigned j = 0; j < w.experts.size(); ++j) write_ref(el[j], w.experts[j]);
  };
  auto replies =
      co_await actors::ask_all<wire::Wire, wire::WireAck>(*this, stages_, ask_timeout, fill);
  if (finished_) co_return false;
  for (std::size_t i = 0; i < replies.size(); ++i) {
    if (replies[i].ok()) continue;
    // A stage lost since the wiring began (its actor is gone from stages_ already, or its loss
    // is still on the way), during a recovery or not (a standby head's first wiring after it
    // took over): its loss's turn (posted) recovers it, and rewires.
    // (Before training starts any policy's loss is recovered: a spare takes the role.)
    const bool lost = (recovery_ || !started()) && co_await loss_follows();
    if (finished_ || lost) co_return false;
    fail(fmt::format("wiring stage {} replica {} failed: {}", int(i) % job_.pp, int(i) / job_.pp,
                     replies[i].err().message));
    co_return false;
  }
  // A loss while the asks were out: the recovery it posted wires again.
  if ((recovering() || !started()) && loss_pending()) co_return false;
  co_return true;
}

json_record coordinator::job_start_record() const {
  json_record r;
  r.add("kind", "event")
      .add("event", "job_start")
      .add("pp", job_.pp)
      .add("dp", job_.dp)
      .add("spares", job_.spares)
      .add("iterations", job_.train.iterations)
      .add("micro_batches", job_.train.micro_batches)
      .add("ep", job_.ep);
  if (job_.stage_type == "moe") {
    // the expert parameters the fullest stage worker holds (its block of each layer's experts)
    int layers = 0;
    for (const auto& range : models::partition(job_.model, job_.pp)) {
      layers = std::max(layers, range.last_layer - range.first_layer);
    }
    const std::int64_t per_expert = 2 * std::int64_t(job_.model.d_model) * job_.model.d_ff;
    r.add("expert_params_per_worker",
          std::int64_t(layers) * (job_.model.experts / job_.ep) * per_expert);
  }
  if (log_ != nullptr) r.add("time_s", log_->seconds());
  return r;
}

awaitable<void> coordinator::wire_and_start() {
  const bool wired = co_await wire_all();
  if (!wired) co_return;
  if (log_ != nullptr) log_->write(job_start_record());
  job_start_ = sclock::now();
  if (job_.train.iterations <= 0) {
    co_await finish();
    co_return;
  }
  start_iteration();
}

awaitable<void> coordinator::on_down(actor_ref who, actors::exit_reason why) {
  if (finished_) co_return;
  // A node that died takes its actors with it: lose_worker handles that (and decides).
  if (why.kind == actors::exit_kind::node_lost || !workers_.contains(who.node)) co_return;
  const auto it = std::find_if(workers_.begin(), workers_.end(),
                               [&](const auto& kv) { return kv.second.stage_actor == who; });
  if (it == workers_.end()) co_return;
  const transport::node_id n = it->first;
  const int stage = it->second.stage, replica = it->second.replica;
  // A worker stopping (SIGTERM, a Slurm step's end) stops its actors before its goodbye: that
  // goodbye is a loss like any other (a spare takes the stage), not the end of the job. Its
  // node leaving the membership (within the failure timeout) says it was; its loss, queued
  // behind this turn, decides.
  if (why.kind == actors::exit_kind::shutdown && assigned()) {
    const auto until = sclock::now() + std::chrono::milliseconds(job_.failure_timeout_ms + 200);
    while (!finished_ && system().last_heard(n).has_value() && sclock::now() < until) {
      co_await system().sleep_for(std::chrono::milliseconds(20));
    }
    if (finished_ || !system().last_heard(n).has_value()) co_return;
  }
  if (finished_) co_return;
  fail(fmt::format("the actor of stage {} replica {} (worker {}) stopped: {}", stage, replica, n,
                   why.to_string()));
}

awaitable<void> coordinator::stage_failed(wire::StageFailed::Reader m) {
  // A stage usually fails because a peer died under it (a pull broke, an EP peer's router saw
  // it go). A loss the head knows already decides. Else the head learns of that death itself
  // within the failure timeout, with the better message (which worker, how it died): wait
  // that long before blaming the stage.
  std::string message = "a stage failed: " + std::string(m.getMessage());
  if (loss_pending() || recovering()) co_return;
  co_await system().sleep_for(std::chrono::milliseconds(job_.failure_timeout_ms + 200));
  // A worker was lost meanwhile: that was the cause, and its loss (queued behind this turn)
  // decides the recovery or the job's end.
  if (loss_pending() || recovering()) co_return;
  fail(message);
}

awaitable<void> coordinator::window_replicated(wire::WindowReplicated::Reader m) {
  if (recovery_) co_await recovery_->window_replicated(m);
}

awaitable<void> coordinator::durable_written(wire::DurableWritten::Reader m) {
  if (recovery_) co_await recovery_->durable_written(m);
}

}  // namespace moevement::engine
