#include "engine/stage_model.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

#include "base/hash.hpp"

namespace moevement::engine {

void begin_operators(std::span<models::operator_state* const> ops, bool zero_grads) {
  for (auto* op : ops) {
    if (zero_grads) op->zero_grad();
    op->reset_popularity();
  }
}

std::size_t gradient_floats(std::span<models::operator_state* const> ops) {
  std::size_t n = 0;
  for (const auto* op : ops) n += op->grad().size();
  return n;
}

void copy_gradients_out(std::span<models::operator_state* const> ops, std::span<float> out) {
  if (out.size() != gradient_floats(ops)) {
    throw std::invalid_argument("copy_gradients_out: buffer has " + std::to_string(out.size()) +
                                " floats, the gradients " + std::to_string(gradient_floats(ops)));
  }
  auto it = out.begin();
  for (const auto* op : ops) it = std::copy(op->grad().begin(), op->grad().end(), it);
}

void copy_gradients_in(std::span<models::operator_state* const> ops, std::span<const float> in) {
  if (in.size() != gradient_floats(ops)) {
    throw std::invalid_argument("copy_gradients_in: buffer has " + std::to_string(in.size()) +
                                " floats, the gradients " + std::to_string(gradient_floats(ops)));
  }
  auto it = in.begin();
  for (auto* op : ops) {
    const auto g = op->grad();
    std::copy(it, it + std::ptrdiff_t(g.size()), g.begin());
    it += std::ptrdiff_t(g.size());
  }
}

void accumulate(std::span<float> acc, std::span<const float> g) {
  if (acc.size() != g.size()) {
    throw std::invalid_argument("accumulate: sizes differ (" + std::to_string(acc.size()) + " vs " +
                                std::to_string(g.size()) + ")");
  }
  for (std::size_t j = 0; j < acc.size(); ++j) acc[j] += g[j];
}

std::vector<double> gradient_sq_sums(std::span<models::operator_state* const> ops) {
  std::vector<double> sq;
  sq.reserve(ops.size());
  for (const auto* op : ops) sq.push_back(op->grad_sq_sum());
  return sq;
}

void apply_step(std::span<models::operator_state* const> ops, const models::step_plan& plan,
                const models::train_config& train, step_digests* weights) {
  using sclock = std::chrono::steady_clock;
  const models::adamw_config cfg{train.lr, train.beta1, train.beta2, train.eps, train.weight_decay};
  for (auto* op : ops) {
    if (plan.apply && op->mode() == models::op_mode::active) op->adamw_step(cfg, plan.grad_mul);
    if (weights != nullptr) {
      const auto t0 = sclock::now();
      weights->values.push_back(xxh3_64(op->compute_bytes()));
      weights->seconds += std::chrono::duration<double>(sclock::now() - t0).count();
    }
  }
}

std::vector<std::uint64_t> operator_digests(std::span<models::operator_state* const> ops) {
  std::vector<std::uint64_t> d;
  d.reserve(ops.size());
  for (const auto* op : ops) d.push_back(op->digest());
  return d;
}

std::vector<std::uint64_t> state_digests(std::span<models::operator_state* const> ops) {
  std::vector<std::uint64_t> d;
  d.reserve(ops.size());
  for (const auto* op : ops) {
    xxh3_hasher h;
    h.update(std::as_bytes(op->master()));
    h.update(std::as_bytes(op->adam_m()));
    h.update(std::as_bytes(op->adam_v()));
    const std::int64_t step = op->step();
    h.update(std::as_bytes(std::span<const std::int64_t>(&step, 1)));
    d.push_back(h.digest());
  }
  return d;
}

std::vector<double> operator_popularity(std::span<models::operator_state* const> ops, bool soft) {
  std::vector<double> c(ops.size(), 0.0);
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i]->kind() != models::op_kind::gate) continue;
    const auto& routed = ops[i]->routed_tokens();
    const auto& probs = ops[i]->prob_sums();
    std::size_t e = 0;
    for (std::size_t j = i + 1; j < ops.size() && e < routed.size(); ++j) {
      if (ops[j]->kind() != models::op_kind::expert) continue;
      c[j] += soft ? (e < probs.size() ? probs[e] : 0.0) : double(routed[e]);
      ++e;
    }
  }
  return c;
}

std::vector<models::op_kind> operator_kinds(std::span<models::operator_state* const> ops) {
  std::vector<models::op_kind> k;
  k.reserve(ops.size());
  for (const auto* op : ops) k.push_back(op->kind());
  return k;
}

