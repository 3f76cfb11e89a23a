#include "engine/coordinator.hpp"

#include <fmt/format.h>

#include <asio/steady_timer.hpp>
#include <asio/this_coro.hpp>
#include <asio/use_awaitable.hpp>

#include <cstring>

#include "base/hash.hpp"
#include "engine/stage_model.hpp"

namespace moevement::engine {

namespace {

using actors::actor_ref;
using asio::awaitable;
using sclock = std::chrono::steady_clock;

constexpr auto ask_timeout = std::chrono::seconds(30);

using actors::read_ref;
using actors::write_ref;

}  // namespace

coordinator::coordinator(job_config job, models::config_map raw, coordinator_callbacks callbacks,
                         run_log* log)
    : job_(std::move(job)),
      raw_(std::move(raw)),
      callbacks_(std::move(callbacks)),
      log_(log),
      expected_workers_(job_.workers() + job_.spares),
      abort_at_(job_.abort_at) {
  stages_.resize(std::size_t(job_.workers()));
  scaler_.enabled = job_.model.compute_dtype == models::dtype::f16;
  scaler_.scale = scaler_.enabled ? job_.train.loss_scale : 1.0f;
  scaler_.window = job_.train.loss_scale_window;
  on<wire::WorkerHello>(&coordinator::hello);
  on<wire::StageReady>(&coordinator::ready);
  on<wire::StageDone>(&coordinator::stage_done);
  on<wire::Stepped>(&coordinator::stepped);
  on<wire::StageFailed>(&coordinator::stage_failed);
  on<wire::ValLoss>(&coordinator::val_loss);
}

awaitable<void> coordinator::on_start() {
  system().on_membership([this](transport::node_id n, actors::member_event e) {
    if (e == actors::member_event::up || finished_) return;
    auto it = workers_.find(n);
    if (it == workers_.end()) return;
    const worker_info& w = it->second;
    const std::string role = w.stage < 0 ? std::string("spare")
                                         : fmt::format("stage {}, replica {}", w.stage, w.replica);
    const std::string how = e == actors::member_event::goodbye ? "left the job" : "was lost";
    if (log_ != nullptr) {
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "worker_lost")
                      .add("node", std::int64_t{n})
                      .add("stage", w.stage)
                      .add("replica", w.replica)
                      .add("iteration", iteration_));
    }
    if (w.stage < 0 && started()) {  // a spare: training goes on, with one spare fewer
      workers_.erase(it);
      return;
    }
    fail(
        fmt::format("worker {} ({}, pid {}) {} at iteration {}; checkpoint.policy = {} cannot "
                    "recover a lost worker, so the job stops",
                    n, role, w.pid, how, iteration_, job_.policy));
  });
  co_return;
}

void coordinator::on_stop(const actors::exit_reason&) {
  system().on_membership({});
}

void coordinator::fail(const std::string& message) {
  if (finished_) return;
  job_outcome o;
  o.ok = false;
  o.message = message;
  o.iterations = iteration_;
  finish_with(std::move(o));
}

void coordinator::finish_with(job_outcome outcome) {
  if (finished_) return;
  finished_ = true;
  phase_ = phase::done;
  if (log_ != nullptr) {
    json_record r;
    r.add("kind", "event").add("event", outcome.ok ? "job_end" : "job_failed");
    r.add("iterations", outcome.iterations);
    if (outcome.ok) {
      r.add("state_hash", hex16(outcome.state_hash));
    } else {
      r.add("message", outcome.message);
    }
    log_->write(r);
  }
  // Every worker process shuts down (those still there).
  for (const auto& [n, w] : workers_) {
    if (w.agent.valid()) (void)tell<wire::Shutdown>(w.agent);
  }
  if (callbacks_.on_finished) callbacks_.on_finished(outcome);
}

