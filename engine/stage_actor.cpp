#include "engine/stage_actor.hpp"

#include <fmt/format.h>
#include <sys/resource.h>
#include <asio/co_spawn.hpp>
#include <asio/post.hpp>
#include <asio/use_awaitable.hpp>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "models/cuda/collectives.hpp"

namespace moevement::engine {

namespace {

using actors::actor_ref;
using asio::awaitable;
using transport::bulk_descriptor;

using actors::read_ref;
using transport::read_descriptor;

// A region of at least one float (UCX refuses empty allocations).
transport::bulk_region allocate_floats(bulk_io& io, std::size_t n) {
  return io.allocate(std::max<std::size_t>(n, 1) * sizeof(float));
}

bool tracing() {
  static const bool on = std::getenv("MOEVEMENT_TRACE_STAGES") != nullptr;
  return on;
}

// The trace's timestamps: one clock for every process of the host, so that their lines merge.
double trace_clock() {
  timespec t{};
  ::clock_gettime(CLOCK_MONOTONIC, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

}  // namespace

#define STAGE_TRACE(...)                                                                     \
  do {                                                                                       \
    if (tracing())                                                                           \
      fmt::print(stderr, "{:.6f} [stage {} r{} e{} ph{}] {}\n", trace_clock(), setup_.stage, \
                 setup_.replica, epoch_, int(phase_), fmt::format(__VA_ARGS__));             \
  } while (0)

stage_actor::stage_actor(stage_actor_args args)
    : setup_(std::move(args.setup)),
      model_(std::move(args.model)),
      io_(*args.io),
      coordinator_(args.coordinator),
      hooks_(args.hooks ? std::move(args.hooks) : std::make_unique<stage_hooks>()),
      faults_(std::move(args.faults)),
      ops_(model_->operators()),
      plan_(one_f_one_b(setup_.stage, setup_.stages, setup_.train.micro_batches)),
      bf_(model_->boundary_floats()),
      gf_(gradient_floats(ops_)),
      m_(setup_.train.micro_batches),
      router_(std::move(args.experts)) {
  while (first_backward_ < plan_.size() && plan_[first_backward_].what != pass::backward) {
    ++first_backward_;
  }
  const std::size_t slots = std::size_t(m_) * bf_;
  act_out_ = allocate_floats(io_, slots);
  grad_out_ = allocate_floats(io_, slots);
  red_out_ = allocate_floats(io_, gf_);
  val_out_ = allocate_floats(io_, std::size_t(std::max(setup_.train.val_batches, 1)) * bf_);
  in_ = std::make_shared<incoming>();
  in_->act.resize(setup_.first() ? 0 : slots);
  in_->grad.resize(setup_.last() ? 0 : slots);
  in_->val.resize(setup_.first() ? 0 : bf_);
  act_epoch_.assign(std::size_t(m_), 0);
  grad_epoch_.assign(std::size_t(m_), 0);

  on<wire::Wire, wire::WireAck>(&stage_actor::wire);
  on<wire::Iterate>(&stage_actor::iterate);
  on<wire::Activation>(&stage_actor::activation);
  on<wire::Gradient>(&stage_actor::gradient);
  on<wire::ReducePartial>(&stage_actor::reduce_partial);
  on<wire::ReduceTotal>(&stage_actor::reduce_total);
  on<wire::ReduceGroup>(&stage_actor::reduce_group);
  if (setup_.replicas > 1 && model_->device() != nullptr) {
    reduction_ = model_->device()->reduction();
  }
  on<wire::Step>(&stage_actor::step);
  on<wire::Abort, wire::AbortAck>(&stage_actor::abort);
  on<wire::Validate>(&stage_actor::validate);
  on<wire::ValActivation>(&stage_actor::val_activation);
  on<wire::DigestsQuery, wire::Digests>(&stage_actor::digests);
  on<wire::StageStateQuery, wire::StageState>(&stage_actor::state);
  if (setup_.initialize) stepped_ = -1;
  if (router_) {
    if (model_->experts() == nullptr) {
      throw std::invalid_argument("stage_actor: expert parallelism with a stage without experts");
    }
    router_->attach(model_->experts());
    router_->set_watch(watch_);
    model_->set_expert_exchange(router_.get());
    for (auto* op : ops_) {
      if (op->kind() != models::op_kind::expert) dense_ops_.push_back(op);
    }
    dense_floats_ = gradient_floats(dense_ops_);
  }
}

awaitable<void> stage_actor::on_start() {
  if (router_) {
    // Rows for this replica's experts that arrive while its compute thread is elsewhere: a turn
    // of this actor serves them there (a turn waits while the actor is busy, e.g. computing,
    // and the exchange it waits in serves them meanwhile).
    router_->set_wake([sys = &system(), me = self()] {
      (void)sys->post_call(me, [](actors::actor& a) -> awaitable<void> {
        auto& s = static_cast<stage_actor&>(a);
        co_await s.compute([&s] { s.router_->serve_pending(); });
      });
    });
    // The last rows of this block's backwards came from a peer after this stage's own
    // backwards ended: its fold goes on.
    router_->set_on_complete([sys = &system(), me = self()] {
      asio::post(sys->io(), [sys, me] {
        (void)sys->post_call(me, [](actors::actor& a) -> awaitable<void> {
          auto& s = static_cast<stage_actor&>(a);
          if (s.phase_ == phase::reducing) co_await s.reduce();
        });
      });
    });
  }
  // The reduction's pull targets hold a stage's gradient each (55 MB per stage of the small
  // preset): zero-filled on the compute thread, so that this node's heartbeats go on (on the
  // actor thread, five such processes on two cores went silent past the failure timeout).
  // No message is handled before on_start() returns.
  if (setup_.replicas > 1) {
    co_await compute([this] {
      // under expert parallelism every replica takes part in two folds: both buffers
      in_->partial.resize(setup_.replica > 0 || router_ ? gf_ : 0);
      in_->total.resize(setup_.replica < setup_.replicas - 1 || router_ ? gf_ : 0);
    });
  }
}

stage_actor::~stage_actor() {
  // an exchange waiting on a peer returns (stopped): the compute thread joins
  if (router_) router_->stop("the stage stopped");
  stop_sum_ = true;  // a sum waiting on a peer returns (aborted): the compute thread joins
  pool_.join();
  if (router_) {  // after the join: the compute thread may have been calling them
    router_->set_wake({});
    router_->set_on_complete({});
  }
  // Log copies still queued read the send slots, which go with this actor (at most one
  // iteration's sends, and a recovery may still read them from the log).
  try {
    if (hooks_) hooks_->settle_sends();
  } catch (const std::exception&) {  // (out of memory) the log lacks them: a replay says so
  }
  // The model's memory goes back off the actor thread (actors/disposer.hpp), after the hooks:
  // a capture in flight reads the operators (the hooks' destructor waits for it). Freeing a
  // demo-scale stage, or waiting out its capture, held the heartbeats past the failure timeout
  // when a standby head rebuilt every stage at once on two cores. A GPU stage's state is the
  // device's: freed here, where its context is current.
  if (model_ && model_->device() == nullptr && (!hooks_ || hooks_->disposable())) {
    struct remains {  // destroyed in reverse: the hooks, then the model
      std::unique_ptr<stage_model> model;
      std::unique_ptr<stage_hooks> hooks;
    };
    system().dispose(remains{std::move(model_), std::move(hooks_)});
  }
  hooks_.reset();  // (before the model, here too)
}

awaitable<void> stage_actor::on_compute_thread(std::function<void()> fn) {
  co_await compute(fn);
}

void stage_actor::fail(const std::string& what) {
  STAGE_TRACE("fail: {}", what);
  if (failed_) return;
  failed_ = true;
  const std::string msg =
      fmt::format("stage {} replica {}: {}", setup_.stage, setup_.replica, what);
  (void)tell<wire::StageFailed>(coordinator_, [&](wire::StageFailed::Builder b) {
    b.setStage(setup_.stage);
    b.setReplica(setup_.replica);
    b.setMessage(msg);
  });
}

bool stage_actor::accept(std::uint64_t epoch) {
  if (epoch == epoch_ && phase_ != phase::aborted && phase_ != phase::idle) return true;
  // A later epoch's inputs may arrive before its Iterate does, but only once this stage is
  // done with the current one (the coordinator starts an epoch after every stage finished).
  // Later, not only the next: a replacement stage starts at epoch 0 while the job is at some
  // epoch e, and its first inputs (for e) may beat its first Iterate (dropping them stalled
  // the job after a recovery). advance() uses an input only when its epoch is the current one.
  if (epoch > epoch_ &&
      (phase_ == phase::idle || phase_ == phase::stepped || phase_ == phase::aborted)) {
    return true;
  }
  ++dropped_;
  return false;
}

awaitable<bool> stage_actor::pull(const bulk_descriptor& d, std::span<float> into) {
  std::span<std::byte> bytes{reinterpret_cast<std::byte*>(into.data()), into.size_bytes()};
  auto r = co_await io_.pull(d, bytes, in_);
  if (!r.ok()) {
    fail("pull from node " + std::to_string(d.node) + " failed: " + r.err().message);
    co_return false;
  }
  co_return true;
}

awaitable<void> stage_actor::wire(wire::Wire::Reader m, wire::WireAck::Builder) {
  STAGE_TRACE("wire");
  prev_ = read_ref(m.getPrev());
  next_ = read_ref(m.getNext());
  replicas_.clear();
  for (auto a : m.getReplicas()) replicas_.push_back(read_ref(a));
  std::vector<actor_ref> replicators;
  for (auto a : m.getReplicators()) replicators.push_back(read_ref(a));
  hooks_->on_wired(replicators);
  if (replicas_.size() != std::size_t(setup_.replicas) ||
      !(replicas_[std::size_t(setup_.replica)] == self()) || prev_.valid() == setup_.first() ||
      next_.valid() == setup_.last()) {
    fail("inconsistent wiring from the coordinator");
    co_return;
  }
  wiring_ = m.getWiring();
  if (router_) {
    // this replica's EP group: ep consecutive replicas
    const auto all = m.getExperts();
    const int ep = router_->ep(), first = setup_.replica - router_->rank();
    if (all.size() != unsigned(setup_.replicas)) {
      fail("the wiring names no expert router of every replica");
      co_return;
    }
    std::vector<actor_ref> group;
    for (int k = 0; k < ep; ++k) group.push_back(read_ref(all[unsigned(first + k)]));
    for (const auto& peer : group) {
      if (!peer.valid()) {
        fail("the wiring names an invalid expert router");
        co_return;
      }
      if (!(peer == router_->actor())) system().monitor(router_->actor(), peer);
    }
    router_->set_peers(std::move(group));
    // This wiring's peers are alive: a stop for a peer of an older one (lost in the step, after
    // the abort that would have resumed the router) no longer holds.
    router_->resume();
  }
  if (reduction_ != nullptr) co_await form_group();
}

awaitable<void> stage_actor::form_group() {
  joined_ = false;
  std::vector<std::byte> id;
  std::string error;
  if (setup_.replica == 0) {
    co_await compute([&] {
      try {
        id = reduction_->new_group_id();
      } catch (const std::exception& e) {
        error = e.what();
      }
    });
    if (!error.empty()) {
      fail("NCCL: " + error);
      co_return;
    }
    const std::uint64_t w = wiring_;
    const kj::ArrayPtr<const kj::byte> bytes(reinterpret_cast<const kj::byte*>(id.data()),
                                             id.size());
    for (int r = 1; r < setup_.replicas; ++r) {
      (void)tell<wire::ReduceGroup>(replicas_[std::size_t(r)], [&](wire::ReduceGroup::Builder b) {
        b.setWiring(w);
        b.setId(bytes);
      });
    }
  } else if (early_wiring_ == wiring_ && !early_group_.empty()) {
    id = std::exchange(early_group_, {});
  } else {
    // The id comes in replica 0's ReduceGroup; meanwhile the old group goes (a peer in it may
    // be gone, and NCCL must never wait on one).
    co_await compute([&] { (void)reduction_->leave(); });
    co_return;
  }
  co_await join_group(std::move(id));
}

awaitable<void> stage_actor::join_group(std::vector<std::byte> id) {
  std::string error;
  co_await compute([&] {
    try {
      reduction_->join(id);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  if (!error.empty()) {
    fail("NCCL: " + error);
    co_return;
  }
  joined_ = true;
  joined_at_ = std::chrono::steady_clock::now();
  if (phase_ == phase::reducing) co_await device_reduce();
}

awaitable<void> stage_actor::reduce_group(wire::ReduceGroup::Reader m) {
  const auto id = m.getId();
  if (reduction_ == nullptr || setup_.replica == 0 || id.size() != models::cuda::group_id_bytes) {
    ++dropped_;
    co_return;
  }
  std::vector<std::byte> bytes(id.size());
  std::memcpy(bytes.data(), id.begin(), id.size());
  if (m.getWiring() > wiring_) {  // its Wire is still on the way
    early_wiring_ = m.getWiring();
    early_group_ = std::move(bytes);
    co_return;
  }
  if (m.getWiring() < wiring_ || joined_) {  // an older wiring's, or this one's again
    ++dropped_;
    co_return;
  }
  co_await join_group(std::move(bytes));
}

awaitable<void> stage_actor::iterate(wire::Iterate::Reader m) {
  STAGE_TRACE("iterate it={} epoch={} failed={}", m.getIteration(), m.getEpoch(), failed_);
  if (failed_ || m.getEpoch() <= epoch_) co_return;
  epoch_ = m.getEpoch();
  watch_->set_epoch(epoch_);
  iteration_ = m.getIteration();
  if (!stepped_) stepped_ = iteration_ - 1;  // a rebuilt stage is told where it goes on
  loss_scale_ = m.getLossScale();
  phase_ = phase::running;
  next_step_ = 0;
  dense_fold_.sent = dense_fold_.done = expert_fold_.sent = expert_fold_.done = false;
  losses_.assign(std::size_t(m_), 0.0);
  aux_.assign(std::size_t(m_), 0.0);
  compute_s_ = 0.0;
  log_s_ = 0.0;
  const std::int64_t it = iteration_;
  std::string error;
  co_await compute([&] {
    // The send slots are written again from here (a recovery may restart an iteration with no
    // step between): the log copies of the last sends are made first.
    try {
      hooks_->settle_sends();
    } catch (const std::exception& e) {
      error = std::string("logging the last sends failed: ") + e.what();
      return;
    }
    // Gradients that stay on the device leave the host's unused: zeroing them would be a pass
    // over 4 bytes per parameter for nothing (55 MiB per stage of the small preset).
    const device_state* d = model_->device();
    begin_operators(ops_, /*zero_grads=*/d == nullptr || !d->grads_on_device());
    model_->begin_iteration(it);
  });
  if (!error.empty()) {
    fail(error);
    co_return;
  }
  if (router_) {
    const std::uint64_t e = epoch_;
    co_await compute([&] { router_->begin_epoch(e); });  // serves rows that came early
  }
  co_await advance();
}

awaitable<void> stage_actor::advance() {
  const float loss_grad = loss_scale_ / float(m_ * setup_.replicas);
  while (!failed_ && phase_ == phase::running && next_step_ < plan_.size()) {
    const pipeline_step s = plan_[next_step_];
    bool done = false;
    if (s.what == pass::forward) {
      done = co_await forward_pass(s);
    } else {
      done = co_await backward_pass(s, loss_grad);
    }
    if (!done) co_return;  // it waits for its input, or the stage failed
    ++next_step_;
  }
  if (!failed_ && phase_ == phase::running && next_step_ == plan_.size()) {
    phase_ = phase::reducing;
    co_await reduce();
  }
}

awaitable<bool> stage_actor::forward_pass(pipeline_step s) {
  using sclock = std::chrono::steady_clock;
  const auto mb = std::size_t(s.micro_batch);
  const std::int64_t it = iteration_;
  if (!setup_.first() && act_epoch_[mb] != epoch_) co_return false;  // wait for the activation
  if (next_step_ == 0) co_await at_fault_point(fault_point::forward);
  bool bad = false;
  std::string error;
  STAGE_TRACE("forward mb={}", mb);
  co_await compute([&] {
    const auto t0 = sclock::now();
    std::span<const float> x;
    if (!setup_.first()) x = std::span<const float>(in_->act).subspan(mb * bf_, bf_);
    stage_output out;
    try {
      out = model_->forward(s.micro_batch, x);
    } catch (const std::exception& e) {  // an expert exchange stopped (a peer lost)
      error = e.what();
      return;
    }
    losses_[mb] = out.loss;
    aux_[mb] = out.aux_loss;
    if (!setup_.last()) {
      if (out.activation.size() != bf_) {
        bad = true;
        return;
      }
      auto slot = region_floats(act_out_).subspan(mb * bf_, bf_);
      std::copy(out.activation.begin(), out.activation.end(), slot.begin());
      if (faults_.send_flip) faults_.send_flip(it, s.micro_batch, slot);
      const auto l0 = sclock::now();
      hooks_->on_boundary_send(it, s.micro_batch, boundary::activation, slot);
      log_s_ += std::chrono::duration<double>(sclock::now() - l0).count();
    }
    compute_s_ += std::chrono::duration<double>(sclock::now() - t0).count();
  });
  STAGE_TRACE("forward done mb={}", mb);
  if (!error.empty()) {
    fail("forward: " + error);
    co_return false;
  }
  if (bad) {
    fail("the stage's forward returned an activation of the wrong size");
    co_return false;
  }
  if (!setup_.last()) {
    const auto d = act_out_.describe(mb * bf_ * sizeof(float), bf_ * sizeof(float));
    const std::uint64_t e = epoch_;
    (void)tell<wire::Activation>(next_, [&](wire::Activation::Builder b) {
      b.setEpoch(e);
      b.setMicroBatch(s.micro_batch);
      transport::write_descriptor(b.initTensor(), d);
    });
  }
  co_return true;
}

awaitable<bool> stage_actor::backward_pass(pipeline_step s, float loss_grad) {
  using sclock = std::chrono::steady_clock;
  const auto mb = std::size_t(s.micro_batch);
  const std::int64_t it = iteration_;
  if (!setup_.last() && grad_epoch_[mb] != epoch_) co_return false;  // wait for the gradient
  if (next_step_ == first_backward_) co_await at_fault_point(fault_point::backward);
  bool bad = false;
  std::string error;
  STAGE_TRACE("backward mb={}", mb);
  co_await compute([&] {
    const auto t0 = sclock::now();
    std::span<const float> g;
    if (!setup_.last()) g = std::span<const float>(in_->grad).subspan(mb * bf_, bf_);
    std::span<const float> dx;
    try {
      dx = model_->backward(s.micro_batch, g, loss_grad);
    } catch (const std::exception& e) {
      error = e.what();
      return;
    }
    if (!setup_.first()) {
      if (dx.size() != bf_) {
        bad = true;
        return;
      }
      auto slot = region_floats(grad_out_).subspan(mb * bf_, bf_);
      std::copy(dx.begin(), dx.end(), slot.begin());
      const auto l0 = sclock::now();
      hooks_->on_boundary_send(it, s.micro_batch, boundary::gradient, slot);
      log_s_ += std::chrono::duration<double>(sclock::now() - l0).count();
    }
    compute_s_ += std::chrono::duration<double>(sclock::now() - t0).count();
  });
  STAGE_TRACE("backward done mb={}", mb);
  if (!error.empty()) {
    fail("backward: " + error);
    co_return false;
  }
  if (bad) {
    fail("the stage's backward returned an input gradient of the wrong size");
    co_return false;
  }
  if (!setup_.first()) {
    const auto d = grad_out_.describe(mb * bf_ * sizeof(float), bf_ * sizeof(float));
    const std::uint64_t e = epoch_;
    (void)tell<wire::Gradient>(prev_, [&](wire::Gradient::Builder b) {
      b.setEpoch(e);
      b.setMicroBatch(s.micro_batch);
      transport::write_descriptor(b.initTensor(), d);
    });
  }
  co_return true;
}

awaitable<void> stage_actor::activation(wire::Activation::Reader m) {
  const int mb = m.getMicroBatch();
  auto d = read_descriptor(m.getTensor());
  if (setup_.first() || mb < 0 || mb >= m_ || !d.ok() || d->length != bf_ * sizeof(float)) {
    ++dropped_;
    co_return;
  }
  STAGE_TRACE("activation mb={} epoch={}", mb, m.getEpoch());
  if (!accept(m.getEpoch())) co_return;
  const std::uint64_t e = m.getEpoch();
  if (!co_await pull(*d, std::span<float>(in_->act).subspan(std::size_t(mb) * bf_, bf_))) {
    co_return;
  }
  act_epoch_[std::size_t(mb)] = e;
  STAGE_TRACE("activation pulled mb={}", mb);
  if (e == epoch_) co_await advance();
}

awaitable<void> stage_actor::gradient(wire::Gradient::Reader m) {
  const int mb = m.getMicroBatch();
  auto d = read_descriptor(m.getTensor());
  if (setup_.last() || mb < 0 || mb >= m_ || !d.ok() || d->length != bf_ * sizeof(float)) {
    ++dropped_;
    co_return;
  }
  STAGE_TRACE("gradient mb={} epoch={}", mb, m.getEpoch());
  if (!accept(m.getEpoch())) co_return;
  const std::uint64_t e = m.getEpoch();
  if (!co_await pull(*d, std::span<float>(in_->grad).subspan(std::size_t(mb) * bf_, bf_))) {
    co_return;
  }
  grad_epoch_[std::size_t(mb)] = e;
  STAGE_TRACE("gradient pulled mb={}", mb);
  if (e == epoch_) co_await advance();
}

awaitable<void> stage_actor::step(wire::Step::Reader m) {
  if (failed_ || m.getEpoch() != epoch_ || phase_ != phase::reduced) {
    ++dropped_;
    co_return;
  }
  models::step_plan plan;
  plan.apply = m.getApply();
  plan.grad_mul = m.getGradMul();
  plan.grad_norm = m.getGradNorm();
  const std::int64_t it = iteration_;
  std::vector<double> popularity;
  if (m.getPopularity().size() > 0) {
    std::vector<double> canonical;
    for (double x : m.getPopularity()) canonical.push_back(x);
    try {  // this rank's share, in its operators' order
      popularity = rank_popularity(canonical, ops_, expert_split_of(setup_));
    } catch (const std::invalid_argument&) {
      ++dropped_;  // a list of another shape: no counts this step (the schedule keeps its order)
    }
  }
  const checkpoint_step decided{{std::max(m.getWSparse(), 0), m.getWindow(), m.getSlot()},
                                popularity};
  co_await at_fault_point(fault_point::step);
  STAGE_TRACE("step");
  std::string error;
  // A GPU stage's state is on its device: its replicas are not compared (yet).
  verify_kind verify = verify_kind::none;
  if (model_->device() == nullptr) {
    if (m.getVerify() == wire::Verify::WEIGHTS) verify = verify_kind::weights;
    if (m.getVerify() == wire::Verify::STATE) verify = verify_kind::state;
  }
  std::vector<std::uint64_t> digests;
  double verify_s = 0.0;
  co_await compute([&] {
    using sclock = std::chrono::steady_clock;
    const auto seconds = [](sclock::time_point t0) {
      return std::chrono::duration<double>(sclock::now() - t0).count();
    };
    try {
      const auto h0 = sclock::now();
      {
        // It may wait for other workers (the job persisting a window, up to
        // checkpoint.max_window_wait_ms): not a compute of its own for the stuck-stage probe.
        const compute_watch::peer_wait waiting(watch_.get());
        hooks_->before_step(it, decided);
      }
      hooks_->on_step(it, loss_scale_ / float(m_ * setup_.replicas), plan);
      step_hook_s_ = seconds(h0);
      if (device_state* d = model_->device()) {
        // the optimizer on the device; the host's gradients only when the replicas reduced
        // them there
        d->step(plan, setup_.train, setup_.replicas > 1 && reduction_ == nullptr);
      } else {
        // The compute weights' digests as each operator is stepped (its bytes in cache).
        step_digests weights;
        apply_step(ops_, plan, setup_.train, verify == verify_kind::weights ? &weights : nullptr);
        digests = std::move(weights.values);
        verify_s = weights.seconds;
      }
      if (faults_.after_step) {
        try {
          faults_.after_step(it, ops_);
        } catch (const std::invalid_argument& e) {
          error = std::string("failure injection: ") + e.what();
          return;
        }
      }
      const auto h1 = sclock::now();
      hooks_->after_step(it, ops_);
      step_hook_s_ += seconds(h1);
      // The whole state after the capture began (it reads the same bytes beside this), and
      // after an injected flip: what the head compares.
      if (verify == verify_kind::state) {
        const auto v0 = sclock::now();
        digests = state_digests(ops_);
        verify_s = seconds(v0);
      }
    } catch (const std::exception& e) {
      error = std::string("checkpointing failed: ") + e.what();
    }
  });
  if (!error.empty()) {
    fail(error);
    co_return;
  }
  STAGE_TRACE("step done");
  keep_step(it, plan, m);
  hooks_->after_step_shipped(it);
  phase_ = phase::stepped;
  tell_stepped(digests, verify_s);
  // The slot of `it` is being captured, not yet copied.
  co_await at_fault_point(fault_point::snapshot);
}

void stage_actor::tell_stepped(const std::vector<std::uint64_t>& digests, double verify_s) {
  const checkpoint_stats st = hooks_->stats();
  const std::uint64_t e = epoch_;
  (void)tell<wire::Stepped>(coordinator_, [&](wire::Stepped::Builder b) {
    b.setStage(setup_.stage);
    b.setReplica(setup_.replica);
    b.setEpoch(e);
    b.setSnapshotBytes(st.snapshot_bytes);
    b.setStallSeconds(st.stall_s);
    b.setSnapshotHostBytes(st.snapshot_host_bytes);
    b.setLogHostBytes(st.log_host_bytes);
    b.setSnapshotLentBytes(st.snapshot_lent_bytes);
    b.setReplicaMaps(st.replica_maps);
    b.setReplicaPulls(st.replica_pulls);
    b.setCaptureCpuSeconds(st.capture_cpu_s);
    b.setReplicationCpuSeconds(st.replication_cpu_s);
    b.setFreshBytes(st.fresh_bytes);
    b.setWindowsSkipped(st.windows_skipped);
    b.setLogSeconds(log_s_);
    b.setStepHookSeconds(std::max(0.0, step_hook_s_ - st.stall_s));
    auto l = b.initDigests(static_cast<unsigned>(digests.size()));
    for (unsigned i = 0; i < digests.size(); ++i) l.set(i, digests[i]);
    b.setVerifySeconds(verify_s);
    ::rusage u{};
    if (::getrusage(RUSAGE_SELF, &u) == 0) b.setPeakRssBytes(std::uint64_t(u.ru_maxrss) * 1024);
  });
}

void stage_actor::keep_step(std::int64_t it, const models::step_plan& plan, wire::Step::Reader m) {
  stepped_ = it;
  last_window_ = m.getWindow();
  last_w_sparse_ = m.getWSparse();
  last_slot_ = m.getSlot();
  last_popularity_.clear();
  for (double x : m.getPopularity()) last_popularity_.push_back(x);
  if (m.getKeepFrom() < 0) {
    kept_steps_.clear();  // no head keeps steps (a policy without replays)
    return;
  }
  kept_steps_[it] = planned_step{loss_scale_, plan};
  kept_steps_.erase(kept_steps_.begin(), kept_steps_.lower_bound(m.getKeepFrom()));
}

awaitable<void> stage_actor::abort(wire::Abort::Reader m, wire::AbortAck::Builder ack) {
  STAGE_TRACE("abort epoch={}", m.getEpoch());
  if (m.getEpoch() < epoch_) co_return;  // an attempt this stage is past
  // A later epoch than this stage began is aborted too: its Iterate was dropped because the
  // stage had failed before it (an input of that epoch, come before its Iterate, pulled from a
  // peer that died). What failed is cleared all the same, or this stage would drop every
  // later Iterate and the job wait for it for ever.
  ack.setGroupAbortSeconds(co_await drop_in_flight());
}

awaitable<void> stage_actor::state(wire::StageStateQuery::Reader, wire::StageState::Builder out) {
  STAGE_TRACE("state query");
  // Reduced gradients wait for their Step: the new head sends it when other stages stepped.
  const bool reduced = phase_ == phase::reduced;
  const bool in_flight =
      !reduced && phase_ != phase::stepped && phase_ != phase::idle && phase_ != phase::aborted;
  if (!reduced) co_await drop_in_flight();
  out.setReduced(reduced);
  out.setSlot(last_slot_);
  if (const auto p = hooks_ ? hooks_->persisted_window() : std::nullopt) {
    out.setHasPersisted(true);
    out.setPersistedWindow(p->first);
    out.setPersistedFirst(p->second);
  }
  auto pop = out.initPopularity(static_cast<unsigned>(last_popularity_.size()));
  for (unsigned i = 0; i < last_popularity_.size(); ++i) pop.set(i, last_popularity_[i]);
  out.setEpoch(epoch_);
  out.setKnown(stepped_.has_value());
  out.setStepped(stepped_.value_or(-1));
  out.setDropped(in_flight);
  out.setWiring(wiring_);
  out.setWindow(last_window_);
  out.setWSparse(last_w_sparse_);
  auto l = out.initSteps(static_cast<unsigned>(kept_steps_.size()));
  unsigned i = 0;
  for (const auto& [it, p] : kept_steps_) {
    l[i].setIteration(it);
    l[i].setLossScale(p.loss_scale);
    l[i].setApply(p.plan.apply);
    l[i].setGradMul(p.plan.grad_mul);
    l[i].setGradNorm(p.plan.grad_norm);
    ++i;
  }
}

awaitable<double> stage_actor::drop_in_flight() {
  // What failed in this attempt (a pull from a peer that died, during the iteration or a
  // validation round) was decided by the coordinator: what comes next is run again.
  failed_ = false;
  // The NCCL group goes whatever the phase: a peer in it is gone or hung (an abort precedes a
  // recovery, whose wiring makes a new group), and a sum waiting on it returns at once.
  double group_s = 0.0;
  if (reduction_ != nullptr) {
    stop_sum_ = true;
    joined_ = false;
    co_await compute([&] { group_s = reduction_->leave(); });
    stop_sum_ = false;
  }
  if (phase_ == phase::stepped || phase_ == phase::idle) co_return group_s;  // nothing in flight
  co_await compute([&] { model_->abort_iteration(); });
  if (router_) router_->resume();
  phase_ = phase::aborted;
  co_return group_s;
}

awaitable<void> stage_actor::digests(wire::DigestsQuery::Reader, wire::Digests::Builder out) {
  std::vector<std::uint64_t> d;
  co_await compute([&] {
    if (device_state* dev = model_->device()) dev->sync_to_host();
    d = operator_digests(ops_);
  });
  auto l = out.initValues(static_cast<unsigned>(d.size()));
  for (unsigned i = 0; i < d.size(); ++i) l.set(i, d[i]);
  if (router_) {
    auto x = out.initExperts(static_cast<unsigned>(ops_.size()));
    for (unsigned i = 0; i < ops_.size(); ++i) x.set(i, ops_[i]->kind() == models::op_kind::expert);
  }
  auto names = out.initNames(static_cast<unsigned>(ops_.size()));
  for (unsigned i = 0; i < ops_.size(); ++i) names.set(i, ops_[i]->name());
}

}  // namespace moevement::engine
