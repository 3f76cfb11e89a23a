#include "examples/custom_stage/residual_moe.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/cpu/gemm.hpp"
#include "models/cpu/kernels.hpp"
#include "models/data.hpp"
#include "models/expert_shard.hpp"
#include "models/model.hpp"

namespace custom_stage {

namespace {

using namespace moevement;
using models::operator_state;
using models::param_spec;

// One block's operators: the held experts are those of this replica's EP rank.
struct block_ops {
  operator_state *norm = nullptr, *gate = nullptr;
  std::vector<operator_state*> experts;  // [E]: null where another EP rank holds it
};

// What a block's forward keeps for its backward.
struct block_cache {
  std::vector<float> n, rstd, probs, p;   // [N,C] [N] [N,E] [N]
  std::vector<int> expert, pos, offsets;  // [N] chosen expert, its row among the routed; [E+1]
  std::vector<float> xs, ye, hpre, act;   // [N,C] routed rows and their outputs; [N,F] (ep 1)
};

class residual_moe final : public engine::stage_model {
 public:
  explicit residual_moe(const engine::stage_setup& s)
      : s_(s),
        n_(s.train.micro_batch_size * s.train.seq_len),
        c_(s.model.d_model),
        f_(s.model.d_ff),
        v_(s.model.vocab),
        e_(s.model.experts),
        split_(engine::expert_split_of(s)) {
    const auto range = models::partition(s.model, s.stages)[std::size_t(s.stage)];
    first_block_ = range.first_layer;
    last_block_ = range.last_layer;
    build_operators();
    if (split_.count > 1) {
      std::vector<operator_state*> held;
      for (const auto& b : blocks_) {
        for (int j = split_.first(e_); j < split_.last(e_); ++j) held.push_back(b.experts[j]);
      }
      models::stage_range r;
      r.first_layer = first_block_;
      r.last_layer = last_block_;
      shard_ = std::make_unique<models::expert_shard>(held, e_, c_, f_, r, split_);
    }
    if (s.first() || s.last()) {
      corpus_.emplace(models::corpus::load(s.train.corpus, s.train.val_fraction, s.train.seq_len));
    }
    models::cpu::set_gemm_threads(s.train.blis_threads);
  }

  std::size_t boundary_floats() const override { return std::size_t(n_) * std::size_t(c_); }

  std::vector<operator_state*> operators() override {
    std::vector<operator_state*> out;
    for (auto& op : ops_) out.push_back(op.get());
    return out;
  }

  void begin_iteration(std::int64_t iteration) override {
    cache_.clear();
    iteration_ = iteration;
    if (shard_) shard_->begin_iteration();
  }

  engine::stage_output forward(int mb, std::span<const float> x_in) override {
    mb_cache& m = cache_[mb];
    load(m, models::split::train, iteration_, s_.replica, mb);
    return run_forward(m, x_in, mb, true);
  }

  std::span<const float> backward(int mb, std::span<const float> grad_out,
                                  float loss_grad) override;

  void abort_iteration() override {
    cache_.clear();
    if (shard_) shard_->abort();
  }

  engine::stage_output validate(int index, std::span<const float> x_in) override {
    load(val_, models::split::val, index, 0, 0);
    return run_forward(val_, x_in, -1, false);
  }

  // Expert parallelism: this replica's block of experts, and the engine's all-to-all.
  models::expert_shard* experts() override { return shard_.get(); }
  void set_expert_exchange(models::expert_exchange* x) override { exchange_ = x; }
  models::expert_exchange* expert_exchange() const override { return exchange_; }

 private:
  struct mb_cache {
    std::vector<std::int32_t> tokens, targets;  // [B,T]
    std::vector<std::vector<float>> xs;         // the residual stream entering each block, +out
    std::vector<block_cache> blocks;
    std::vector<float> nf, rstdf, probs, losses;  // [N,C] [N] [N,V] [N]
  };

