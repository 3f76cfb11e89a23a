#include "engine/local_group.hpp"

#include <algorithm>
#include <string>

namespace moevement::engine {

local_group::local_group(std::span<stage_model* const> replicas, int ep)
    : replicas_(replicas.begin(), replicas.end()), ep_(std::max(ep, 1)) {
  const int n = int(replicas_.size());
  if (n % ep_ != 0) {
    throw models::config_error("parallel.ep", std::to_string(ep_) + " does not divide the " +
                                                  std::to_string(n) + " replicas of a stage");
  }
  for (auto* r : replicas_) {
    auto& dense = dense_ops_.emplace_back();
    for (auto* op : r->operators()) {
      if (ep_ == 1 || op->kind() != models::op_kind::expert) dense.push_back(op);
    }
  }
  if (ep_ == 1) return;
  for (int g = 0; g < n / ep_; ++g) {
    std::vector<models::expert_shard*> group;
    for (int k = 0; k < ep_; ++k) {
      auto* shard = replicas_[std::size_t(g * ep_ + k)]->experts();
      if (shard == nullptr) {
        throw models::config_error("parallel.ep", "the stage has no experts to shard; use 1");
      }
      group.push_back(shard);
    }
    const int experts = group[0]->experts_per_layer(), c = group[0]->d_model();
    for (int k = 0; k < ep_; ++k) {
      auto* r = replicas_[std::size_t(g * ep_ + k)];
      exchanges_.push_back(std::make_unique<models::direct_exchange>(group, k, experts, c));
      before_.push_back(r->expert_exchange());
      r->set_expert_exchange(exchanges_.back().get());
    }
  }
}

local_group::~local_group() {
  if (ep_ == 1) return;
  for (std::size_t d = 0; d < before_.size(); ++d) replicas_[d]->set_expert_exchange(before_[d]);
}

void local_group::all_reduce() {
  if (replicas_.size() > 1) {
    acc_.resize(gradient_floats(dense_ops_[0]));
    tmp_.resize(acc_.size());
    copy_gradients_out(dense_ops_[0], acc_);
    for (std::size_t d = 1; d < replicas_.size(); ++d) {
      copy_gradients_out(dense_ops_[d], tmp_);
      accumulate(acc_, tmp_);
    }
    for (const auto& ops : dense_ops_) copy_gradients_in(ops, acc_);
  }
  if (ep_ > 1) reduce_experts();
}

void local_group::reduce_experts() {
  // Replica d's rows of block k were computed by rank k of d's EP group, and kept apart there
  // as source d % ep.
  const int n = int(replicas_.size());
  for (int k = 0; k < ep_; ++k) {
    const auto shard = [&](int d) {
      return replicas_[std::size_t((d / ep_) * ep_ + k)]->experts();
    };
    const auto first = shard(0)->source_gradient(0);
    acc_.assign(first.begin(), first.end());
    for (int d = 1; d < n; ++d) accumulate(acc_, shard(d)->source_gradient(d % ep_));
    for (int g = 0; g < n / ep_; ++g) copy_gradients_in(shard(g * ep_)->experts(), acc_);
  }
}

}  // namespace moevement::engine