awaitable<void> coordinator::hello(wire::WorkerHello::Reader m) {
  const transport::node_id n = m.getNode();
  const actor_ref agent = read_ref(m.getAgent());
  if (phase_ != phase::admitting || n < 1 || n > transport::node_id(expected_workers_) ||
      workers_.contains(n) || agent.node != n || m.getHost().size() > 255) {
    co_return;  // not one of ours, or twice: ignored
  }
  worker_info w;
  w.node = n;
  w.host = m.getHost();
  w.port = m.getPort();
  w.pid = m.getPid();
  w.agent = agent;
  const int idx = int(n) - 1;
  if (idx < job_.workers()) {
    w.stage = idx % job_.pp;
    w.replica = idx / job_.pp;
  }
  workers_[n] = w;
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "worker_up")
                    .add("node", std::int64_t{n})
                    .add("pid", w.pid)
                    .add("stage", w.stage)
                    .add("replica", w.replica));
  }
  if (int(workers_.size()) < expected_workers_) co_return;
  // Everyone is here: every worker learns every address, the config and its role.
  phase_ = phase::starting;
  for (const auto& [node, info] : workers_) {
    const worker_info& me = info;
    (void)tell<wire::Assign>(me.agent, [&](wire::Assign::Builder b) {
      auto peers = b.initPeers(static_cast<unsigned>(workers_.size()));
      unsigned i = 0;
      for (const auto& [pn, pw] : workers_) {
        peers[i].setNode(pn);
        peers[i].setHost(pw.host);
        peers[i].setPort(pw.port);
        ++i;
      }
      write_config(b.initConfig(), raw_);
      b.setStage(me.stage);
      b.setReplica(me.replica);
      write_ref(b.initCoordinator(), self());
    });
  }
}

awaitable<void> coordinator::ready(wire::StageReady::Reader m) {
  auto it = workers_.find(m.getNode());
  if (phase_ != phase::starting || it == workers_.end()) co_return;
  worker_info& w = it->second;
  if (m.getError().size() > 0) {
    fail(fmt::format("worker {} could not start its stage: {}", w.node, std::string(m.getError())));
    co_return;
  }
  if (w.stage >= 0) {
    const actor_ref r = read_ref(m.getActor());
    if (r.node != w.node || m.getStage() != w.stage || m.getReplica() != w.replica) {
      fail(fmt::format("worker {} reported an inconsistent stage", w.node));
      co_return;
    }
    w.stage_actor = r;
    stages_[std::size_t(w.replica * job_.pp + w.stage)] = r;
    monitor(r);  // a stage actor that stops (its handler threw) ends the job, never a hang
  }
  if (++ready_count_ == expected_workers_) co_await wire_and_start();
}

awaitable<void> coordinator::wire_and_start() {
  for (int d = 0; d < job_.dp; ++d) {
    for (int s = 0; s < job_.pp; ++s) {
      const actor_ref prev = s > 0 ? stage_ref(s - 1, d) : actor_ref{};
      const actor_ref next = s + 1 < job_.pp ? stage_ref(s + 1, d) : actor_ref{};
      std::vector<actor_ref> reps;
      for (int r = 0; r < job_.dp; ++r) reps.push_back(stage_ref(s, r));
      auto fill = [&](wire::Wire::Builder b) {
        write_ref(b.initPrev(), prev);
        write_ref(b.initNext(), next);
        auto l = b.initReplicas(static_cast<unsigned>(reps.size()));
        for (unsigned i = 0; i < reps.size(); ++i) write_ref(l[i], reps[i]);
      };
      auto r = co_await ask<wire::Wire, wire::WireAck>(stage_ref(s, d), ask_timeout, fill);
      if (finished_) co_return;
      if (!r.ok()) {
        fail(fmt::format("wiring stage {} replica {} failed: {}", s, d, r.err().message));
        co_return;
      }
    }
  }
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "job_start")
                    .add("pp", job_.pp)
                    .add("dp", job_.dp)
                    .add("spares", job_.spares)
                    .add("iterations", job_.train.iterations));
  }
  job_start_ = sclock::now();
  if (job_.train.iterations <= 0) {
    co_await finish();
    co_return;
  }
  start_iteration();
}

void coordinator::start_iteration() {
  phase_ = phase::running;
  ++epoch_;
  ++attempts_;
  const std::size_t n = stages_.size();
  sq_.assign(n, std::nullopt);
  losses_.assign(n, std::nullopt);
  aux_.assign(n, std::nullopt);
  compute_s_.assign(n, 0.0);
  done_count_ = stepped_count_ = 0;
  iteration_start_ = sclock::now();
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
  aux_[i] = to_vector(m.getAuxLosses());
  if (s == job_.pp - 1) losses_[i] = to_vector(m.getLosses());
  compute_s_[i] = m.getComputeSeconds();
  ++done_count_;
  if (abort_at_ == iteration_) {
    abort_at_ = -1;
    co_await abort_iteration();
    co_return;
  }
  if (done_count_ < int(stages_.size())) co_return;

  // Every replica of a stage must hold the same reduced gradient.
  std::vector<double> sq;
  for (int st = 0; st < job_.pp; ++st) {
    const auto& first = *sq_[std::size_t(st)];
    for (int r = 1; r < job_.dp; ++r) {
      const auto& other = *sq_[std::size_t(r * job_.pp + st)];
      if (other.size() != first.size() ||
          std::memcmp(other.data(), first.data(), first.size() * sizeof(double)) != 0) {
        fail(fmt::format("replicas of stage {} disagree on the reduced gradient at iteration {}",
                         st, iteration_));
        co_return;
      }
    }
    sq.insert(sq.end(), first.begin(), first.end());
  }
  last_ = iteration_record{};
  last_.iteration = iteration_;
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
  phase_ = phase::stepping;
  const std::uint64_t e = epoch_;
  const bool apply = plan_.apply;
  const float mul = plan_.grad_mul;
  for (const actor_ref& r : stages_) {
    (void)tell<wire::Step>(r, [&](wire::Step::Builder b) {
      b.setEpoch(e);
      b.setApply(apply);
      b.setGradMul(mul);
    });
  }
}