std::vector<operator_at> canonical_order(std::span<const std::vector<models::op_kind>> kinds) {
  std::vector<operator_at> out;
  if (kinds.empty()) return out;
  const auto expert = models::op_kind::expert;
  std::vector<std::size_t> at(kinds.size(), 0);
  const auto bad = [] {
    throw std::invalid_argument(
        "canonical_order: the EP ranks' operator lists differ beyond their experts");
  };
  while (at[0] < kinds[0].size()) {
    const auto kind = kinds[0][at[0]];
    if (kind != expert) {  // a non-expert: rank 0's; every rank holds it there
      out.push_back({0, at[0]});
      for (std::size_t k = 0; k < kinds.size(); ++k) {
        if (at[k] >= kinds[k].size() || kinds[k][at[k]] != kind) bad();
        ++at[k];
      }
      continue;
    }
    for (std::size_t k = 0; k < kinds.size(); ++k) {  // a layer's experts, rank by rank
      if (at[k] >= kinds[k].size() || kinds[k][at[k]] != expert) bad();
      while (at[k] < kinds[k].size() && kinds[k][at[k]] == expert) {
        out.push_back({int(k), at[k]});
        ++at[k];
      }
    }
  }
  for (std::size_t k = 1; k < kinds.size(); ++k) {
    if (at[k] != kinds[k].size()) bad();
  }
  return out;
}

namespace {

// The canonical order of a stage whose EP ranks all have `ops`' shape (every rank holds the
// same non-experts and blocks of the same size).
std::vector<operator_at> order_of_ranks(std::span<models::operator_state* const> ops, int ranks) {
  const std::vector<std::vector<models::op_kind>> kinds(std::size_t(std::max(ranks, 1)),
                                                        operator_kinds(ops));
  return canonical_order(kinds);
}

}  // namespace

std::vector<double> canonical_popularity(std::span<models::operator_state* const> ops,
                                         models::expert_split split, bool soft) {
  if (split.count <= 1) return operator_popularity(ops, soft);
  // For each of this rank's operators: the gate before it and its place in its expert block.
  std::vector<const models::operator_state*> gate(ops.size(), nullptr);
  std::vector<std::size_t> place(ops.size(), 0);
  const models::operator_state* last_gate = nullptr;
  std::size_t run = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    if (ops[i]->kind() == models::op_kind::gate) last_gate = ops[i];
    run = ops[i]->kind() == models::op_kind::expert ? run + 1 : 0;
    gate[i] = last_gate;
    place[i] = run == 0 ? 0 : run - 1;
  }
  std::vector<double> c;
  std::vector<std::size_t> block(ops.size(), 0);  // the block size of each expert's run
  for (std::size_t i = ops.size(); i-- > 0;) {
    if (ops[i]->kind() != models::op_kind::expert) continue;
    block[i] = i + 1 < ops.size() && ops[i + 1]->kind() == models::op_kind::expert ? block[i + 1]
                                                                                   : place[i] + 1;
  }
  for (const auto& at : order_of_ranks(ops, split.count)) {
    const std::size_t i = at.index;
    if (ops[i]->kind() != models::op_kind::expert || gate[i] == nullptr) {
      c.push_back(0.0);
      continue;
    }
    // The expert's index in its layer: rank `at.rank`'s block, this place in it.
    const std::size_t e = std::size_t(at.rank) * block[i] + place[i];
    const auto& routed = gate[i]->routed_tokens();
    const auto& probs = gate[i]->prob_sums();
    if (soft) {
      c.push_back(e < probs.size() ? probs[e] : 0.0);
    } else {
      c.push_back(e < routed.size() ? double(routed[e]) : 0.0);
    }
  }
  return c;
}

std::vector<double> rank_popularity(std::span<const double> canonical,
                                    std::span<models::operator_state* const> ops,
                                    models::expert_split split) {
  const auto order = order_of_ranks(ops, split.count);
  if (canonical.size() != order.size()) {
    throw std::invalid_argument("rank_popularity: " + std::to_string(canonical.size()) +
                                " counts for a stage of " + std::to_string(order.size()) +
                                " operators (canonical order)");
  }
  std::vector<double> mine(ops.size(), 0.0);
  for (std::size_t k = 0; k < order.size(); ++k) {
    if (order[k].rank == split.index) mine[order[k].index] = canonical[k];
  }
  return mine;
}

}  // namespace moevement::engine
