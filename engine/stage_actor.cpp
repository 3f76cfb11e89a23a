#include "engine/stage_actor.hpp"

#include <fmt/format.h>
#include <asio/co_spawn.hpp>
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

std::span<float> floats(const transport::bulk_region& r) {
  auto bytes = r.memory();
  return {reinterpret_cast<float*>(bytes.data()), bytes.size() / sizeof(float)};
}

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

}  // namespace

#define STAGE_TRACE(...)                                                                       \
  do {                                                                                         \
    if (tracing())                                                                             \
      fmt::print(stderr, "[stage {} r{} e{} ph{}] {}\n", setup_.stage, setup_.replica, epoch_, \
                 int(phase_), fmt::format(__VA_ARGS__));                                       \
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
      m_(setup_.train.micro_batches) {
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
}

awaitable<void> stage_actor::on_start() {
  // The reduction's pull targets hold a stage's gradient each (55 MB per stage of the small
  // preset): zero-filled on the compute thread, so that this node's heartbeats go on (on the
  // actor thread, five such processes on two cores went silent past the failure timeout).
  // No message is handled before on_start() returns.
  if (setup_.replicas > 1) {
    co_await compute([this] {
      in_->partial.resize(setup_.replica > 0 ? gf_ : 0);
      in_->total.resize(setup_.replica < setup_.replicas - 1 ? gf_ : 0);
    });
  }
}

stage_actor::~stage_actor() {
  stop_sum_ = true;  // a sum waiting on a peer returns (aborted): the compute thread joins
  pool_.join();
}

template <class F>
awaitable<void> stage_actor::compute(F&& fn) {
  auto task = [&fn]() -> awaitable<void> {
    fn();
    co_return;
  };
  co_await asio::co_spawn(pool_.get_executor(), std::move(task), asio::use_awaitable);
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
  iteration_ = m.getIteration();
  loss_scale_ = m.getLossScale();
  phase_ = phase::running;
  next_step_ = 0;
  losses_.assign(std::size_t(m_), 0.0);
  aux_.assign(std::size_t(m_), 0.0);
  compute_s_ = 0.0;
  const std::int64_t it = iteration_;
  co_await compute([&] {
    // Gradients that stay on the device leave the host's unused: zeroing them would be a pass
    // over 4 bytes per parameter for nothing (55 MiB per stage of the small preset).
    const device_state* d = model_->device();
    begin_operators(ops_, /*zero_grads=*/d == nullptr || !d->grads_on_device());
    model_->begin_iteration(it);
  });
  co_await advance();
}

awaitable<void> stage_actor::advance() {
  using sclock = std::chrono::steady_clock;
  const float loss_grad = loss_scale_ / float(m_ * setup_.replicas);
  while (!failed_ && phase_ == phase::running && next_step_ < plan_.size()) {
    const pipeline_step s = plan_[next_step_];
    const auto mb = std::size_t(s.micro_batch);
    const std::int64_t it = iteration_;
    if (s.what == pass::forward) {
      if (!setup_.first() && act_epoch_[mb] != epoch_) co_return;  // wait for the activation
      if (next_step_ == 0) at_fault_point(fault_point::forward);
      bool bad = false;
      co_await compute([&] {
        const auto t0 = sclock::now();
        std::span<const float> x;
        if (!setup_.first()) x = std::span<const float>(in_->act).subspan(mb * bf_, bf_);
        const stage_output out = model_->forward(s.micro_batch, x);
        losses_[mb] = out.loss;
        aux_[mb] = out.aux_loss;
        if (!setup_.last()) {
          if (out.activation.size() != bf_) {
            bad = true;
            return;
          }
          auto slot = floats(act_out_).subspan(mb * bf_, bf_);
          std::copy(out.activation.begin(), out.activation.end(), slot.begin());
          hooks_->on_boundary_send(it, s.micro_batch, boundary::activation, slot);
        }
        compute_s_ += std::chrono::duration<double>(sclock::now() - t0).count();
      });
      if (bad) {
        fail("the stage's forward returned an activation of the wrong size");
        co_return;
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
    } else {
      if (!setup_.last() && grad_epoch_[mb] != epoch_) co_return;  // wait for the gradient
      if (next_step_ == first_backward_) at_fault_point(fault_point::backward);
      bool bad = false;
      co_await compute([&] {
        const auto t0 = sclock::now();
        std::span<const float> g;
        if (!setup_.last()) g = std::span<const float>(in_->grad).subspan(mb * bf_, bf_);
        const auto dx = model_->backward(s.micro_batch, g, loss_grad);
        if (!setup_.first()) {
          if (dx.size() != bf_) {
            bad = true;
            return;
          }
          auto slot = floats(grad_out_).subspan(mb * bf_, bf_);
          std::copy(dx.begin(), dx.end(), slot.begin());
          hooks_->on_boundary_send(it, s.micro_batch, boundary::gradient, slot);
        }
        compute_s_ += std::chrono::duration<double>(sclock::now() - t0).count();
      });
      if (bad) {
        fail("the stage's backward returned an input gradient of the wrong size");
        co_return;
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
    }
    ++next_step_;
  }
  if (!failed_ && phase_ == phase::running && next_step_ == plan_.size()) {
    phase_ = phase::reducing;
    co_await reduce();
  }
}

awaitable<void> stage_actor::device_reduce() {
  if (phase_ != phase::reducing || !joined_) co_return;  // the group's id is on its way
  phase_ = phase::wait_total;                            // the sum is out
  const auto deadline = joined_at_ + std::chrono::seconds(setup_.train.nccl_timeout_s);
  device_reduction::result r;
  co_await compute([&] { r = reduction_->sum(deadline, stop_sum_); });
  if (r.stopped || phase_ != phase::wait_total) co_return;  // aborted meanwhile
  if (!r.ok) {
    joined_ = false;
    fail("the gradient sum through NCCL failed: " + r.error);
    co_return;
  }
  group_form_s_ = r.form_s;
  device_sum_s_ = r.sum_s;
  co_await finish_reduce();
}

awaitable<void> stage_actor::reduce() {
  const int d = setup_.replica, n = setup_.replicas;
  if (reduction_ != nullptr) {
    co_await device_reduce();
    co_return;
  }
  if (n == 1) {
    co_await finish_reduce();
    co_return;
  }
  if (phase_ == phase::reducing) {
    if (d > 0 && partial_epoch_ != epoch_) co_return;  // wait for g_0 + ... + g_{d-1}
    co_await compute([&] {
      auto acc = floats(red_out_).first(gf_);
      copy_gradients_out(ops_, acc);
      // acc = g_d + (g_0 + ... + g_{d-1}): float addition commutes, so this is bit for bit
      // the left fold (... + g_{d-1}) + g_d of the reference.
      if (d > 0) accumulate(acc, in_->partial);
      if (d == n - 1) copy_gradients_in(ops_, acc);
    });
    const auto desc = red_out_.describe(0, gf_ * sizeof(float));
    const std::uint64_t e = epoch_;
    if (d < n - 1) {
      (void)tell<wire::ReducePartial>(replicas_[std::size_t(d + 1)],
                                      [&](wire::ReducePartial::Builder b) {
                                        b.setEpoch(e);
                                        transport::write_descriptor(b.initTensor(), desc);
                                      });
      phase_ = phase::wait_total;
    } else {
      for (int r = 0; r < n - 1; ++r) {
        (void)tell<wire::ReduceTotal>(replicas_[std::size_t(r)], [&](wire::ReduceTotal::Builder b) {
          b.setEpoch(e);
          transport::write_descriptor(b.initTensor(), desc);
        });
      }
      co_await finish_reduce();
      co_return;
    }
  }
  if (phase_ == phase::wait_total && total_epoch_ == epoch_) {
    co_await compute([&] { copy_gradients_in(ops_, in_->total); });
    co_await finish_reduce();
  }
}

awaitable<void> stage_actor::finish_reduce() {
  STAGE_TRACE("done");
  phase_ = phase::reduced;
  std::vector<double> sq, pop;
  co_await compute([&] {
    device_state* d = model_->device();
    sq = d != nullptr && d->grads_on_device() ? d->grad_sq_sums() : gradient_sq_sums(ops_);
    pop = operator_popularity(ops_, hooks_ && hooks_->soft_popularity());
  });
  const std::uint64_t e = epoch_;
  (void)tell<wire::StageDone>(coordinator_, [&](wire::StageDone::Builder b) {
    b.setStage(setup_.stage);
    b.setReplica(setup_.replica);
    b.setEpoch(e);
    auto s = b.initSqSums(static_cast<unsigned>(sq.size()));
    for (unsigned i = 0; i < sq.size(); ++i) s.set(i, sq[i]);
    if (setup_.last()) {
      auto l = b.initLosses(static_cast<unsigned>(losses_.size()));
      for (unsigned i = 0; i < losses_.size(); ++i) l.set(i, losses_[i]);
    }
    auto a = b.initAuxLosses(static_cast<unsigned>(aux_.size()));
    for (unsigned i = 0; i < aux_.size(); ++i) a.set(i, aux_[i]);
    b.setComputeSeconds(compute_s_);
    auto p = b.initPopularity(static_cast<unsigned>(pop.size()));
    for (unsigned i = 0; i < pop.size(); ++i) p.set(i, pop[i]);
    b.setGroupFormSeconds(group_form_s_);
    b.setDeviceSumSeconds(device_sum_s_);
  });
  group_form_s_ = device_sum_s_ = 0.0;
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
  if (e == epoch_) co_await advance();
}

awaitable<void> stage_actor::reduce_partial(wire::ReducePartial::Reader m) {
  auto d = read_descriptor(m.getTensor());
  if (in_->partial.empty() || !d.ok() || d->length != gf_ * sizeof(float)) {
    ++dropped_;
    co_return;
  }
  if (!accept(m.getEpoch())) co_return;
  const std::uint64_t e = m.getEpoch();
  if (!co_await pull(*d, in_->partial)) co_return;
  partial_epoch_ = e;
  if (e == epoch_ && phase_ == phase::reducing) co_await reduce();
}

awaitable<void> stage_actor::reduce_total(wire::ReduceTotal::Reader m) {
  auto d = read_descriptor(m.getTensor());
  if (in_->total.empty() || !d.ok() || d->length != gf_ * sizeof(float)) {
    ++dropped_;
    co_return;
  }
  // The total comes only after this replica sent its partial sum (same epoch).
  if (m.getEpoch() != epoch_ || phase_ != phase::wait_total) {
    ++dropped_;
    co_return;
  }
  if (!co_await pull(*d, in_->total)) co_return;
  total_epoch_ = m.getEpoch();
  co_await reduce();
}

awaitable<void> stage_actor::step(wire::Step::Reader m) {
  if (failed_ || m.getEpoch() != epoch_ || phase_ != phase::reduced) {
    ++dropped_;
    co_return;
  }
  models::step_plan plan;
  plan.apply = m.getApply();
  plan.grad_mul = m.getGradMul();
  const std::int64_t it = iteration_;
  std::vector<double> popularity;
  if (m.getPopularity().size() == ops_.size()) {
    for (double x : m.getPopularity()) popularity.push_back(x);
  }
  const checkpoint_step decided{std::max(m.getWSparse(), 0), popularity};
  at_fault_point(fault_point::step);
  std::string error;
  co_await compute([&] {
    try {
      hooks_->before_step(it, decided);
      hooks_->on_step(it, loss_scale_ / float(m_ * setup_.replicas), plan);
      if (device_state* d = model_->device()) {
        // the optimizer on the device; the host's gradients only when the replicas reduced
        // them there
        d->step(plan, setup_.train, setup_.replicas > 1 && reduction_ == nullptr);
      } else {
        apply_step(ops_, plan, setup_.train);
      }
      hooks_->after_step(it, ops_);
    } catch (const std::exception& e) {
      error = e.what();
    }
  });
  if (!error.empty()) {
    fail("checkpointing failed: " + error);
    co_return;
  }
  hooks_->after_step_shipped(it);
  const checkpoint_stats st = hooks_->stats();
  phase_ = phase::stepped;
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
    b.setWindowsSkipped(st.windows_skipped);
  });
  at_fault_point(fault_point::snapshot);  // the slot of `it` is being captured, not yet copied
}

awaitable<void> stage_actor::abort(wire::Abort::Reader m, wire::AbortAck::Builder ack) {
  STAGE_TRACE("abort epoch={}", m.getEpoch());
  if (m.getEpoch() != epoch_) co_return;
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
  ack.setGroupAbortSeconds(group_s);
  if (phase_ == phase::stepped || phase_ == phase::idle) co_return;  // nothing in flight
  co_await compute([&] { model_->abort_iteration(); });
  phase_ = phase::aborted;
}

awaitable<void> stage_actor::validate(wire::Validate::Reader m) {
  if (!setup_.first() || setup_.replica != 0 || m.getBatches() != setup_.train.val_batches) {
    ++dropped_;
    co_return;
  }
  const std::uint64_t round = m.getRound();
  const std::span<const float> none;  // the first stage reads its own batch
  for (int i = 0; i < m.getBatches() && !failed_; ++i) co_await validate_one(round, i, none);
}

awaitable<void> stage_actor::val_activation(wire::ValActivation::Reader m) {
  const int i = m.getIndex();
  auto d = read_descriptor(m.getTensor());
  if (setup_.first() || i < 0 || i >= setup_.train.val_batches || !d.ok() ||
      d->length != bf_ * sizeof(float)) {
    ++dropped_;
    co_return;
  }
  const std::uint64_t round = m.getRound();
  if (!co_await pull(*d, in_->val)) co_return;
  co_await validate_one(round, i, in_->val);
}

// Validation batch i on this stage: its loss to the coordinator (last stage) or its activation
// down the pipeline.
awaitable<void> stage_actor::validate_one(std::uint64_t round, int i, std::span<const float> x) {
  stage_output out;
  co_await compute([&] {
    out = model_->validate(i, x);
    if (!setup_.last() && out.activation.size() == bf_) {
      auto slot = floats(val_out_).subspan(std::size_t(i) * bf_, bf_);
      std::copy(out.activation.begin(), out.activation.end(), slot.begin());
    }
  });
  if (setup_.last()) {
    const double loss = out.loss;
    (void)tell<wire::ValLoss>(coordinator_, [&](wire::ValLoss::Builder b) {
      b.setRound(round);
      b.setIndex(i);
      b.setLoss(loss);
    });
  } else {
    const auto d = val_out_.describe(std::size_t(i) * bf_ * sizeof(float), bf_ * sizeof(float));
    (void)tell<wire::ValActivation>(next_, [&](wire::ValActivation::Builder b) {
      b.setRound(round);
      b.setIndex(i);
      transport::write_descriptor(b.initTensor(), d);
    });
  }
}

awaitable<void> stage_actor::digests(wire::DigestsQuery::Reader, wire::Digests::Builder out) {
  std::vector<std::uint64_t> d;
  co_await compute([&] {
    if (device_state* dev = model_->device()) dev->sync_to_host();
    d = operator_digests(ops_);
  });
  auto l = out.initValues(static_cast<unsigned>(d.size()));
  for (unsigned i = 0; i < d.size(); ++i) l.set(i, d[i]);
}

}  // namespace moevement::engine
