#include "models/model.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "base/hash.hpp"

namespace moevement::models {

using cpu::routing;

moe_model::moe_model(const model_config& cfg, std::uint64_t seed, std::size_t first_op,
                     std::size_t last_op, bool initialize, expert_split experts)
    : cfg_(cfg) {
  const std::int64_t c = cfg.d_model, v = cfg.vocab, f = cfg.d_ff, e = cfg.experts;
  const dtype dt = cfg.compute_dtype;
  const float std0 = 0.02f;
  // GPT-2's scaled init for the projections that write into the residual stream
  const float std_res = std0 / std::sqrt(2.0f * float(cfg.layers));
  // Only this stage's operators get memory (the next one's index is ops_.size()).
  const auto mine = [&] { return ops_.size() >= first_op && ops_.size() < last_op; };
  ops_.emplace_back("embedding", op_kind::embedding,
                    std::vector<param_spec>{{"wte", {v, c}, std0, 0.0f, false},
                                            {"wpe", {cfg.max_seq_len, c}, std0, 0.0f, false}},
                    dt, mine());
  for (int l = 0; l < cfg.layers; ++l) {
    const std::string p = "layer" + std::to_string(l) + ".";
    ops_.emplace_back(p + "norm1", op_kind::norm,
                      std::vector<param_spec>{{"w", {c}, 0.0f, 1.0f, false}}, dt, mine());
    ops_.emplace_back(p + "attention", op_kind::attention,
                      std::vector<param_spec>{{"w_qkv", {c, 3 * c}, std0, 0.0f, true},
                                              {"w_o", {c, c}, std_res, 0.0f, true}},
                      dt, mine());
    ops_.emplace_back(p + "norm2", op_kind::norm,
                      std::vector<param_spec>{{"w", {c}, 0.0f, 1.0f, false}}, dt, mine());
    ops_.emplace_back(p + "gate", op_kind::gate,
                      std::vector<param_spec>{{"w_g", {c, e}, std0, 0.0f, true}}, dt, mine());
    ops_.back().routed_tokens().assign(e, 0);
    ops_.back().prob_sums().assign(e, 0.0);
    for (int j = 0; j < cfg.experts; ++j) {
      ops_.emplace_back(p + "expert" + std::to_string(j), op_kind::expert,
                        std::vector<param_spec>{{"w1", {c, f}, std0, 0.0f, true},
                                                {"w2", {f, c}, std_res, 0.0f, true}},
                        dt, mine() && experts.holds(j, cfg.experts));
    }
  }
  ops_.emplace_back("final_norm", op_kind::norm,
                    std::vector<param_spec>{{"w", {c}, 0.0f, 1.0f, false}}, dt, mine());
  ops_.emplace_back("head", op_kind::head, std::vector<param_spec>{{"w", {c, v}, std0, 0.0f, true}},
                    dt, mine());
  for (std::size_t i = first_op; i < last_op && i < ops_.size() && initialize; ++i) {
    if (ops_[i].allocated()) ops_[i].init(seed, i);
  }
}

std::vector<std::uint64_t> moe_model::op_digests() const {
  return op_digests(0, ops_.size());
}

std::vector<std::uint64_t> moe_model::op_digests(std::size_t first, std::size_t last) const {
  std::vector<std::uint64_t> d;
  for (std::size_t i = first; i < last && i < ops_.size(); ++i) {
    if (!ops_[i].allocated()) {
      throw std::logic_error("op_digests: operator " + ops_[i].name() +
                             " is not held by this partial model; gather digests per stage");
    }
    d.push_back(ops_[i].digest());
  }
  return d;
}

std::vector<stage_range> partition(const model_config& cfg, int stages) {
  if (stages < 1 || stages > cfg.layers) {
    throw std::invalid_argument("partition: " + std::to_string(stages) + " stages for " +
                                std::to_string(cfg.layers) + " layers (need 1..layers)");
  }
  std::vector<stage_range> out;
  const std::size_t per_layer = 4 + std::size_t(cfg.experts);
  int first = 0;
  for (int s = 0; s < stages; ++s) {
    const int n = cfg.layers / stages + (s < cfg.layers % stages ? 1 : 0);
    stage_range r;
    r.first_layer = first;
    r.last_layer = first + n;
    r.has_embedding = s == 0;
    r.has_head = s == stages - 1;
    r.first_op = s == 0 ? 0 : 1 + std::size_t(first) * per_layer;
    r.last_op = 1 + std::size_t(first + n) * per_layer + (r.has_head ? 2 : 0);
    out.push_back(r);
    first += n;
  }
  return out;
}

stage::stage(moe_model& model, stage_range range, int micro_batch_size, int seq_len,
             expert_split experts)
    : model_(model), range_(range), b_(micro_batch_size), t_(seq_len), split_(experts) {
  for (std::size_t i = range.first_op; i < range.last_op; ++i) {
    const auto& op = model.ops()[i];
    if (!op.allocated() && !(op.kind() == op_kind::expert && split_.count > 1)) {
      throw std::invalid_argument("stage: operator " + model.ops()[i].name() +
                                  " is not allocated in this model");
    }
  }
  if (seq_len > model.config().max_seq_len) {
    throw std::invalid_argument("stage: seq_len exceeds the model's max_seq_len");
  }
}

void stage::experts_forward(int l, int mb, layer_cache& c, bool training) {
  const auto& cfg = model_.config();
  const int ch = cfg.d_model, f = cfg.d_ff, rows = c.route.rows();
  if (split_.count > 1) {
    if (exchange_ == nullptr) {
      throw std::logic_error("stage: expert parallelism without an exchange (set_exchange)");
    }
    exchange_->forward(l, mb, c.route.offsets, c.xs, c.ye, training);
    return;
  }
  c.hpre.resize(std::size_t(rows) * f);
  c.act.resize(std::size_t(rows) * f);
  for (int j = 0; j < cfg.experts; ++j) {
    const int r0 = c.route.offsets[j], r = c.route.offsets[j + 1] - r0;
    if (r == 0) continue;
    expert_forward(op(model_.expert(l, j)), r, ch, f, c.xs.data() + std::size_t(r0) * ch,
                   c.hpre.data() + std::size_t(r0) * f, c.act.data() + std::size_t(r0) * f,
                   c.ye.data() + std::size_t(r0) * ch);
  }
}

void stage::experts_backward(int l, int mb, layer_cache& c) {
  const auto& cfg = model_.config();
  const int ch = cfg.d_model, f = cfg.d_ff;
  if (split_.count > 1) {
    exchange_->backward(l, mb, c.route.offsets, d_ye_, d_xs_);
    return;
  }
  for (int j = 0; j < cfg.experts; ++j) {
    auto& ex = op(model_.expert(l, j));
    const int r0 = c.route.offsets[j], r = c.route.offsets[j + 1] - r0;
    if (r == 0) continue;
    expert_backward(ex, ex.grad(0), ex.grad(1), r, ch, f, d_ye_.data() + std::size_t(r0) * ch,
                    c.xs.data() + std::size_t(r0) * ch, c.hpre.data() + std::size_t(r0) * f,
                    c.act.data() + std::size_t(r0) * f, d_a_.data(), d_b_.data(),
                    d_xs_.data() + std::size_t(r0) * ch);
  }
}

void stage::layer_forward(int l, int mb, layer_cache& c, float* out, bool training) {
  const auto& cfg = model_.config();
  const int n = b_ * t_, ch = cfg.d_model, e = cfg.experts;
  auto& norm1 = op(model_.norm1(l));
  auto& attn = op(model_.attention(l));
  auto& norm2 = op(model_.norm2(l));
  auto& gate = op(model_.gate(l));
  const std::size_t nc = std::size_t(n) * ch;
  c.n1.resize(nc);
  c.rstd1.resize(n);
  c.qkv.resize(nc * 3);
  c.att.resize(std::size_t(b_) * cfg.heads * t_ * t_);
  c.yatt.resize(nc);
  c.h.resize(nc);
  c.n2.resize(nc);
  c.rstd2.resize(n);
  c.glogits.resize(std::size_t(n) * e);
  // attention block: h = x + attn(norm1(x))
  cpu::rmsnorm_forward(c.n1.data(), c.rstd1.data(), c.x.data(), norm1.weight(0), n, ch);
  cpu::matmul_forward(c.qkv.data(), c.n1.data(), attn.weight(0), n, ch, 3 * ch);
  cpu::attention_forward(c.yatt.data(), c.att.data(), c.qkv.data(), b_, t_, ch, cfg.heads);
  cpu::matmul_forward(c.h.data(), c.yatt.data(), attn.weight(1), n, ch, ch);
  for (std::size_t i = 0; i < nc; ++i) c.h[i] = c.x[i] + c.h[i];
  // MoE block: out = h + moe(norm2(h))
  cpu::rmsnorm_forward(c.n2.data(), c.rstd2.data(), c.h.data(), norm2.weight(0), n, ch);
  cpu::matmul_forward(c.glogits.data(), c.n2.data(), gate.weight(0), n, ch, e);
  cpu::gate_forward(c.route, c.glogits.data(), n, e, cfg.top_k, cfg.capacity_factor);
  if (training) {
    for (int j = 0; j < e; ++j) {
      gate.routed_tokens()[j] += c.route.routed[j];
      double s = 0.0;
      for (int i = 0; i < n; ++i) s += c.route.probs[std::size_t(i) * e + j];
      gate.prob_sums()[j] += s;
    }
  }
  const int rows = c.route.rows();
  c.xs.resize(std::size_t(rows) * ch);
  c.ye.resize(std::size_t(rows) * ch);
  cpu::moe_gather(c.xs.data(), c.n2.data(), c.route, ch);
  experts_forward(l, mb, c, training);
  cpu::moe_combine_forward(out, c.ye.data(), c.route, ch);
  for (std::size_t i = 0; i < nc; ++i) out[i] = c.h[i] + out[i];
}

void stage::layer_backward(int l, int mb, layer_cache& c, const float* dout, float* dx,
                           float loss_grad) {
  const auto& cfg = model_.config();
  const int n = b_ * t_, ch = cfg.d_model, f = cfg.d_ff, e = cfg.experts;
  auto& norm1 = op(model_.norm1(l));
  auto& attn = op(model_.attention(l));
  auto& norm2 = op(model_.norm2(l));
  auto& gate = op(model_.gate(l));
  const std::size_t nc = std::size_t(n) * ch;
  const int rows = c.route.rows();
  d_ye_.resize(std::size_t(rows) * ch);
  d_xs_.resize(std::size_t(rows) * ch);
  d_a_.resize(std::max<std::size_t>(std::size_t(rows) * f, nc));
  d_b_.resize(std::max<std::size_t>(std::size_t(rows) * f, nc));
  d_weight_.resize(std::size_t(n) * cfg.top_k);
  d_logits_.resize(std::size_t(n) * e);
  d_h_.resize(nc);
  d_c_.resize(nc);
  // MoE block
  cpu::moe_combine_backward(d_ye_.data(), d_weight_.data(), dout, c.ye.data(), c.route, ch);
  experts_backward(l, mb, c);
  cpu::gate_backward(d_logits_.data(), c.route, d_weight_.data(), cfg.aux_loss_coef * loss_grad);
  // dn2 [N,C] = dlogits Wg^T + sum over slots of dxs, in slot order
  cpu::matmul_backward(d_c_.data(), gate.grad(0), d_logits_.data(), c.n2.data(), gate.weight(0), n,
                       ch, e);
  cpu::moe_scatter_add(d_c_.data(), d_xs_.data(), c.route, ch);
  cpu::rmsnorm_backward(d_a_.data(), norm2.grad(0), d_c_.data(), c.h.data(), norm2.weight(0),
                        c.rstd2.data(), n, ch);
  for (std::size_t i = 0; i < nc; ++i) d_h_[i] = dout[i] + d_a_[i];
  // attention block
  d_qkv_.resize(nc * 3);
  d_att_.resize(std::size_t(t_) * t_);
  cpu::matmul_backward(d_c_.data(), attn.grad(1), d_h_.data(), c.yatt.data(), attn.weight(1), n, ch,
                       ch);
  cpu::attention_backward(d_qkv_.data(), d_att_.data(), d_c_.data(), c.att.data(), c.qkv.data(), b_,
                          t_, ch, cfg.heads);
  cpu::matmul_backward(d_b_.data(), attn.grad(0), d_qkv_.data(), c.n1.data(), attn.weight(0), n, ch,
                       3 * ch);
  cpu::rmsnorm_backward(d_a_.data(), norm1.grad(0), d_b_.data(), c.x.data(), norm1.weight(0),
                        c.rstd1.data(), n, ch);
  for (std::size_t i = 0; i < nc; ++i) dx[i] = d_h_[i] + d_a_[i];
}

stage::forward_result stage::forward(int mb, const std::int32_t* tokens, const float* x_in,
                                     const std::int32_t* targets, bool training) {
  const auto& cfg = model_.config();
  const int n = b_ * t_, ch = cfg.d_model, v = cfg.vocab;
  const std::size_t nc = std::size_t(n) * ch;
  if (training && cache_.count(mb) != 0) {
    throw std::logic_error("stage::forward: micro-batch " + std::to_string(mb) +
                           " is already in flight");
  }
  mb_cache local;
  if (!spare_.empty()) {  // reuse buffers: no allocation or page faults in steady state
    local = std::move(spare_.back());
    spare_.pop_back();
  }
  if (training) cache_[mb] = std::move(local);
  mb_cache& c = training ? cache_[mb] : local;
  const int layers = range_.last_layer - range_.first_layer;
  c.layers.resize(layers);
  // stage input -> first layer's x (or straight to `out` when the stage has no layers)
  std::vector<float>& x0 = layers > 0 ? c.layers[0].x : c.out;
  x0.resize(nc);
  if (range_.has_embedding) {
    if (tokens == nullptr) throw std::invalid_argument("stage::forward: first stage needs tokens");
    c.tokens.assign(tokens, tokens + n);
    for (const auto tok : c.tokens) {
      if (tok < 0 || tok >= v) throw std::out_of_range("stage::forward: token out of vocabulary");
    }
    auto& emb = op(model_.embedding());
    cpu::embedding_forward(x0.data(), tokens, emb.weight(0), emb.weight(1), b_, t_, ch);
  } else {
    if (x_in == nullptr) throw std::invalid_argument("stage::forward: x_in is required");
    std::copy(x_in, x_in + nc, x0.begin());
  }
  forward_result res;
  for (int i = 0; i < layers; ++i) {
    std::vector<float>& out = i + 1 < layers ? c.layers[i + 1].x : c.out;
    out.resize(nc);
    layer_forward(range_.first_layer + i, mb, c.layers[i], out.data(), training);
    res.aux_loss += c.layers[i].route.aux_loss;
  }
  if (range_.has_head) {
    if (targets == nullptr) throw std::invalid_argument("stage::forward: last stage needs targets");
    c.targets.assign(targets, targets + n);
    auto& nf = op(model_.final_norm());
    auto& head = op(model_.head());
    c.nf.resize(nc);
    c.rstdf.resize(n);
    c.probs.resize(std::size_t(n) * v);
    std::vector<float>& logits = h_logits_;
    std::vector<float>& losses = h_losses_;
    logits.resize(std::size_t(n) * v);
    losses.resize(n);
    cpu::rmsnorm_forward(c.nf.data(), c.rstdf.data(), c.out.data(), nf.weight(0), n, ch);
    cpu::matmul_forward(logits.data(), c.nf.data(), head.weight(0), n, ch, v);
    cpu::softmax_xent_forward(losses.data(), c.probs.data(), logits.data(), targets, n, v);
    double sum = 0.0;
    for (const float x : losses) sum += x;
    res.loss = sum / n;
  } else if (training) {
    res.activation = c.out;
  } else {
    val_out_.swap(c.out);  // c goes back to spare_; keep its output (a swap, no copy)
    res.activation = val_out_;
  }
  if (!training) spare_.push_back(std::move(local));
  return res;
}

void stage::abort() {
  for (auto& [mb, c] : cache_) spare_.push_back(std::move(c));
  cache_.clear();
}

std::span<const float> stage::backward(int mb, const float* grad_out, float loss_grad) {
  auto it = cache_.find(mb);
  if (it == cache_.end()) {
    throw std::logic_error("stage::backward: micro-batch " + std::to_string(mb) +
                           " has no forward in flight");
  }
  mb_cache& c = it->second;
  const auto& cfg = model_.config();
  const int n = b_ * t_, ch = cfg.d_model, v = cfg.vocab;
  const std::size_t nc = std::size_t(n) * ch;
  std::vector<float>& dcur = d_cur_;
  std::vector<float>& dnext = d_next_;
  dcur.resize(nc);
  dnext.resize(nc);
  if (range_.has_head) {
    auto& nf = op(model_.final_norm());
    auto& head = op(model_.head());
    std::vector<float>& dlogits = h_dlogits_;
    std::vector<float>& dnf = h_dnf_;
    dlogits.resize(std::size_t(n) * v);
    dnf.resize(nc);
    // the micro-batch loss is a mean over its N tokens
    cpu::softmax_xent_backward(dlogits.data(), c.probs.data(), c.targets.data(),
                               loss_grad / float(n), n, v);
    cpu::matmul_backward(dnf.data(), head.grad(0), dlogits.data(), c.nf.data(), head.weight(0), n,
                         ch, v);
    cpu::rmsnorm_backward(dcur.data(), nf.grad(0), dnf.data(), c.out.data(), nf.weight(0),
                          c.rstdf.data(), n, ch);
  } else {
    if (grad_out == nullptr) throw std::invalid_argument("stage::backward: grad_out is required");
    std::copy(grad_out, grad_out + nc, dcur.begin());
  }
  const int layers = range_.last_layer - range_.first_layer;
  for (int i = layers - 1; i >= 0; --i) {
    layer_backward(range_.first_layer + i, mb, c.layers[i], dcur.data(), dnext.data(), loss_grad);
    std::swap(dcur, dnext);
  }
  std::span<const float> result;
  if (range_.has_embedding) {
    auto& emb = op(model_.embedding());
    cpu::embedding_backward(emb.grad(0), emb.grad(1), dcur.data(), c.tokens.data(), b_, t_, ch);
  } else {
    grad_in_.swap(dcur);
    result = grad_in_;
  }
  spare_.push_back(std::move(it->second));
  cache_.erase(it);
  return result;
}

bool loss_scaler::update(bool finite) {
  if (!enabled) return finite;
  if (!finite) {
    scale = std::max(1.0f, scale * 0.5f);
    good_steps = 0;
    return false;
  }
  if (++good_steps >= window) {
    // Never to infinity: half of it is infinity too, and every later step would be skipped.
    if (const float grown = scale * 2.0f; std::isfinite(grown)) scale = grown;
    good_steps = 0;
  }
  return true;
}

step_plan plan_step(std::span<const double> per_op_sq, loss_scaler& scaler, float grad_clip) {
  double sq = 0.0;
  for (const double s : per_op_sq) sq += s;  // canonical operator order, whatever the placement
  const double scale = scaler.enabled ? double(scaler.scale) : 1.0;
  step_plan plan;
  const bool finite = std::isfinite(sq);
  plan.apply = scaler.update(finite);
  if (!plan.apply) {
    plan.grad_norm = sq;
    plan.grad_mul = 0.0f;
    return plan;
  }
  plan.grad_norm = std::sqrt(sq) / scale;
  double mul = 1.0 / scale;
  if (grad_clip > 0.0f && plan.grad_norm > grad_clip) mul *= grad_clip / plan.grad_norm;
  plan.grad_mul = static_cast<float>(mul);
  return plan;
}

std::uint64_t state_hash(std::span<const std::uint64_t> op_digests, const loss_scaler& scaler) {
  hasher h;
  h.update(std::as_bytes(op_digests));
  const std::uint8_t enabled = scaler.enabled ? 1 : 0;
  h.update_value(enabled);
  h.update_value(scaler.scale);
  h.update_value(scaler.good_steps);
  return h.digest();
}

}  // namespace moevement::models
