// The coordinator's iterations (engine/coordinator.hpp): Iterate to every stage, the reports
// gathered (stage_done), the step planned and sent (Step), every stage stepped, then the next
// iteration, a validation round, or the end (the digests: state_hash); pause, resume, abort.
#include <fmt/format.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <utility>

#include "actors/gather.hpp"
#include "base/hash.hpp"
#include "engine/coordinator.hpp"
#include "engine/stage_model.hpp"
#include "engine/window_budget.hpp"

namespace moevement::engine {

namespace {

using actors::actor_ref;
using asio::awaitable;
using sclock = std::chrono::steady_clock;

}  // namespace

void coordinator::start_iteration() {
  phase_ = phase::running;
  ++epoch_;
  ++attempts_;
  const std::size_t n = stages_.size();
  sq_.assign(n, std::nullopt);
  expert_ops_.assign(n, {});
  expert_wait_s_.assign(n, 0.0);
  losses_.assign(n, std::nullopt);
  aux_.assign(n, std::nullopt);
  pop_.assign(n, std::nullopt);
  compute_s_.assign(n, 0.0);
  done_count_ = 0;
  stepped_flags_.assign(n, false);
  iteration_start_ = sclock::now();
  attempt_spanned_recovery_ = false;
  arm_iteration_timeout();
  const std::int64_t it = iteration_;
  const std::uint64_t e = epoch_;
  const float scale = scaler_.scale;
  for (const actor_ref& r : stages_) {
    (void)tell<wire::Iterate>(r, [&](wire::Iterate::Builder b) {
      b.setIteration(it);
      b.setEpoch(e);
      b.setLossScale(scale);
    });
  }
}

void coordinator::arm_iteration_timeout(std::chrono::milliseconds after) {
  auto& time = system().time();
  if (overdue_timer_ != 0) time.cancel(std::exchange(overdue_timer_, 0));
  if (job_.iteration_timeout_ms <= 0) return;
  if (after.count() <= 0) after = std::chrono::milliseconds(job_.iteration_timeout_ms);
  actors::actor_system* sys = &system();  // the timer is the system's: it lives while it can run
  overdue_timer_ = time.call_at(time.now() + after, [sys, me = self(), e = epoch_] {
    (void)sys->post_call(me, [e](actors::actor& a) -> awaitable<void> {
      co_await static_cast<coordinator&>(a).iteration_overdue(e);
    });
  });
}

awaitable<void> coordinator::iteration_overdue(std::uint64_t e) {
  if (e != epoch_) co_return;  // an older attempt's (the timer now is another's)
  overdue_timer_ = 0;
  // A recovery under way re-runs the iteration under a new epoch, armed again then.
  const auto overdue = [&] {
    return !finished_ && e == epoch_ && !recovering() && !loss_pending() &&
           (phase_ == phase::running || phase_ == phase::stepping);
  };
  // Held off (a loss pending, say a spare's, which changes no epoch): looked at again soon, or
  // this attempt would never be watched again.
  const auto look_later = [&] {
    if (!finished_ && e == epoch_ && (phase_ == phase::running || phase_ == phase::stepping)) {
      arm_iteration_timeout(std::chrono::milliseconds(1000));
    }
  };
  if (!overdue()) {
    look_later();
    co_return;
  }
  const std::int64_t it = iteration_;
  std::vector<actor_ref> waiting;
  std::string names;
  for (std::size_t i = 0; i < stages_.size(); ++i) {
    const bool finished = phase_ == phase::running ? sq_[i].has_value() : bool(stepped_flags_[i]);
    if (finished || !stages_[i].valid()) continue;
    waiting.push_back(stages_[i]);
    names += fmt::format("{}stage {} replica {} (node {})", names.empty() ? "" : ", ",
                         int(i) % job_.pp, int(i) / job_.pp, stages_[i].node);
  }
  // Every stage stepped: the iteration is done (its checks and the job's end have deadlines).
  if (waiting.empty()) co_return;
  const std::string late = fmt::format(
      "iteration {} did not end within cluster.iteration_timeout_ms = {} ms: {} did not {} it, "
      "their workers alive",
      it, job_.iteration_timeout_ms, names, phase_ == phase::running ? "finish" : "step");
  if (!recovery_) {
    fail(late + " (a hung kernel or collective, or a deadlock); the job stops");
    co_return;
  }
  const probed_stages found = co_await probe_late(waiting, e);
  if (!overdue()) {  // it ended meanwhile, or a loss came first
    look_later();
    co_return;
  }
  const auto& [stuck, stuck_s, recheck_s, behind] = found;
  if (stuck.empty() && recheck_s > 0 && rechecked_epoch_ != e) {
    // A task of its own under way: looked at again, once, when it has run as long as the limit
    // (so an attempt ends by twice the limit at most); or a worker unheard, once the failure
    // detector has had the time to declare it lost.
    rechecked_epoch_ = e;
    arm_iteration_timeout(std::chrono::milliseconds(std::int64_t(recheck_s * 1000.0) + 100));
    co_return;
  }
  const auto spares = std::count_if(workers_.begin(), workers_.end(),
                                    [](const auto& kv) { return kv.second.stage < 0; });
  if (stuck.empty() || spares < std::ssize(stuck)) {
    fail(late + (stuck.empty() ? ", and none of them is stuck in its compute (each waits for "
                                 "another:" +
                                     behind + " a lost message or a deadlock); the job stops"
                               : fmt::format(", {} of them stuck in its compute, and {} spare "
                                             "worker(s) left to rebuild them (raise "
                                             "cluster.spares); the job stops",
                                             stuck.size(), spares)));
    co_return;
  }
  // Fenced: declared lost with the verdict to every member (nothing from it is read again),
  // ended by the launcher, and its stage rebuilt on a spare like any lost worker's.
  for (std::size_t k = 0; k < stuck.size(); ++k) {
    const actor_ref& r = stuck[k];
    const auto w = workers_.find(r.node);
    const std::string how =
        stuck_s[k] < 0 ? std::string("its worker's actor thread does not answer")
                       : fmt::format("one task of its own has run {:.1f} s, not waiting for a peer",
                                     stuck_s[k]);
    notice(fmt::format(
        "{}; stage {} replica {} (worker {}) is stuck in its compute ({}): its worker is fenced "
        "and the stage rebuilt on a spare",
        late, w != workers_.end() ? w->second.stage : -1,
        w != workers_.end() ? w->second.replica : -1, r.node, how));
    system().lose_member(r.node, "fenced it: its stage was stuck in its compute");
  }
  for (const actor_ref& r : stuck) {
    co_await worker_lost(r.node,
                         fmt::format("was fenced: its stage was stuck in iteration {}", it));
    if (finished_) break;
  }
}

awaitable<coordinator::probed_stages> coordinator::probe_late(const std::vector<actor_ref>& late,
                                                              std::uint64_t e) {
  // Where each late stage's compute thread is, as its worker's agent reads it (the stage actor
  // itself is busy while it computes).
  std::vector<actor_ref> agents;
  for (const actor_ref& r : late) {
    const auto w = workers_.find(r.node);
    agents.push_back(w != workers_.end() ? w->second.agent : actor_ref{});
  }
  const auto probe_timeout =
      std::max(std::chrono::milliseconds(5000), std::chrono::milliseconds(job_.failure_timeout_ms));
  auto fill = [](std::size_t, wire::StageProbe::Builder) {};
  auto probed = co_await actors::ask_all<wire::StageProbe, wire::StageProbed>(*this, agents,
                                                                              probe_timeout, fill);
  const double limit_s = double(job_.iteration_timeout_ms) / 1000.0;
  probed_stages out;
  for (std::size_t k = 0; k < late.size(); ++k) {
    if (!probed[k].ok()) {
      // Its worker's actor thread is held too, its heartbeats going on (heard within the
      // failure timeout); one not heard is the failure detector's to declare lost.
      const auto heard = system().last_heard(late[k].node);
      if (heard && system().now() - *heard <= std::chrono::milliseconds(job_.failure_timeout_ms)) {
        out.stuck.push_back(late[k]);
        out.stuck_s.push_back(-1.0);
      } else {
        // Looked at again once the detector has had its time: a loss (recovered) by then.
        out.behind += fmt::format(" node {} neither answers nor is heard;", late[k].node);
        out.recheck_s = std::max(out.recheck_s, double(job_.failure_timeout_ms) / 1000.0);
      }
      continue;
    }
    const auto p = **probed[k];
    if (!p.getHasStage()) {
      out.behind += fmt::format(" node {}'s worker holds no stage;", late[k].node);
      continue;
    }
    if (p.getEpoch() < e) {
      out.behind += fmt::format(" node {}'s stage is still at an earlier attempt;", late[k].node);
    }
    if (p.getState() != wire::ComputeState::COMPUTING) continue;  // waiting for another
    if (p.getSeconds() >= limit_s) {
      out.stuck.push_back(late[k]);
      out.stuck_s.push_back(p.getSeconds());
    } else {
      out.recheck_s = std::max(out.recheck_s, limit_s - p.getSeconds());
    }
  }
  co_return out;
}

awaitable<void> coordinator::stage_done(wire::StageDone::Reader m) {
  const int s = m.getStage(), d = m.getReplica();
  if (phase_ != phase::running || m.getEpoch() != epoch_ || s < 0 || s >= job_.pp || d < 0 ||
      d >= job_.dp) {
    co_return;
  }
  const std::size_t i = std::size_t(d * job_.pp + s);
  if (sq_[i] || m.getAuxLosses().size() != unsigned(job_.train.micro_batches) ||
      (s == job_.pp - 1 && m.getLosses().size() != unsigned(job_.train.micro_batches))) {
    co_return;
  }
  auto to_vector = [](capnp::List<double>::Reader l) {
    std::vector<double> v;
    v.reserve(l.size());
    for (double x : l) v.push_back(x);
    return v;
  };
  sq_[i] = to_vector(m.getSqSums());
  for (const bool x : m.getExperts()) expert_ops_[i].push_back(x);
  expert_wait_s_[i] = m.getExpertWaitSeconds();
  expert_refused_.resize(stages_.size(), 0);
  expert_refused_[i] = m.getExpertRowsRefused();
  aux_[i] = to_vector(m.getAuxLosses());
  if (s == job_.pp - 1) losses_[i] = to_vector(m.getLosses());
  compute_s_[i] = m.getComputeSeconds();
  pop_[i] = to_vector(m.getPopularity());
  group_form_s_ = std::max(group_form_s_, m.getGroupFormSeconds());
  device_sum_s_ = std::max(device_sum_s_, m.getDeviceSumSeconds());
  ++done_count_;
  if (abort_at_ == iteration_) {
    abort_at_ = -1;
    co_await abort_iteration();
    co_return;
  }
  if (done_count_ < int(stages_.size()) || recovering()) co_return;
  if (!plan_iteration()) co_return;
  send_steps();
}

template <class T>
std::vector<T> coordinator::merge_ranks(const std::vector<std::vector<T>>& values,
                                        const std::vector<std::vector<bool>>& experts) {
  std::vector<std::vector<models::op_kind>> kinds;
  for (std::size_t k = 0; k < values.size(); ++k) {
    if (experts[k].size() != values[k].size()) {
      throw std::invalid_argument("an EP rank's operator kinds do not match its values");
    }
    auto& l = kinds.emplace_back();
    for (const bool e : experts[k])
      l.push_back(e ? models::op_kind::expert : models::op_kind::norm);
  }
  std::vector<T> out;
  for (const auto& a : canonical_order(kinds)) out.push_back(values[std::size_t(a.rank)][a.index]);
  return out;
}

template <class T>
bool coordinator::append_stage(int st, const std::vector<std::vector<T>>& values,
                               const std::vector<std::vector<bool>>& experts, std::vector<T>& out) {
  if (values.size() == 1) {
    out.insert(out.end(), values[0].begin(), values[0].end());
    return true;
  }
  try {
    const auto merged = merge_ranks(values, experts);
    out.insert(out.end(), merged.begin(), merged.end());
    return true;
  } catch (const std::invalid_argument& e) {
    fail(fmt::format("stage {}'s EP ranks reported operators that do not fit together: {}", st,
                     e.what()));
    return false;
  }
}

bool coordinator::plan_iteration() {
  // Every replica of a stage must hold the same reduced gradient (under expert parallelism,
  // every replica holding the same block of experts).
  std::vector<double> sq;
  const int ep = job_.ep;
  for (int st = 0; st < job_.pp; ++st) {
    for (int r = ep; r < job_.dp; ++r) {
      const auto& first = *sq_[std::size_t((r % ep) * job_.pp + st)];
      const auto& other = *sq_[std::size_t(r * job_.pp + st)];
      if (other.size() != first.size() ||
          std::memcmp(other.data(), first.data(), first.size() * sizeof(double)) != 0) {
        fail(fmt::format("replicas of stage {} disagree on the reduced gradient at iteration {}",
                         st, iteration_));
        return false;
      }
    }
    std::vector<std::vector<double>> ranks;
    std::vector<std::vector<bool>> experts;
    for (int k = 0; k < ep; ++k) {
      ranks.push_back(*sq_[std::size_t(k * job_.pp + st)]);
      experts.push_back(expert_ops_[std::size_t(k * job_.pp + st)]);
    }
    if (!append_stage(st, ranks, experts, sq)) return false;
  }
  last_ = iteration_record{};
  last_.iteration = iteration_;
  last_.group_form_s = std::exchange(group_form_s_, 0.0);
  last_.device_sum_s = std::exchange(device_sum_s_, 0.0);
  last_.loss_scale = scaler_.scale;
  plan_ = models::plan_step(sq, scaler_, job_.train.grad_clip);
  last_.applied = plan_.apply;
  last_.grad_norm = plan_.grad_norm;
  // The reference's order: replica-major, micro-batch-minor.
  const int mbs = job_.train.micro_batches;
  for (int r = 0; r < job_.dp; ++r) {
    for (int mb = 0; mb < mbs; ++mb) {
      last_.loss += (*losses_[std::size_t(r * job_.pp + job_.pp - 1)])[std::size_t(mb)];
      double aux = 0.0;
      for (int st = 0; st < job_.pp; ++st) aux += (*aux_[std::size_t(r * job_.pp + st)])[mb];
      last_.aux_loss += aux;
    }
  }
  last_.loss /= mbs * job_.dp;
  last_.aux_loss /= mbs * job_.dp;
  for (double c : compute_s_) {
    last_.max_compute_s = std::max(last_.max_compute_s, c);
    last_.mean_compute_s += c / double(compute_s_.size());
  }
  for (const auto n : expert_refused_) last_.expert_rows_refused += n;
  for (double w : expert_wait_s_) {
    last_.max_expert_wait_s = std::max(last_.max_expert_wait_s, w);
    last_.mean_expert_wait_s += w / double(expert_wait_s_.size());
  }
  return true;
}

void coordinator::send_steps() {
  // Popularity of each stage, summed over its replicas in replica order.
  std::vector<std::vector<double>> stage_pop(std::size_t(job_.pp));
  for (int st = 0; st < job_.pp && replicates(); ++st) {
    for (int r = 0; r < job_.dp; ++r) {
      const auto& p = pop_[std::size_t(r * job_.pp + st)];
      if (!p) continue;
      auto& acc = stage_pop[std::size_t(st)];
      if (acc.empty()) acc.assign(p->size(), 0.0);
      if (acc.size() != p->size()) continue;
      for (std::size_t k = 0; k < acc.size(); ++k) acc[k] += (*p)[k];
    }
  }
  phase_ = phase::stepping;
  steps_sent_ = sclock::now();
  verify_ = verify_for(iteration_);
  verify_reports_.assign(stages_.size(), {});
  last_.verified = verify_ == wire::Verify::STATE     ? "state"
                   : verify_ == wire::Verify::WEIGHTS ? "weights"
                                                      : "none";
  // The window the stages checkpoint by (W_sparse, or the interval k), from the policy, which
  // keeps what it needs of this iteration (the step a replay applies, the loss scaler).
  checkpoint_place place;
  std::int64_t keep_from = -1;  // the steps the stages keep for a standby head (Step.keepFrom)
  if (recovery_) {
    planned_iteration planned;
    planned.iteration = iteration_;
    planned.step = {last_.loss_scale, plan_};
    planned.scaler = scaler_;
    planned.seconds = std::chrono::duration<double>(sclock::now() - iteration_start_).count();
    planned.compute_s = compute_s_;
    place = recovery_->planned(planned);
    keep_from = recovery_->steps_kept_from();
  }
  // engine.head_exit_at (tests): the head lost while its Steps go out, half of them sent.
  const bool exit_now = job_.head_exit_at == iteration_ && taken_over_.empty();
  if (exit_now) {
    (void)system().post_call(self(), [](actors::actor& a) -> awaitable<void> {
      co_await a.system().sleep_for(std::chrono::milliseconds(100));  // the sent ones go out
      ::kill(::getpid(), SIGKILL);
    });
  }
  for (int d = 0; d < job_.dp; ++d) {
    for (int st = 0; st < job_.pp; ++st) {
      if (exit_now && d * job_.pp + st >= job_.workers() / 2) continue;
      send_step(stage_ref(st, d), epoch_, plan_, place, keep_from, stage_pop[std::size_t(st)],
                verify_);
    }
  }
}

void coordinator::send_step(const actor_ref& to, std::uint64_t epoch, const models::step_plan& plan,
                            const checkpoint_place& place, std::int64_t keep_from,
                            std::span<const double> popularity, wire::Verify verify) {
  (void)tell<wire::Step>(to, [&](wire::Step::Builder b) {
    b.setVerify(verify);
    b.setEpoch(epoch);
    b.setApply(plan.apply);
    b.setGradMul(plan.grad_mul);
    b.setGradNorm(plan.grad_norm);
    b.setWSparse(place.w_sparse);
    b.setWindow(place.window);
    b.setSlot(place.slot);
    b.setKeepFrom(keep_from);
    auto l = b.initPopularity(static_cast<unsigned>(popularity.size()));
    for (unsigned k = 0; k < popularity.size(); ++k) l.set(k, popularity[k]);
  });
}

int coordinator::live_stages() const {
  return int(
      std::count_if(stages_.begin(), stages_.end(), [](const actor_ref& r) { return r.valid(); }));
}

awaitable<void> coordinator::stepped(wire::Stepped::Reader m) {
  const int s = m.getStage(), d = m.getReplica();
  if (phase_ != phase::stepping || m.getEpoch() != epoch_ || s < 0 || s >= job_.pp || d < 0 ||
      d >= job_.dp) {
    co_return;
  }
  const std::size_t i = std::size_t(d * job_.pp + s);
  if (stepped_flags_[i]) co_return;
  stepped_flags_[i] = true;
  last_.snapshot_bytes += m.getSnapshotBytes();
  last_.snapshot_host_bytes += m.getSnapshotHostBytes();
  last_.snapshot_host_bytes_by_stage.resize(stages_.size());
  last_.snapshot_host_bytes_by_stage[i] = m.getSnapshotHostBytes();
  last_.log_host_bytes += m.getLogHostBytes();
  last_.snapshot_lent_bytes += m.getSnapshotLentBytes();
  last_.replica_maps += m.getReplicaMaps();
  last_.replica_pulls += m.getReplicaPulls();
  last_.capture_cpu_s += m.getCaptureCpuSeconds();
  last_.replication_cpu_s += std::max(0.0, m.getReplicationCpuSeconds());
  last_.fresh_bytes += m.getFreshBytes();
  last_.peak_rss_bytes = std::max<std::uint64_t>(last_.peak_rss_bytes, m.getPeakRssBytes());
  windows_skipped_.resize(stages_.size(), 0);
  skips_noticed_.resize(stages_.size());
  if (const auto skipped = m.getWindowsSkipped(); skipped != windows_skipped_[i]) {
    if (skipped < windows_skipped_[i]) skips_noticed_[i] = {};  // a new worker: its own first
    const auto now = sclock::now();
    if (skipped > windows_skipped_[i] && (skips_noticed_[i] == sclock::time_point{} ||
                                          now - skips_noticed_[i] >= std::chrono::minutes(1))) {
      skips_noticed_[i] = now;
      notice(fmt::format(
          "stage {} replica {} captured nothing of a window ({} skipped so far): it holds as "
          "many windows as it may and none persisted within the wait (snapshot replication is "
          "stuck; memory stays bounded, and a recovery replays from the last persisted window)",
          s, d, skipped));
    }
    windows_skipped_[i] = skipped;
  }
  last_.windows_skipped = 0;
  for (const auto n : windows_skipped_) last_.windows_skipped += n;
  last_.stall_s = std::max(last_.stall_s, m.getStallSeconds());
  last_.log_s = std::max(last_.log_s, m.getLogSeconds());
  last_.step_hooks_s = std::max(last_.step_hooks_s, m.getStepHookSeconds());
  last_.verify_s = std::max(last_.verify_s, m.getVerifySeconds());
  if (i < verify_reports_.size() && m.getDigests().size() > 0) {
    auto& r = verify_reports_[i];
    for (auto x : m.getDigests()) r.digests.push_back(x);
    if (i < expert_ops_.size()) r.experts = expert_ops_[i];
  }
  co_await maybe_stepped_all();
}

awaitable<void> coordinator::maybe_stepped_all() {
  if (phase_ != phase::stepping) co_return;
  for (std::size_t i = 0; i < stages_.size(); ++i) {
    if (stages_[i].valid() && !stepped_flags_[i]) co_return;
  }
  if (std::exchange(completing_takeover_, false)) {
    // The lost head's last iteration, completed (engine/takeover.hpp): its record went with
    // that head.
    ++iteration_;
    if (recovering()) {
      phase_ = phase::paused;
      co_await recovery_->go_on();
      co_return;
    }
    if (co_await wire_all()) co_await after_iteration();
    co_return;
  }
  const double secs = std::chrono::duration<double>(sclock::now() - iteration_start_).count();
  train_seconds_ += secs;
  // A stage lost after it stepped: the others' steps commit the iteration now, its time
  // spent mostly waiting for that loss to be found.
  if (std::any_of(stages_.begin(), stages_.end(), [](const actor_ref& r) { return !r.valid(); })) {
    attempt_spanned_recovery_ = true;
  }
  if (!attempt_spanned_recovery_) last_clean_s_ = secs;
  committed_s_[last_.iteration] = attempt_spanned_recovery_ ? std::min(secs, last_clean_s_) : secs;
  last_.seconds = secs;
  last_.step_phase_s = std::chrono::duration<double>(sclock::now() - steps_sent_).count();
  const double tokens =
      double(job_.train.micro_batches) * job_.train.micro_batch_size * job_.train.seq_len * job_.dp;
  last_.tokens_per_s = secs > 0 ? tokens / secs : 0.0;
  last_.attempts = attempts_;
  attempts_ = 0;
  if (log_ != nullptr) {
    json_record rec;
    rec.add("kind", "iteration")
        .add("iteration", last_.iteration)
        .add("loss", last_.loss)
        .add("aux_loss", last_.aux_loss)
        .add("grad_norm", last_.grad_norm)
        .add("applied", last_.applied)
        .add("loss_scale", double(last_.loss_scale))
        .add("iteration_s", last_.seconds)
        .add("tokens_per_s", last_.tokens_per_s)
        .add("step_phase_s", last_.step_phase_s)
        .add("max_stage_compute_s", last_.max_compute_s)
        .add("mean_stage_compute_s", last_.mean_compute_s)
        .add("attempts", last_.attempts)
        .add("peak_worker_rss_bytes", std::int64_t(last_.peak_rss_bytes))
        .add("verified", last_.verified)
        .add("verify_s", last_.verify_s)
        .add("time_s", log_->seconds());
    if (job_.ep > 1) {
      rec.add("max_expert_wait_s", last_.max_expert_wait_s)
          .add("mean_expert_wait_s", last_.mean_expert_wait_s)
          .add("expert_rows_refused", std::int64_t(last_.expert_rows_refused));
    }
    if (replicates()) {
      last_.replication_lag = recovery_->replication_lag(last_.iteration);
      rec.add("snapshot_bytes", std::int64_t(last_.snapshot_bytes))
          .add("snapshot_lent_bytes", std::int64_t(last_.snapshot_lent_bytes))
          .add("replica_maps", std::int64_t(last_.replica_maps))
          .add("replica_pulls", std::int64_t(last_.replica_pulls))
          .add("stall_s", last_.stall_s)
          .add("log_s", last_.log_s)
          .add("step_hooks_s", last_.step_hooks_s)
          .add("capture_cpu_s", last_.capture_cpu_s)
          .add("replication_cpu_s", last_.replication_cpu_s)
          .add("snapshot_fresh_bytes", std::int64_t(last_.fresh_bytes))
          .add("windows_skipped", std::int64_t(last_.windows_skipped))
          .add("snapshot_host_bytes", std::int64_t(last_.snapshot_host_bytes))
          .add("snapshot_host_bytes_by_stage",
               fmt::format("{}", fmt::join(last_.snapshot_host_bytes_by_stage, ",")))
          .add("log_host_bytes", std::int64_t(last_.log_host_bytes))
          .add("replication_lag", last_.replication_lag);
    }
    if (job_.dp > 1 && models::uses_nccl(job_.train)) {
      rec.add("group_form_s", last_.group_form_s).add("device_sum_s", last_.device_sum_s);
    }
    log_->write(rec);
  }
  if (callbacks_.on_iteration) callbacks_.on_iteration(last_);
  if (recovery_ && !recovering()) {
    recovery_->stepped({last_.iteration, last_.seconds, last_.stall_s, last_.log_s,
                        last_.capture_cpu_s, last_.replication_cpu_s, last_.snapshot_bytes,
                        last_.fresh_bytes});
  }
  ++iteration_;
  // A replica found corrupted goes before anything reads its state again (coordinator_verify).
  if (!recovering() && co_await verify_replicas()) co_return;
  if (!recovering() && co_await shadow_check()) co_return;
  if (recovering()) {  // a stage was lost while the others stepped: rebuild it one further
    phase_ = phase::paused;
    co_await recovery_->go_on();
    co_return;
  }
  co_await after_iteration();
}

awaitable<void> coordinator::after_iteration() {
  if (finished_) co_return;
  const bool last = iteration_ >= job_.train.iterations;
  const bool validate_now = job_.train.val_every > 0 && iteration_ % job_.train.val_every == 0;
  if ((last || validate_now) && job_.train.val_batches > 0 && (phase_ != phase::validating)) {
    start_validation();
    co_return;
  }
  co_await go_on();
}

awaitable<void> coordinator::go_on() {
  if (iteration_ >= job_.train.iterations) {
    co_await finish();
    co_return;
  }
  if (pause_requested_) {
    phase_ = phase::paused;
    co_return;
  }
  start_iteration();
}

void coordinator::start_validation() {
  phase_ = phase::validating;
  validation_start_ = sclock::now();
  ++val_round_;
  val_losses_.assign(std::size_t(job_.train.val_batches), std::nullopt);
  const std::uint64_t round = val_round_;
  const int batches = job_.train.val_batches;
  (void)tell<wire::Validate>(stage_ref(0, 0), [&](wire::Validate::Builder b) {
    b.setRound(round);
    b.setBatches(batches);
  });
}

awaitable<void> coordinator::val_loss(wire::ValLoss::Reader m) {
  const int i = m.getIndex();
  if (phase_ != phase::validating || m.getRound() != val_round_ || i < 0 ||
      i >= int(val_losses_.size()) || val_losses_[std::size_t(i)]) {
    co_return;
  }
  val_losses_[std::size_t(i)] = m.getLoss();
  for (const auto& v : val_losses_) {
    if (!v) co_return;
  }
  double sum = 0.0;  // in index order, as the reference sums
  for (const auto& v : val_losses_) sum += *v;
  const double val = sum / double(val_losses_.size());
  last_val_ = val;
  validation_s_ += std::chrono::duration<double>(sclock::now() - validation_start_).count();
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "validation")
                    .add("iteration", iteration_ - 1)
                    .add("val_loss", val));
  }
  if (callbacks_.on_validation) callbacks_.on_validation(iteration_ - 1, val);
  phase_ = phase::running;  // leaves validating
  co_await go_on();
}

