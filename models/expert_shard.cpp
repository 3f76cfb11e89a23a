#include "models/expert_shard.hpp"

#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <string>

#include "models/cpu/kernels.hpp"
#include "models/operator_state.hpp"

namespace moevement::models {

void expert_forward(const operator_state& ex, int rows, int c, int f, const float* xs, float* hpre,
                    float* act, float* ye) {
  cpu::matmul_forward(hpre, xs, ex.weight(0), rows, c, f);
  cpu::gelu_forward(act, hpre, rows * f);
  cpu::matmul_forward(ye, act, ex.weight(1), rows, f, c);
}

void expert_backward(const operator_state& ex, float* dw1, float* dw2, int rows, int c, int f,
                     const float* d_ye, const float* xs, const float* hpre, const float* act,
                     float* d_act, float* d_hpre, float* d_xs) {
  // dact [r,F] = dye W2^T ; dW2 += act^T dye
  cpu::matmul_backward(d_act, dw2, d_ye, act, ex.weight(1), rows, f, c);
  cpu::gelu_backward(d_hpre, d_act, hpre, rows * f);
  // dxs [r,C] = dhpre W1^T ; dW1 += xs^T dhpre
  cpu::matmul_backward(d_xs, dw1, d_hpre, xs, ex.weight(0), rows, c, f);
}

namespace {

void check_split(expert_split split, int e) {
  if (split.count < 1 || e % split.count != 0 || split.index < 0 || split.index >= split.count) {
    throw std::invalid_argument("expert_shard: shard " + std::to_string(split.index) + " of " +
                                std::to_string(split.count) + " for " + std::to_string(e) +
                                " experts");
  }
}

std::vector<operator_state*> held_experts(moe_model& model, stage_range range, expert_split split) {
  const int e = model.config().experts;
  check_split(split, e);
  std::vector<operator_state*> out;
  for (int l = range.first_layer; l < range.last_layer; ++l) {
    for (int j = split.first(e); j < split.last(e); ++j) {
      auto& op = model.ops()[model.expert(l, j)];
      if (!op.allocated()) {
        throw std::invalid_argument("expert_shard: " + op.name() + " is not held by this model");
      }
      out.push_back(&op);
    }
  }
  return out;
}

}  // namespace

expert_shard::expert_shard(moe_model& model, stage_range range, expert_split split)
    : expert_shard(held_experts(model, range, split), model.config().experts,
                   model.config().d_model, model.config().d_ff, range, split) {}

expert_shard::expert_shard(std::vector<operator_state*> held, int experts, int d_model, int d_ff,
                           stage_range range, expert_split split)
    : experts_total_(experts), c_(d_model), f_(d_ff), range_(range), split_(split) {
  check_split(split, experts);
  per_layer_ = experts / split.count;
  const auto layers = std::size_t(std::max(range.last_layer - range.first_layer, 0));
  if (held.size() != layers * std::size_t(per_layer_)) {
    throw std::invalid_argument("expert_shard: " + std::to_string(held.size()) +
                                " experts held for " + std::to_string(layers) + " layers of " +
                                std::to_string(per_layer_));
  }
  std::size_t floats = 0;
  for (operator_state* op : held) {
    if (op == nullptr || !op->allocated() || op->param_count() != 2 ||
        op->numel() != 2 * std::int64_t(d_model) * d_ff) {
      throw std::invalid_argument("expert_shard: an expert is not a held [C,F] + [F,C] MLP");
    }
    experts_.push_back(op);
    grad_offset_.push_back(floats);
    floats += std::size_t(op->numel());
  }
  grads_.assign(std::size_t(split.count), std::vector<float>(floats, 0.0f));
}

std::size_t expert_shard::first_of(int layer) const {
  return std::size_t(layer - range_.first_layer) * std::size_t(per_layer_);
}

void expert_shard::check_call(int source, int layer, std::span<const int> rows, std::size_t floats,
                              std::size_t out_floats) const {
  if (source < 0 || source >= split_.count) {
    throw std::invalid_argument("expert_shard: source " + std::to_string(source) +
                                " is not in this EP group of " + std::to_string(split_.count));
  }
  if (layer < range_.first_layer || layer >= range_.last_layer) {
    throw std::invalid_argument("expert_shard: layer " + std::to_string(layer) +
                                " is not in this stage");
  }
  if (rows.size() != std::size_t(per_layer_)) {
    throw std::invalid_argument("expert_shard: " + std::to_string(rows.size()) +
                                " row counts for " + std::to_string(per_layer_) + " experts");
  }
  std::size_t total = 0;
  for (const int r : rows) {
    if (r < 0) throw std::invalid_argument("expert_shard: a negative row count");
    total += std::size_t(r);
  }
  const std::size_t want = total * std::size_t(c_);
  if (floats != want || out_floats != want) {
    throw std::invalid_argument("expert_shard: " + std::to_string(floats) + " floats in, " +
                                std::to_string(out_floats) + " out, for " + std::to_string(total) +
                                " rows");
  }
}

void expert_shard::forward(int source, int layer, int mb, std::span<const int> rows,
                           std::span<const float> xs, std::span<float> ye, bool training) {
  check_call(source, layer, rows, xs.size(), ye.size());
  const key k{source, layer, mb};
  if (training && cache_.count(k) != 0) {
    throw std::logic_error("expert_shard: layer " + std::to_string(layer) + " micro-batch " +
                           std::to_string(mb) + " of source " + std::to_string(source) +
                           " is already in flight");
  }
  const int c = c_, f = f_;
  held h;
  if (!spare_.empty()) {  // reuse buffers: no allocation in steady state
    h = std::move(spare_.back());
    spare_.pop_back();
  }
  const std::size_t total = xs.size() / std::size_t(c);
  h.rows.assign(rows.begin(), rows.end());
  h.xs.assign(xs.begin(), xs.end());
  h.hpre.resize(total * std::size_t(f));
  h.act.resize(total * std::size_t(f));
  const std::size_t first = first_of(layer);
  std::size_t r0 = 0;
  for (std::size_t j = 0; j < rows.size(); ++j) {
    const int r = rows[j];
    if (r == 0) continue;
    expert_forward(*experts_[first + j], r, c, f, h.xs.data() + r0 * c, h.hpre.data() + r0 * f,
                   h.act.data() + r0 * f, ye.data() + r0 * c);
    r0 += std::size_t(r);
  }
  if (training) {
    cache_[k] = std::move(h);
  } else {
    spare_.push_back(std::move(h));
  }
}

void expert_shard::backward(int source, int layer, int mb, std::span<const float> d_ye,
                            std::span<float> d_xs) {
  const auto it = cache_.find(key{source, layer, mb});
  if (it == cache_.end()) {
    throw std::logic_error("expert_shard: backward of layer " + std::to_string(layer) +
                           " micro-batch " + std::to_string(mb) + " of source " +
                           std::to_string(source) + " without its forward");
  }
  held& h = it->second;
  check_call(source, layer, h.rows, d_ye.size(), d_xs.size());
  const int c = c_, f = f_;
  const int most = h.rows.empty() ? 0 : *std::max_element(h.rows.begin(), h.rows.end());
  d_act_.resize(std::size_t(most) * f);
  d_hpre_.resize(std::size_t(most) * f);
  auto& grad = grads_[std::size_t(source)];
  const std::size_t first = first_of(layer);
  std::size_t r0 = 0;
  for (std::size_t j = 0; j < h.rows.size(); ++j) {
    const int r = h.rows[j];
    if (r == 0) continue;
    const operator_state& ex = *experts_[first + j];
    float* g = grad.data() + grad_offset_[first + j];
    const bool active = ex.mode() == op_mode::active;
    expert_backward(ex, active ? g + ex.param_offset(0) : nullptr,
                    active ? g + ex.param_offset(1) : nullptr, r, c, f, d_ye.data() + r0 * c,
                    h.xs.data() + r0 * c, h.hpre.data() + r0 * f, h.act.data() + r0 * f,
                    d_act_.data(), d_hpre_.data(), d_xs.data() + r0 * c);
    r0 += std::size_t(r);
  }
  spare_.push_back(std::move(h));
  cache_.erase(it);
}

void expert_shard::begin_iteration() {
  abort();
  for (auto& g : grads_) std::fill(g.begin(), g.end(), 0.0f);
}

void expert_shard::abort() {
  for (auto& [k, h] : cache_) spare_.push_back(std::move(h));
  cache_.clear();
}

std::span<const float> expert_shard::source_gradient(int source) const {
  if (source < 0 || source >= split_.count) {
    throw std::out_of_range("expert_shard::source_gradient: no source " + std::to_string(source));
  }
  return grads_[std::size_t(source)];
}

direct_exchange::direct_exchange(std::vector<expert_shard*> group, int source, int experts,
                                 int d_model)
    : group_(std::move(group)), source_(source), experts_(experts), c_(d_model) {
  if (group_.empty() || experts_ % int(group_.size()) != 0) {
    throw std::invalid_argument("direct_exchange: " + std::to_string(group_.size()) +
                                " shards for " + std::to_string(experts) + " experts");
  }
}

namespace {

// Owner k's experts' row counts and where their rows are in [rows, C].
struct owner_rows {
  std::vector<int> rows;
  std::size_t first_row = 0, count = 0;
};

owner_rows rows_of(std::span<const int> offsets, int k, int per) {
  owner_rows o;
  const int j0 = k * per;
  for (int j = j0; j < j0 + per; ++j) o.rows.push_back(offsets[j + 1] - offsets[j]);
  o.first_row = std::size_t(offsets[j0]);
  o.count = std::size_t(offsets[j0 + per] - offsets[j0]);
  return o;
}

}  // namespace

void direct_exchange::each_owner(std::span<const int> offsets,
                                 const std::function<void(expert_shard&, const std::vector<int>&,
                                                          std::size_t, std::size_t)>& fn) {
  if (offsets.size() != std::size_t(experts_) + 1) {
    throw std::invalid_argument("direct_exchange: offsets for " +
                                std::to_string(offsets.size() - 1) + " experts");
  }
  const int per = experts_ / int(group_.size());
  for (int k = 0; k < int(group_.size()); ++k) {
    const auto o = rows_of(offsets, k, per);
    fn(*group_[std::size_t(k)], o.rows, o.first_row * std::size_t(c_), o.count * std::size_t(c_));
  }
}

void direct_exchange::forward(int layer, int mb, std::span<const int> offsets,
                              std::span<const float> xs, std::span<float> ye, bool training) {
  each_owner(offsets, [&](expert_shard& owner, const std::vector<int>& rows, std::size_t at,
                          std::size_t n) {
    owner.forward(source_, layer, mb, rows, xs.subspan(at, n), ye.subspan(at, n), training);
  });
}

void direct_exchange::backward(int layer, int mb, std::span<const int> offsets,
                               std::span<const float> d_ye, std::span<float> d_xs) {
  each_owner(offsets,
             [&](expert_shard& owner, const std::vector<int>&, std::size_t at, std::size_t n) {
               owner.backward(source_, layer, mb, d_ye.subspan(at, n), d_xs.subspan(at, n));
             });
}

}  // namespace moevement::models
