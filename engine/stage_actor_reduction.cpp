// The stage actor's gradient reduction along the replicas of its stage (stage_actor.hpp):
// a left fold in replica order on the host, NCCL on GPUs, and under expert parallelism two
// folds: the non-experts over every replica, each expert block over its copies.
#include <fmt/format.h>

#include <algorithm>

#include "engine/stage_actor.hpp"

namespace moevement::engine {

namespace {

using asio::awaitable;

using transport::read_descriptor;

}  // namespace

awaitable<void> stage_actor::device_reduce() {
  if (phase_ != phase::reducing || !joined_) co_return;  // the group's id is on its way
  phase_ = phase::wait_total;                            // the sum is out
  const auto deadline = joined_at_ + std::chrono::seconds(setup_.train.nccl_timeout_s);
  device_reduction::result r;
  co_await compute([&] {
    const compute_watch::peer_wait waiting(watch_.get());  // for its replicas' parts
    r = reduction_->sum(deadline, stop_sum_);
  });
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
  if (router_) {
    co_await reduce_sharded();
    co_return;
  }
  if (phase_ == phase::reducing) {
    if (d > 0 && partial_epoch_ != epoch_) co_return;  // wait for g_0 + ... + g_{d-1}
    co_await compute([&] {
      auto acc = region_floats(red_out_).first(gf_);
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
  phase_ = phase::reduced;
  std::vector<double> sq, pop;
  double expert_wait_s = 0.0;
  co_await compute([&] {
    if (router_) expert_wait_s = router_->take_wait_s();
    device_state* d = model_->device();
    sq = d != nullptr && d->grads_on_device() ? d->grad_sq_sums() : gradient_sq_sums(ops_);
    // canonical (every expert of the stage): the coordinator sums it over all replicas
    pop = canonical_popularity(ops_, expert_split_of(setup_), hooks_ && hooks_->soft_popularity());
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
    if (router_) {
      b.setExpertWaitSeconds(expert_wait_s);
      b.setExpertRowsRefused(router_->refused());
      auto x = b.initExperts(static_cast<unsigned>(ops_.size()));
      for (unsigned i = 0; i < ops_.size(); ++i) {
        x.set(i, ops_[i]->kind() == models::op_kind::expert);
      }
    }
  });
  group_form_s_ = device_sum_s_ = 0.0;
}

std::pair<std::size_t, std::size_t> stage_actor::fold_part(bool experts) const {
  if (!router_) return {0, gf_};
  return experts ? std::pair{dense_floats_, gf_ - dense_floats_}
                 : std::pair{std::size_t{0}, dense_floats_};
}

awaitable<void> stage_actor::reduce_partial(wire::ReducePartial::Reader m) {
  auto d = read_descriptor(m.getTensor());
  const bool experts = m.getExperts();
  const auto [at, n] = fold_part(experts);
  if (in_->partial.empty() || !d.ok() || d->length != n * sizeof(float) || (experts && !router_)) {
    ++dropped_;
    co_return;
  }
  if (!accept(m.getEpoch())) co_return;
  const std::uint64_t e = m.getEpoch();
  if (!co_await pull(*d, std::span<float>(in_->partial).subspan(at, n))) co_return;
  partial_epoch_ = e;
  if (router_) (experts ? expert_fold_ : dense_fold_).partial_epoch = e;
  if (e == epoch_ && phase_ == phase::reducing) co_await reduce();
}

awaitable<void> stage_actor::reduce_total(wire::ReduceTotal::Reader m) {
  auto d = read_descriptor(m.getTensor());
  const bool experts = m.getExperts();
  const auto [at, n] = fold_part(experts);
  if (in_->total.empty() || !d.ok() || d->length != n * sizeof(float) || (experts && !router_)) {
    ++dropped_;
    co_return;
  }
  // The total comes only after this replica sent its partial sum (same epoch).
  const fold* f = router_ ? (experts ? &expert_fold_ : &dense_fold_) : nullptr;
  const bool waiting =
      f != nullptr ? phase_ == phase::reducing && f->sent && !f->done : phase_ == phase::wait_total;
  if (m.getEpoch() != epoch_ || !waiting) {
    ++dropped_;
    co_return;
  }
  if (!co_await pull(*d, std::span<float>(in_->total).subspan(at, n))) co_return;
  total_epoch_ = m.getEpoch();
  if (router_) (experts ? expert_fold_ : dense_fold_).total_epoch = total_epoch_;
  co_await reduce();
}

awaitable<void> stage_actor::reduce_sharded() {
  if (phase_ != phase::reducing) co_return;
  co_await fold_dense();
  if (failed_ || phase_ != phase::reducing) co_return;
  co_await fold_experts();
  if (failed_ || phase_ != phase::reducing) co_return;
  if (dense_fold_.done && expert_fold_.done) co_await finish_reduce();
}

awaitable<void> stage_actor::fold_dense() {
  // g_0 + ... + g_{n-1} of the non-experts along the replicas, as without expert parallelism
  const int d = setup_.replica, n = setup_.replicas;
  const std::uint64_t e = epoch_;
  fold& f = dense_fold_;
  const std::span<float> partial = std::span<float>(in_->partial).first(dense_floats_);
  const std::span<float> total = std::span<float>(in_->total).first(dense_floats_);
  if (f.sent) {
    if (f.done || f.total_epoch != e) co_return;
    co_await compute([&] { copy_gradients_in(dense_ops_, total); });
    f.done = true;
    co_return;
  }
  if (d > 0 && f.partial_epoch != e) co_return;  // wait for g_0 + ... + g_{d-1}
  f.sent = true;
  co_await compute([&] {
    auto acc = region_floats(red_out_).first(dense_floats_);
    copy_gradients_out(dense_ops_, acc);
    if (d > 0) accumulate(acc, partial);  // g_d + partial: addition commutes (see reduce())
    if (d == n - 1) copy_gradients_in(dense_ops_, acc);
  });
  const auto desc = red_out_.describe(0, dense_floats_ * sizeof(float));
  if (d < n - 1) {
    (void)tell<wire::ReducePartial>(replicas_[std::size_t(d + 1)],
                                    [&](wire::ReducePartial::Builder b) {
                                      b.setEpoch(e);
                                      transport::write_descriptor(b.initTensor(), desc);
                                    });
    co_return;
  }
  for (int r = 0; r < n - 1; ++r) {
    (void)tell<wire::ReduceTotal>(replicas_[std::size_t(r)], [&](wire::ReduceTotal::Builder b) {
      b.setEpoch(e);
      transport::write_descriptor(b.initTensor(), desc);
    });
  }
  f.done = true;
}

awaitable<void> stage_actor::fold_experts() {
  // This replica's block of experts got rows from every replica of its EP group (the shard's
  // sources, kept apart): the fold over all replicas in order is this group's sources added to
  // what the previous groups' copies of the block summed, group after group.
  const int d = setup_.replica, n = setup_.replicas, ep = router_->ep(), k = router_->rank();
  const int g = d / ep, groups = n / ep;
  const std::size_t ef = gf_ - dense_floats_;
  const std::uint64_t e = epoch_;
  models::expert_shard* shard = model_->experts();
  fold& f = expert_fold_;
  const std::span<float> partial = std::span<float>(in_->partial).subspan(dense_floats_, ef);
  const std::span<float> total = std::span<float>(in_->total).subspan(dense_floats_, ef);
  if (f.sent) {
    if (f.done || f.total_epoch != e) co_return;
    co_await compute([&] { copy_gradients_in(shard->experts(), total); });
    f.done = true;
    co_return;
  }
  if (g > 0 && f.partial_epoch != e) co_return;  // the previous groups' sum
  if (!router_->complete()) co_return;           // a peer's last backward rows are still to come
  f.sent = true;
  co_await compute([&] {
    auto acc = region_floats(red_out_).subspan(dense_floats_, ef);
    int source = 0;
    if (g == 0) {  // the fold starts with replica 0's rows (a copy, as the reference's)
      const auto first = shard->source_gradient(0);
      std::copy(first.begin(), first.end(), acc.begin());
      source = 1;
    } else {
      std::copy(partial.begin(), partial.end(), acc.begin());
    }
    for (; source < ep; ++source) accumulate(acc, shard->source_gradient(source));
    if (g == groups - 1) copy_gradients_in(shard->experts(), acc);
  });
  const auto desc = red_out_.describe(dense_floats_ * sizeof(float), ef * sizeof(float));
  if (g < groups - 1) {
    (void)tell<wire::ReducePartial>(replicas_[std::size_t(d + ep)],
                                    [&](wire::ReducePartial::Builder b) {
                                      b.setEpoch(e);
                                      b.setExperts(true);
                                      transport::write_descriptor(b.initTensor(), desc);
                                    });
    co_return;
  }
  for (int h = 0; h < groups - 1; ++h) {
    (void)tell<wire::ReduceTotal>(replicas_[std::size_t(h * ep + k)],
                                  [&](wire::ReduceTotal::Builder b) {
                                    b.setEpoch(e);
                                    b.setExperts(true);
                                    transport::write_descriptor(b.initTensor(), desc);
                                  });
  }
  f.done = true;
}

}  // namespace moevement::engine