awaitable<void> coordinator::resume() {
  pause_requested_ = false;
  if (phase_ == phase::paused) start_iteration();
  co_return;
}

awaitable<void> coordinator::abort_iteration() {
  if (phase_ != phase::running) co_return;
  const std::uint64_t e = epoch_;
  phase_ = phase::paused;
  for (const actor_ref& r : stages_) {
    if (!r.valid()) continue;  // lost: being recovered
    auto fill = [e](wire::Abort::Builder b) { b.setEpoch(e); };
    auto res = co_await ask<wire::Abort, wire::AbortAck>(r, ask_timeout, fill);
    if (finished_) co_return;
    if (!res.ok()) {
      fail("aborting the iteration failed: " + res.err().message);
      co_return;
    }
  }
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "iteration_aborted")
                    .add("iteration", iteration_)
                    .add("epoch", std::int64_t(e)));
  }
  if (!pause_requested_) start_iteration();
}

awaitable<void> coordinator::finish() {
  if (callbacks_.before_finish) co_await callbacks_.before_finish();
  if (finished_) co_return;
  // replica 0 of every stage (under expert parallelism, EP ranks 0..ep-1: every block)
  const int ep = job_.ep;
  std::vector<actor_ref> first_replicas;
  for (int k = 0; k < ep; ++k) {
    for (int s = 0; s < job_.pp; ++s) first_replicas.push_back(stage_ref(s, k));
  }
  auto replies = co_await actors::ask_all<wire::DigestsQuery, wire::Digests>(
      *this, first_replicas, ask_timeout, [](std::size_t, wire::DigestsQuery::Builder) {});
  if (finished_) co_return;
  std::vector<std::uint64_t> digests;
  for (int s = 0; s < job_.pp; ++s) {
    std::vector<std::vector<std::uint64_t>> ranks;
    std::vector<std::vector<bool>> experts;
    for (int k = 0; k < ep; ++k) {
      const auto& r = replies[std::size_t(k * job_.pp + s)];
      if (!r.ok()) {
        fail(fmt::format("reading stage {}'s state failed: {}", s, r.err().message));
        co_return;
      }
      auto& values = ranks.emplace_back();
      for (const std::uint64_t v : r->get().getValues()) values.push_back(v);
      auto& flags = experts.emplace_back();
      for (const bool x : r->get().getExperts()) flags.push_back(x);
    }
    if (!append_stage(s, ranks, experts, digests)) co_return;
  }
  job_outcome o;
  o.ok = true;
  o.state_hash = models::state_hash(digests, scaler_);
  if (iteration_ > first_iteration_) o.final_loss = last_.loss;
  o.val_loss = last_val_;
  o.iterations = iteration_;
  o.first_iteration = first_iteration_;
  o.seconds = train_seconds_;
  o.tokens_per_s = train_seconds_ > 0
                       ? double(job_.train.micro_batches) * job_.train.micro_batch_size *
                             job_.train.seq_len * job_.dp * double(iteration_ - first_iteration_) /
                             train_seconds_
                       : 0.0;
  finish_with(std::move(o));
}

// ---- policy moevement: windows and recovery

}  // namespace moevement::engine