awaitable<void> coordinator::stepped(wire::Stepped::Reader m) {
  if (phase_ != phase::stepping || m.getEpoch() != epoch_) co_return;
  if (++stepped_count_ < int(stages_.size())) co_return;
  const double secs = std::chrono::duration<double>(sclock::now() - iteration_start_).count();
  train_seconds_ += secs;
  last_.seconds = secs;
  const double tokens =
      double(job_.train.micro_batches) * job_.train.micro_batch_size * job_.train.seq_len * job_.dp;
  last_.tokens_per_s = secs > 0 ? tokens / secs : 0.0;
  last_.attempts = attempts_;
  attempts_ = 0;
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "iteration")
                    .add("iteration", last_.iteration)
                    .add("loss", last_.loss)
                    .add("aux_loss", last_.aux_loss)
                    .add("grad_norm", last_.grad_norm)
                    .add("applied", last_.applied)
                    .add("loss_scale", double(last_.loss_scale))
                    .add("iteration_s", last_.seconds)
                    .add("tokens_per_s", last_.tokens_per_s)
                    .add("max_stage_compute_s", last_.max_compute_s)
                    .add("mean_stage_compute_s", last_.mean_compute_s)
                    .add("attempts", last_.attempts));
  }
  if (callbacks_.on_iteration) callbacks_.on_iteration(last_);
  ++iteration_;
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
  if (last) {
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
  last_val_ = sum / double(val_losses_.size());
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "validation")
                    .add("iteration", iteration_ - 1)
                    .add("val_loss", last_val_));
  }
  if (callbacks_.on_validation) callbacks_.on_validation(iteration_ - 1, last_val_);
  phase_ = phase::running;  // leaves validating; after_iteration decides what is next
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

awaitable<void> coordinator::on_down(actor_ref who, actors::exit_reason why) {
  if (finished_) co_return;
  for (const auto& [n, w] : workers_) {
    if (w.stage_actor == who) {
      fail(fmt::format("the actor of stage {} replica {} (worker {}) stopped: {}", w.stage,
                       w.replica, n, why.to_string()));
      co_return;
    }
  }
}

awaitable<void> coordinator::stage_failed(wire::StageFailed::Reader m) {
  // A stage usually fails because a peer died under it (a pull broke). The head learns of
  // that death itself within the failure timeout, with the better message (which worker,
  // how it died): wait that long before blaming the stage.
  std::string message = "a stage failed: " + std::string(m.getMessage());
  asio::steady_timer grace(co_await asio::this_coro::executor,
                           std::chrono::milliseconds(job_.failure_timeout_ms + 200));
  co_await grace.async_wait(asio::use_awaitable);
  fail(message);
}

awaitable<void> coordinator::finish() {
  std::vector<std::uint64_t> digests;
  for (int s = 0; s < job_.pp; ++s) {
    auto r = co_await ask<wire::DigestsQuery, wire::Digests>(stage_ref(s, 0), ask_timeout);
    if (finished_) co_return;
    if (!r.ok()) {
      fail(fmt::format("reading stage {}'s state failed: {}", s, r.err().message));
      co_return;
    }
    for (auto v : r->get().getValues()) digests.push_back(v);
  }
  job_outcome o;
  o.ok = true;
  o.state_hash = models::state_hash(digests, scaler_);
  o.final_loss = last_.loss;
  o.val_loss = last_val_;
  o.iterations = iteration_;
  o.seconds = train_seconds_;
  o.tokens_per_s = train_seconds_ > 0
                       ? double(job_.train.micro_batches) * job_.train.micro_batch_size *
                             job_.train.seq_len * job_.dp * double(iteration_) / train_seconds_
                       : 0.0;
  finish_with(std::move(o));
}

}  // namespace moevement::engine
