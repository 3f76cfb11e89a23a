#include "examples/custom_stage/residual_mlp.hpp"

#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/cpu/gemm.hpp"
#include "models/cpu/kernels.hpp"
#include "models/data.hpp"
#include "models/model.hpp"

namespace custom_stage {

namespace {

using namespace moevement;
using models::operator_state;
using models::param_spec;

class residual_mlp final : public engine::stage_model {
 public:
  explicit residual_mlp(const engine::stage_setup& s)
      : s_(s),
        n_(s.train.micro_batch_size * s.train.seq_len),
        c_(s.model.d_model),
        f_(s.model.d_ff),
        v_(s.model.vocab) {
    // This stage's blocks: the same split of layers as the built-in model's.
    const auto range = models::partition(s.model, s.stages)[std::size_t(s.stage)];
    first_block_ = range.first_layer;
    last_block_ = range.last_layer;
    const models::dtype dt = s.model.compute_dtype;
    const std::int64_t c = c_, f = f_, v = v_;
    // Canonical index of every operator of the whole model, so that each is initialised from
    // (seed, index) the same way whichever stage holds it.
    auto add = [&](std::uint64_t index, std::string name, models::op_kind kind,
                   std::vector<param_spec> params) {
      auto& op = ops_.emplace_back(
          std::make_unique<operator_state>(std::move(name), kind, std::move(params), dt));
      op->init(s.train.seed, index);
    };
    if (s.first()) {
      add(0, "embedding", models::op_kind::embedding,
          {{"wte", {v, c}, 0.02f, 0.0f, false},
           {"wpe", {s.model.max_seq_len, c}, 0.02f, 0.0f, false}});
    }
    for (int l = first_block_; l < last_block_; ++l) {
      const auto base = 1 + 2 * std::uint64_t(l);
      add(base, "block" + std::to_string(l) + ".norm", models::op_kind::norm,
          {{"w", {c}, 0.0f, 1.0f, false}});
      add(base + 1, "block" + std::to_string(l) + ".mlp", models::op_kind::expert,
          {{"w1", {c, f}, 0.02f, 0.0f, true}, {"w2", {f, c}, 0.01f, 0.0f, true}});
    }
    if (s.last()) {
      const auto base = 1 + 2 * std::uint64_t(s.model.layers);
      add(base, "final_norm", models::op_kind::norm, {{"w", {c}, 0.0f, 1.0f, false}});
      add(base + 1, "head", models::op_kind::head, {{"w", {c, v}, 0.02f, 0.0f, true}});
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
  }

  engine::stage_output forward(int mb, std::span<const float> x_in) override {
    mb_cache& m = cache_[mb];
    load(m, models::split::train, iteration_, s_.replica, mb);
    return run_forward(m, x_in);
  }

  std::span<const float> backward(int mb, std::span<const float> grad_out,
                                  float loss_grad) override {
    auto it = cache_.find(mb);
    if (it == cache_.end()) throw std::logic_error("residual_mlp: backward before forward");
    mb_cache& m = it->second;
    const std::size_t nc = std::size_t(n_) * std::size_t(c_);
    dx_.assign(nc, 0.0f);
    std::size_t op = ops_.size();
    if (s_.last()) {
      // mean over N tokens: each token's loss carries loss_grad / N
      std::vector<float> dlogits(std::size_t(n_) * std::size_t(v_)), dnf(nc);
      operator_state& head = *ops_[--op];
      operator_state& fnorm = *ops_[--op];
      models::cpu::softmax_xent_backward(dlogits.data(), m.probs.data(), m.targets.data(),
                                         loss_grad / float(n_), n_, v_);
      models::cpu::matmul_backward(dnf.data(), head.grad(0), dlogits.data(), m.nf.data(),
                                   head.weight(0), n_, c_, v_);
      models::cpu::rmsnorm_backward(dx_.data(), fnorm.grad(0), dnf.data(), m.xs.back().data(),
                                    fnorm.weight(0), m.rstdf.data(), n_, c_);
    } else {
      dx_.assign(grad_out.begin(), grad_out.end());
    }
    std::vector<float> da(std::size_t(n_) * std::size_t(f_)), dh(da.size()), dn(nc), dxn(nc);
    for (int b = last_block_ - first_block_ - 1; b >= 0; --b) {
      operator_state& mlp = *ops_[--op];
      operator_state& norm = *ops_[--op];
      const block_cache& k = m.blocks[std::size_t(b)];
      // x_out = x + mlp(norm(x)): the residual passes dx_ through unchanged
      models::cpu::matmul_backward(da.data(), mlp.grad(1), dx_.data(), k.a.data(), mlp.weight(1),
                                   n_, f_, c_);
      models::cpu::gelu_backward(dh.data(), da.data(), k.h.data(), n_ * f_);
      models::cpu::matmul_backward(dn.data(), mlp.grad(0), dh.data(), k.n.data(), mlp.weight(0), n_,
                                   c_, f_);
      models::cpu::rmsnorm_backward(dxn.data(), norm.grad(0), dn.data(),
                                    m.xs[std::size_t(b)].data(), norm.weight(0), k.rstd.data(), n_,
                                    c_);
      for (std::size_t j = 0; j < nc; ++j) dx_[j] += dxn[j];
    }
    if (s_.first()) {
      operator_state& emb = *ops_[--op];
      if (emb.grad(0) != nullptr) {
        models::cpu::embedding_backward(emb.grad(0), emb.grad(1), dx_.data(), m.tokens.data(),
                                        s_.train.micro_batch_size, s_.train.seq_len, c_);
      }
      cache_.erase(it);
      return {};
    }
    cache_.erase(it);
    return dx_;
  }

  void abort_iteration() override { cache_.clear(); }

  engine::stage_output validate(int index, std::span<const float> x_in) override {
    load(val_, models::split::val, index, 0, 0);
    return run_forward(val_, x_in);
  }

 private:
  struct block_cache {
    std::vector<float> n, rstd, h, a;  // [N,C] [N] [N,F] [N,F]
  };
  struct mb_cache {
    std::vector<std::int32_t> tokens, targets;  // [B,T]
    std::vector<std::vector<float>> xs;         // the residual stream entering each block, +out
    std::vector<block_cache> blocks;
    std::vector<float> nf, rstdf, probs, losses;  // [N,C] [N] [N,V] [N]
  };

  void load(mb_cache& m, models::split split, std::int64_t position, int replica, int mb) {
    m.tokens.resize(std::size_t(n_));
    m.targets.resize(std::size_t(n_));
    if (corpus_) {
      models::fill_batch(*corpus_, split, s_.train.seed, position, replica, mb,
                         s_.train.micro_batch_size, s_.train.seq_len, m.tokens.data(),
                         m.targets.data());
    }
  }

  engine::stage_output run_forward(mb_cache& m, std::span<const float> x_in) {
    const std::size_t nc = std::size_t(n_) * std::size_t(c_);
    const int blocks = last_block_ - first_block_;
    m.xs.assign(std::size_t(blocks) + 1, std::vector<float>(nc));
    m.blocks.resize(std::size_t(blocks));
    std::size_t op = 0;
    if (s_.first()) {
      const operator_state& emb = *ops_[op++];
      models::cpu::embedding_forward(m.xs[0].data(), m.tokens.data(), emb.weight(0), emb.weight(1),
                                     s_.train.micro_batch_size, s_.train.seq_len, c_);
    } else {
      if (x_in.size() != nc) throw std::invalid_argument("residual_mlp: x_in has the wrong size");
      m.xs[0].assign(x_in.begin(), x_in.end());
    }
    for (int b = 0; b < blocks; ++b) {
      const operator_state& norm = *ops_[op++];
      const operator_state& mlp = *ops_[op++];
      block_cache& k = m.blocks[std::size_t(b)];
      k.n.resize(nc);
      k.rstd.resize(std::size_t(n_));
      k.h.resize(std::size_t(n_) * std::size_t(f_));
      k.a.resize(k.h.size());
      const auto& x = m.xs[std::size_t(b)];
      auto& y = m.xs[std::size_t(b) + 1];
      models::cpu::rmsnorm_forward(k.n.data(), k.rstd.data(), x.data(), norm.weight(0), n_, c_);
      models::cpu::matmul_forward(k.h.data(), k.n.data(), mlp.weight(0), n_, c_, f_);
      models::cpu::gelu_forward(k.a.data(), k.h.data(), n_ * f_);
      models::cpu::matmul_forward(y.data(), k.a.data(), mlp.weight(1), n_, f_, c_);
      for (std::size_t j = 0; j < nc; ++j) y[j] = x[j] + y[j];
    }
    engine::stage_output out;
    if (!s_.last()) {
      out.activation = m.xs.back();
      return out;
    }
    const operator_state& fnorm = *ops_[op++];
    const operator_state& head = *ops_[op++];
    m.nf.resize(nc);
    m.rstdf.resize(std::size_t(n_));
    m.probs.resize(std::size_t(n_) * std::size_t(v_));
    m.losses.resize(std::size_t(n_));
    std::vector<float> logits(m.probs.size());
    models::cpu::rmsnorm_forward(m.nf.data(), m.rstdf.data(), m.xs.back().data(), fnorm.weight(0),
                                 n_, c_);
    models::cpu::matmul_forward(logits.data(), m.nf.data(), head.weight(0), n_, c_, v_);
    models::cpu::softmax_xent_forward(m.losses.data(), m.probs.data(), logits.data(),
                                      m.targets.data(), n_, v_);
    double sum = 0.0;  // in token order
    for (float l : m.losses) sum += l;
    out.loss = sum / n_;
    return out;
  }

  engine::stage_setup s_;
  int n_, c_, f_, v_;
  int first_block_ = 0, last_block_ = 0;
  std::vector<std::unique_ptr<operator_state>> ops_;
  std::optional<models::corpus> corpus_;
  std::int64_t iteration_ = 0;
  std::map<int, mb_cache> cache_;
  mb_cache val_;
  std::vector<float> dx_;
};

}  // namespace

std::unique_ptr<engine::stage_model> make_residual_mlp(const engine::stage_setup& setup) {
  if (setup.stages > setup.model.layers) {
    throw models::config_error("parallel.pp", "more stages than model.layers blocks");
  }
  return std::make_unique<residual_mlp>(setup);
}

}  // namespace custom_stage