  void build_operators();
  void load(mb_cache& m, models::split split, std::int64_t position, int replica, int mb);
  engine::stage_output run_forward(mb_cache& m, std::span<const float> x_in, int mb, bool training);
  void block_forward(int b, int mb, const std::vector<float>& x, std::vector<float>& y,
                     block_cache& k, bool training);
  void block_backward(int b, int mb, const std::vector<float>& x, block_cache& k);
  void experts_forward(int layer, int mb, block_cache& k, bool training);
  void experts_backward(int layer, int mb, block_cache& k, std::span<float> d_xs);

  engine::stage_setup s_;
  int n_, c_, f_, v_, e_;
  models::expert_split split_;
  int first_block_ = 0, last_block_ = 0;
  std::vector<std::unique_ptr<operator_state>> ops_;
  std::vector<block_ops> blocks_;
  operator_state *embedding_ = nullptr, *final_norm_ = nullptr, *head_ = nullptr;
  std::unique_ptr<models::expert_shard> shard_;  // expert parallelism only
  models::expert_exchange* exchange_ = nullptr;
  std::optional<models::corpus> corpus_;
  std::int64_t iteration_ = 0;
  std::map<int, mb_cache> cache_;
  mb_cache val_;
  std::vector<float> dx_, d_ye_, d_xs_, d_n_, d_gate_, d_a_, d_h_;
};

void residual_moe::build_operators() {
  const models::dtype dt = s_.model.compute_dtype;
  const std::int64_t c = c_, f = f_, v = v_, e = e_;
  // Canonical index of every operator of the whole model (seed, index): the same values
  // whichever stage or EP rank holds it.
  auto add = [&](std::uint64_t index, std::string name, models::op_kind kind,
                 std::vector<param_spec> params) {
    auto& op = ops_.emplace_back(
        std::make_unique<operator_state>(std::move(name), kind, std::move(params), dt));
    op->init(s_.train.seed, index);
    return op.get();
  };
  const std::uint64_t per_block = 2 + std::uint64_t(e_);
  if (s_.first()) {
    embedding_ = add(0, "embedding", models::op_kind::embedding,
                     {{"wte", {v, c}, 0.02f, 0.0f, false},
                      {"wpe", {s_.model.max_seq_len, c}, 0.02f, 0.0f, false}});
  }
  for (int l = first_block_; l < last_block_; ++l) {
    const auto base = 1 + per_block * std::uint64_t(l);
    const std::string name = "block" + std::to_string(l);
    block_ops& b = blocks_.emplace_back();
    b.norm = add(base, name + ".norm", models::op_kind::norm, {{"w", {c}, 0.0f, 1.0f, false}});
    b.gate =
        add(base + 1, name + ".gate", models::op_kind::gate, {{"w", {c, e}, 0.02f, 0.0f, false}});
    b.gate->routed_tokens().assign(std::size_t(e_), 0);
    b.gate->prob_sums().assign(std::size_t(e_), 0.0);
    b.experts.assign(std::size_t(e_), nullptr);
    for (int j = split_.first(e_); j < split_.last(e_); ++j) {
      b.experts[std::size_t(j)] =
          add(base + 2 + std::uint64_t(j), name + ".expert" + std::to_string(j),
              models::op_kind::expert,
              {{"w1", {c, f}, 0.02f, 0.0f, true}, {"w2", {f, c}, 0.01f, 0.0f, true}});
    }
  }
  if (s_.last()) {
    const auto base = 1 + per_block * std::uint64_t(s_.model.layers);
    final_norm_ = add(base, "final_norm", models::op_kind::norm, {{"w", {c}, 0.0f, 1.0f, false}});
    head_ = add(base + 1, "head", models::op_kind::head, {{"w", {c, v}, 0.02f, 0.0f, true}});
  }
}

void residual_moe::load(mb_cache& m, models::split split, std::int64_t position, int replica,
                        int mb) {
  m.tokens.resize(std::size_t(n_));
  m.targets.resize(std::size_t(n_));
  if (corpus_) {
    models::fill_batch(*corpus_, split, s_.train.seed, position, replica, mb,
                       s_.train.micro_batch_size, s_.train.seq_len, m.tokens.data(),
                       m.targets.data());
  }
}

engine::stage_output residual_moe::run_forward(mb_cache& m, std::span<const float> x_in, int mb,
                                               bool training) {
  const std::size_t nc = std::size_t(n_) * std::size_t(c_);
  const int blocks = last_block_ - first_block_;
  m.xs.assign(std::size_t(blocks) + 1, std::vector<float>(nc));
  m.blocks.resize(std::size_t(blocks));
  if (s_.first()) {
    models::cpu::embedding_forward(m.xs[0].data(), m.tokens.data(), embedding_->weight(0),
                                   embedding_->weight(1), s_.train.micro_batch_size,
                                   s_.train.seq_len, c_);
  } else {
    if (x_in.size() != nc) throw std::invalid_argument("residual_moe: x_in has the wrong size");
    m.xs[0].assign(x_in.begin(), x_in.end());
  }
  for (int b = 0; b < blocks; ++b) {
    block_forward(b, mb, m.xs[std::size_t(b)], m.xs[std::size_t(b) + 1], m.blocks[std::size_t(b)],
                  training);
  }
  engine::stage_output out;
  if (!s_.last()) {
    out.activation = m.xs.back();
    return out;
  }
  m.nf.resize(nc);
  m.rstdf.resize(std::size_t(n_));
  m.probs.resize(std::size_t(n_) * std::size_t(v_));
  m.losses.resize(std::size_t(n_));
  std::vector<float> logits(m.probs.size());
  models::cpu::rmsnorm_forward(m.nf.data(), m.rstdf.data(), m.xs.back().data(),
                               final_norm_->weight(0), n_, c_);
  models::cpu::matmul_forward(logits.data(), m.nf.data(), head_->weight(0), n_, c_, v_);
  models::cpu::softmax_xent_forward(m.losses.data(), m.probs.data(), logits.data(),
                                    m.targets.data(), n_, v_);
  double sum = 0.0;  // in token order
  for (float l : m.losses) sum += l;
  out.loss = sum / n_;
  return out;
}

void residual_moe::block_forward(int b, int mb, const std::vector<float>& x, std::vector<float>& y,
                                 block_cache& k, bool training) {
  const block_ops& ops = blocks_[std::size_t(b)];
  const auto n = std::size_t(n_), c = std::size_t(c_), e = std::size_t(e_);
  k.n.resize(n * c);
  k.rstd.resize(n);
  models::cpu::rmsnorm_forward(k.n.data(), k.rstd.data(), x.data(), ops.norm->weight(0), n_, c_);
  // The gate: softmax over the experts, each token to its most probable one (the first of
  // equals), in token order.
  k.probs.resize(n * e);
  models::cpu::matmul_forward(k.probs.data(), k.n.data(), ops.gate->weight(0), n_, c_, e_);
  k.p.resize(n);
  k.expert.resize(n);
  k.offsets.assign(e + 1, 0);
  for (std::size_t i = 0; i < n; ++i) {
    float* row = k.probs.data() + i * e;
    const float top = *std::max_element(row, row + e);
    float sum = 0.0f;
    for (std::size_t j = 0; j < e; ++j) sum += row[j] = std::exp(row[j] - top);
    for (std::size_t j = 0; j < e; ++j) row[j] /= sum;
    const auto chosen = std::size_t(std::max_element(row, row + e) - row);
    k.expert[i] = int(chosen);
    k.p[i] = row[chosen];
    ++k.offsets[chosen + 1];
    if (training) {
      ++ops.gate->routed_tokens()[chosen];
      for (std::size_t j = 0; j < e; ++j) ops.gate->prob_sums()[j] += row[j];
    }
  }
  for (std::size_t j = 0; j < e; ++j) k.offsets[j + 1] += k.offsets[j];
  // The routed rows, grouped by expert (token order inside each).
  k.pos.resize(n);
  k.xs.resize(n * c);
  std::vector<int> next(k.offsets.begin(), k.offsets.end() - 1);
  for (std::size_t i = 0; i < n; ++i) {
    k.pos[i] = next[std::size_t(k.expert[i])]++;
    std::copy_n(k.n.data() + i * c, c, k.xs.data() + std::size_t(k.pos[i]) * c);
  }
  k.ye.resize(n * c);
  experts_forward(first_block_ + b, mb, k, training);
  for (std::size_t i = 0; i < n; ++i) {
    const float* ye = k.ye.data() + std::size_t(k.pos[i]) * c;
    for (std::size_t j = 0; j < c; ++j) y[i * c + j] = x[i * c + j] + k.p[i] * ye[j];
  }
}

void residual_moe::experts_forward(int layer, int mb, block_cache& k, bool training) {
  if (split_.count > 1) {  // the engine's all-to-all: each row to its expert's holder and back
    if (exchange_ == nullptr) throw std::logic_error("residual_moe: EP without an exchange");
    exchange_->forward(layer, mb, k.offsets, k.xs, k.ye, training);
    return;
  }
  const block_ops& ops = blocks_[std::size_t(layer - first_block_)];
  k.hpre.resize(std::size_t(n_) * std::size_t(f_));
  k.act.resize(k.hpre.size());
  for (int j = 0; j < e_; ++j) {
    const int r0 = k.offsets[std::size_t(j)], r = k.offsets[std::size_t(j) + 1] - r0;
    if (r == 0) continue;
    models::expert_forward(*ops.experts[std::size_t(j)], r, c_, f_,
                           k.xs.data() + std::size_t(r0) * c_, k.hpre.data() + std::size_t(r0) * f_,
                           k.act.data() + std::size_t(r0) * f_, k.ye.data() + std::size_t(r0) * c_);
  }
}

void residual_moe::experts_backward(int layer, int mb, block_cache& k, std::span<float> d_xs) {
  if (split_.count > 1) {
    exchange_->backward(layer, mb, k.offsets, d_ye_, d_xs);
    return;
  }
  const block_ops& ops = blocks_[std::size_t(layer - first_block_)];
  for (int j = 0; j < e_; ++j) {
    const int r0 = k.offsets[std::size_t(j)], r = k.offsets[std::size_t(j) + 1] - r0;
    if (r == 0) continue;
    operator_state& ex = *ops.experts[std::size_t(j)];
    d_a_.resize(std::size_t(r) * std::size_t(f_));
    d_h_.resize(d_a_.size());
    models::expert_backward(ex, ex.grad(0), ex.grad(1), r, c_, f_,
                            d_ye_.data() + std::size_t(r0) * c_, k.xs.data() + std::size_t(r0) * c_,
                            k.hpre.data() + std::size_t(r0) * f_,
                            k.act.data() + std::size_t(r0) * f_, d_a_.data(), d_h_.data(),
                            d_xs.data() + std::size_t(r0) * c_);
  }
}

std::span<const float> residual_moe::backward(int mb, std::span<const float> grad_out,
                                              float loss_grad) {
  auto it = cache_.find(mb);
  if (it == cache_.end()) throw std::logic_error("residual_moe: backward before forward");
  mb_cache& m = it->second;
  const std::size_t nc = std::size_t(n_) * std::size_t(c_);
  dx_.assign(nc, 0.0f);
  if (s_.last()) {
    // mean over N tokens: each token's loss carries loss_grad / N
    std::vector<float> dlogits(std::size_t(n_) * std::size_t(v_)), dnf(nc);
    models::cpu::softmax_xent_backward(dlogits.data(), m.probs.data(), m.targets.data(),
                                       loss_grad / float(n_), n_, v_);
    models::cpu::matmul_backward(dnf.data(), head_->grad(0), dlogits.data(), m.nf.data(),
                                 head_->weight(0), n_, c_, v_);
    models::cpu::rmsnorm_backward(dx_.data(), final_norm_->grad(0), dnf.data(), m.xs.back().data(),
                                  final_norm_->weight(0), m.rstdf.data(), n_, c_);
  } else {
    dx_.assign(grad_out.begin(), grad_out.end());
  }
  for (int b = last_block_ - first_block_ - 1; b >= 0; --b) {
    block_backward(b, mb, m.xs[std::size_t(b)], m.blocks[std::size_t(b)]);
  }
  if (s_.first()) {
    if (embedding_->grad(0) != nullptr) {
      models::cpu::embedding_backward(embedding_->grad(0), embedding_->grad(1), dx_.data(),
                                      m.tokens.data(), s_.train.micro_batch_size, s_.train.seq_len,
                                      c_);
    }
    cache_.erase(it);
    return {};
  }
  cache_.erase(it);
  return dx_;
}

void residual_moe::block_backward(int b, int mb, const std::vector<float>& x, block_cache& k) {
  const block_ops& ops = blocks_[std::size_t(b)];
  const auto n = std::size_t(n_), c = std::size_t(c_), e = std::size_t(e_);
  // y = x + p * ye: the residual passes dx_ through; ye and p take their shares.
  d_ye_.resize(n * c);
  std::vector<float> d_p(n);
  for (std::size_t i = 0; i < n; ++i) {
    const float* dy = dx_.data() + i * c;
    const float* ye = k.ye.data() + std::size_t(k.pos[i]) * c;
    float* d = d_ye_.data() + std::size_t(k.pos[i]) * c;
    float dot = 0.0f;
    for (std::size_t j = 0; j < c; ++j) {
      d[j] = k.p[i] * dy[j];
      dot += dy[j] * ye[j];
    }
    d_p[i] = dot;
  }
  d_xs_.assign(n * c, 0.0f);
  experts_backward(first_block_ + b, mb, k, d_xs_);
  // The gate: d logits_j = p_e (1[j = e] - p_j) d p_e.
  d_gate_.resize(n * e);
  for (std::size_t i = 0; i < n; ++i) {
    const float* probs = k.probs.data() + i * e;
    for (std::size_t j = 0; j < e; ++j) {
      const float own = j == std::size_t(k.expert[i]) ? 1.0f : 0.0f;
      d_gate_[i * e + j] = k.p[i] * (own - probs[j]) * d_p[i];
    }
  }
  d_n_.resize(n * c);
  models::cpu::matmul_backward(d_n_.data(), ops.gate->grad(0), d_gate_.data(), k.n.data(),
                               ops.gate->weight(0), n_, c_, e_);
  for (std::size_t i = 0; i < n; ++i) {
    const float* routed = d_xs_.data() + std::size_t(k.pos[i]) * c;
    for (std::size_t j = 0; j < c; ++j) d_n_[i * c + j] += routed[j];
  }
  std::vector<float> dxn(n * c);
  models::cpu::rmsnorm_backward(dxn.data(), ops.norm->grad(0), d_n_.data(), x.data(),
                                ops.norm->weight(0), k.rstd.data(), n_, c_);
  for (std::size_t j = 0; j < n * c; ++j) dx_[j] += dxn[j];
}

}  // namespace

std::unique_ptr<engine::stage_model> make_residual_moe(const engine::stage_setup& setup) {
  if (setup.stages > setup.model.layers) {
    throw models::config_error("parallel.pp", "more stages than model.layers blocks");
  }
  if (setup.model.top_k != 1) {
    throw models::config_error("model.top_k",
                               "residual_moe routes each token to one expert; "
                               "use 1");
  }
  if (setup.model.experts < 1) {
    throw models::config_error("model.experts", "residual_moe needs at least one expert");
  }
  return std::make_unique<residual_moe>(setup);
}

}  // namespace custom_stage
