#include "models/cuda/stage.hpp"

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace moevement::models::cuda {
namespace {

using buffer = float_buffer;
using index_buffer = std::unique_ptr<device_array<std::int32_t>>;

// An owned operator on the device: its compute weights (fp32 values of the compute dtype) and
// its accumulated gradient, laid out as operator_state lays out its parameters.
struct device_operator {
  buffer weights, grad;  // [numel] each
  // The engine's stage only (allocated at its first step): the optimizer state, and the
  // compute weights' bytes a snapshot copies ([numel * dtype_size] bytes, as floats).
  buffer master, m, v, compute;
};

// One layer's activations of a micro-batch in flight. N = B*T, R = N*K rows at most.
struct layer_cache {
  buffer x, n1, rstd1, qkv, att, yatt, h, n2, rstd2, glogits;  // [N,C] [N,C] [N] [N,3C] ...
  buffer xs, hpre, act, ye;                                    // [R,C] [R,F] [R,F] [R,C]
  device_routing route;
};

struct mb_cache {
  index_buffer tokens, targets;  // [N]
  std::vector<layer_cache> layers;
  buffer out, nf, rstdf, probs;  // [N,C] [N,C] [N] [N,V]
};

}  // namespace

struct stage::impl {
  context& ctx;
  moe_model& model;
  stage_range range;
  int b, t, n, nk;
  std::vector<device_operator> ops;  // [last_op - first_op]
  std::map<int, mb_cache> cache;
  std::vector<mb_cache> spare;
  // backward scratch (no state between calls)
  buffer d_a, d_b, d_c, d_h, d_qkv, d_att, d_weight, d_logits, d_ye, d_xs, d_cur, d_next;
  buffer d_head, d_nf, logits, losses;
  std::vector<float> host_out, host_grad_in, host_losses;
  // The training state (stage::step): whether the device's master, m, v and weights are the
  // current state, and whether the host operators' are older.
  bool device_current = false, host_stale = false;
  std::unique_ptr<copy_stream> copies;         // the snapshot copies' side stream
  std::unique_ptr<device_array<double>> sums;  // grad_sq_sums' output, [owned operators]

  impl(context& c, moe_model& m, stage_range r, int mbs, int seq)
      : ctx(c), model(m), range(r), b(mbs), t(seq), n(mbs * seq), nk(mbs * seq * m.config().top_k) {
    for (std::size_t i = r.first_op; i < r.last_op; ++i) {
      const auto& op = m.ops()[i];
      device_operator d;
      d.weights = make_float_buffer(ctx, std::size_t(op.numel()));
      d.grad = make_float_buffer(ctx, std::size_t(op.numel()));
      fill_zero(ctx, d.grad->data(), d.grad->size() * sizeof(float));
      ops.push_back(std::move(d));
    }
    const auto& cfg = m.config();
    const std::size_t c0 = cfg.d_model, f = cfg.d_ff, e = cfg.experts, v = cfg.vocab;
    const std::size_t nc = std::size_t(n) * c0, rows = std::size_t(nk);
    const std::size_t wide = std::max(rows * f, nc);
    d_a = make_float_buffer(ctx, wide);
    d_b = make_float_buffer(ctx, wide);
    d_c = make_float_buffer(ctx, nc);
    d_h = make_float_buffer(ctx, nc);
    d_qkv = make_float_buffer(ctx, 3 * nc);
    d_att = make_float_buffer(ctx, std::size_t(b) * cfg.heads * t * t);
    d_weight = make_float_buffer(ctx, std::size_t(n) * cfg.top_k);
    d_logits = make_float_buffer(ctx, std::size_t(n) * e);
    d_ye = make_float_buffer(ctx, rows * c0);
    d_xs = make_float_buffer(ctx, rows * c0);
    d_cur = make_float_buffer(ctx, nc);
    d_next = make_float_buffer(ctx, nc);
    if (r.has_head) {
      d_head = make_float_buffer(ctx, std::size_t(n) * v);
      d_nf = make_float_buffer(ctx, nc);
      logits = make_float_buffer(ctx, std::size_t(n) * v);
      losses = make_float_buffer(ctx, n);
      host_losses.resize(n);
    }
  }

  device_operator& dop(std::size_t i) { return ops[i - range.first_op]; }
  const float* w(std::size_t i, std::size_t p) {
    return dop(i).weights->data() + model.ops()[i].param_offset(p);
  }
  // nullptr for a frozen operator: no weight gradient (the kernels' convention)
  float* g(std::size_t i, std::size_t p) {
    if (model.ops()[i].mode() != op_mode::active) return nullptr;
    return dop(i).grad->data() + model.ops()[i].param_offset(p);
  }

  void allocate(mb_cache& c) {
    const auto& cfg = model.config();
    const std::size_t c0 = cfg.d_model, f = cfg.d_ff, e = cfg.experts;
    const std::size_t nc = std::size_t(n) * c0, rows = std::size_t(nk);
    if (c.out) return;  // a reused cache is allocated already
    c.tokens = std::make_unique<device_array<std::int32_t>>(ctx, n);
    c.targets = std::make_unique<device_array<std::int32_t>>(ctx, n);
    c.layers.resize(std::size_t(range.last_layer - range.first_layer));
    for (auto& l : c.layers) {
      l.x = make_float_buffer(ctx, nc);
      l.n1 = make_float_buffer(ctx, nc);
      l.rstd1 = make_float_buffer(ctx, n);
      l.qkv = make_float_buffer(ctx, 3 * nc);
      l.att = make_float_buffer(ctx, std::size_t(b) * cfg.heads * t * t);
      l.yatt = make_float_buffer(ctx, nc);
      l.h = make_float_buffer(ctx, nc);
      l.n2 = make_float_buffer(ctx, nc);
      l.rstd2 = make_float_buffer(ctx, n);
      l.glogits = make_float_buffer(ctx, std::size_t(n) * e);
      l.xs = make_float_buffer(ctx, rows * c0);
      l.hpre = make_float_buffer(ctx, rows * f);
      l.act = make_float_buffer(ctx, rows * f);
      l.ye = make_float_buffer(ctx, rows * c0);
    }
    c.out = make_float_buffer(ctx, nc);
    if (range.has_head) {
      c.nf = make_float_buffer(ctx, nc);
      c.rstdf = make_float_buffer(ctx, n);
      c.probs = make_float_buffer(ctx, std::size_t(n) * cfg.vocab);
    }
  }

  // models::stage::layer_forward, kernel for kernel; `res` receives the layer output [N,C].
  void layer_forward(int l, layer_cache& c, float* res, bool training) {
    const auto& cfg = model.config();
    const int ch = cfg.d_model, f = cfg.d_ff, e = cfg.experts;
    const std::size_t norm1 = model.norm1(l), attn = model.attention(l), norm2 = model.norm2(l),
                      gate = model.gate(l);
    const long nc = long(n) * ch;
    rmsnorm_forward(ctx, c.n1->data(), c.rstd1->data(), c.x->data(), w(norm1, 0), n, ch);
    matmul_forward(ctx, c.qkv->data(), c.n1->data(), w(attn, 0), n, ch, 3 * ch);
    attention_forward(ctx, c.yatt->data(), c.att->data(), c.qkv->data(), b, t, ch, cfg.heads);
    matmul_forward(ctx, c.h->data(), c.yatt->data(), w(attn, 1), n, ch, ch);
    add(ctx, c.h->data(), c.x->data(), c.h->data(), nc);
    rmsnorm_forward(ctx, c.n2->data(), c.rstd2->data(), c.h->data(), w(norm2, 0), n, ch);
    matmul_forward(ctx, c.glogits->data(), c.n2->data(), w(gate, 0), n, ch, e);
    gate_forward(ctx, c.route, c.glogits->data(), n, e, cfg.top_k, cfg.capacity_factor);
    const cpu::routing& r = c.route.host;
    if (training) {
      auto& host_gate = model.ops()[gate];
      for (int j = 0; j < e; ++j) {
        host_gate.routed_tokens()[j] += r.routed[j];
        double s = 0.0;
        for (int i = 0; i < n; ++i) s += r.probs[std::size_t(i) * e + j];
        host_gate.prob_sums()[j] += s;
      }
    }
    moe_gather(ctx, c.xs->data(), c.n2->data(), c.route, ch);
    for (int j = 0; j < e; ++j) {
      const std::size_t ex = model.expert(l, j);
      const int r0 = r.offsets[j], rj = r.offsets[j + 1] - r0;
      if (rj == 0) continue;
      float* hp = c.hpre->data() + std::size_t(r0) * f;
      matmul_forward(ctx, hp, c.xs->data() + std::size_t(r0) * ch, w(ex, 0), rj, ch, f);
      gelu_forward(ctx, c.act->data() + std::size_t(r0) * f, hp, rj * f);
      matmul_forward(ctx, c.ye->data() + std::size_t(r0) * ch, c.act->data() + std::size_t(r0) * f,
                     w(ex, 1), rj, f, ch);
    }
    moe_combine_forward(ctx, res, c.ye->data(), c.route, ch);
    add(ctx, res, c.h->data(), res, nc);
  }

  // models::stage::layer_backward, kernel for kernel.
  void layer_backward(int l, layer_cache& c, const float* dout, float* dx, float loss_grad) {
    const auto& cfg = model.config();
    const int ch = cfg.d_model, f = cfg.d_ff, e = cfg.experts;
    const std::size_t norm1 = model.norm1(l), attn = model.attention(l), norm2 = model.norm2(l),
                      gate = model.gate(l);
    const long nc = long(n) * ch;
    const cpu::routing& r = c.route.host;
    moe_combine_backward(ctx, d_ye->data(), d_weight->data(), dout, c.ye->data(), c.route, ch);
    for (int j = 0; j < e; ++j) {
      const std::size_t ex = model.expert(l, j);
      const int r0 = r.offsets[j], rj = r.offsets[j + 1] - r0;
      if (rj == 0) continue;
      // dact [r,F] = dye W2^T ; dW2 += act^T dye
      matmul_backward(ctx, d_a->data(), g(ex, 1), d_ye->data() + std::size_t(r0) * ch,
                      c.act->data() + std::size_t(r0) * f, w(ex, 1), rj, f, ch);
      gelu_backward(ctx, d_b->data(), d_a->data(), c.hpre->data() + std::size_t(r0) * f, rj * f);
      // dxs [r,C] = dhpre W1^T ; dW1 += xs^T dhpre
      matmul_backward(ctx, d_xs->data() + std::size_t(r0) * ch, g(ex, 0), d_b->data(),
                      c.xs->data() + std::size_t(r0) * ch, w(ex, 0), rj, ch, f);
    }
    gate_backward(ctx, d_logits->data(), c.route, d_weight->data(), cfg.aux_loss_coef * loss_grad);
    matmul_backward(ctx, d_c->data(), g(gate, 0), d_logits->data(), c.n2->data(), w(gate, 0), n, ch,
                    e);
    moe_scatter_add(ctx, d_c->data(), d_xs->data(), c.route, ch);
    rmsnorm_backward(ctx, d_a->data(), g(norm2, 0), d_c->data(), c.h->data(), w(norm2, 0),
                     c.rstd2->data(), n, ch);
    add(ctx, d_h->data(), dout, d_a->data(), nc);
    matmul_backward(ctx, d_c->data(), g(attn, 1), d_h->data(), c.yatt->data(), w(attn, 1), n, ch,
                    ch);
    attention_backward(ctx, d_qkv->data(), d_att->data(), d_c->data(), c.att->data(), c.qkv->data(),
                       b, t, ch, cfg.heads);
    matmul_backward(ctx, d_b->data(), g(attn, 0), d_qkv->data(), c.n1->data(), w(attn, 0), n, ch,
                    3 * ch);
    rmsnorm_backward(ctx, d_a->data(), g(norm1, 0), d_b->data(), c.x->data(), w(norm1, 0),
                     c.rstd1->data(), n, ch);
    add(ctx, dx, d_h->data(), d_a->data(), nc);
  }
};

stage::stage(context& ctx, moe_model& model, stage_range range, int micro_batch_size, int seq_len)
    : range_(range), b_(micro_batch_size), t_(seq_len) {
  for (std::size_t i = range.first_op; i < range.last_op; ++i) {
    if (!model.ops()[i].allocated()) {
      throw std::invalid_argument("cuda::stage: operator " + model.ops()[i].name() +
                                  " is not allocated in this model");
    }
  }
  if (seq_len > model.config().max_seq_len) {
    throw std::invalid_argument("cuda::stage: seq_len exceeds the model's max_seq_len");
  }
  if (range.last_layer <= range.first_layer) {
    throw std::invalid_argument("cuda::stage: a stage needs at least one layer");
  }
  impl_ = std::make_unique<impl>(ctx, model, range, micro_batch_size, seq_len);
  upload_weights();
  warm_up();
}

void stage::warm_up() {
  // CUDA loads a kernel and cuBLASLt picks an algorithm at first use: one forward and backward
  // of a dummy micro-batch here keeps most of that out of the first iteration, which the engine
  // times as Algorithm 1's profile (the dummy tokens all route alike, so expert GEMMs of other
  // row counts still pick theirs later, deterministically). Nothing of it stays: gradients
  // zeroed, gate counters reset.
  const std::size_t n = std::size_t(tokens()), nc = n * std::size_t(impl_->model.config().d_model);
  const std::vector<std::int32_t> zeros(n, 0);
  const std::vector<float> x(nc, 0.0f);
  forward(-2, zeros.data(), x.data(), zeros.data());
  backward(-2, range_.has_head ? nullptr : x.data(), 1.0f);
  zero_grads();
  for (std::size_t i = range_.first_op; i < range_.last_op; ++i) {
    impl_->model.ops()[i].reset_popularity();
  }
  impl_->ctx.synchronize();
}

stage::~stage() = default;

void step_operator(context& ctx, operator_state& op, float* master, float* m, float* v,
                   const float* grad, float* weights, const adamw_config& cfg, float grad_mul) {
  const std::int64_t next = op.step() + 1;
  const auto [bc1, bc2] = adamw_bias_corrections(cfg, next);  // once per operator, as the CPU
  adamw_scalars a{cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, 0.0f, bc1, bc2, grad_mul};
  for (std::size_t p = 0; p < op.param_count(); ++p) {
    const long off = long(op.param_offset(p)), len = long(op.param_offset(p + 1)) - off;
    a.weight_decay = op.param(p).decay ? cfg.weight_decay : 0.0f;
    adamw_step(ctx, master + off, m + off, v + off, grad + off, len, a);
  }
  round_to_compute(ctx, weights, master, long(op.numel()), op.compute_dtype());
  op.set_step(next);
}

void stage::upload_weights() {
  impl& s = *impl_;
  for (std::size_t i = range_.first_op; i < range_.last_op; ++i) {
    const auto& op = s.model.ops()[i];
    copy_to_device(s.ctx, s.dop(i).weights->data(), op.weight(0),
                   std::size_t(op.numel()) * sizeof(float));
  }
}

void stage::zero_grads() {
  for (auto& d : impl_->ops) fill_zero(impl_->ctx, d.grad->data(), d.grad->size() * sizeof(float));
}

void stage::download_grads() {
  impl& s = *impl_;
  for (std::size_t i = range_.first_op; i < range_.last_op; ++i) {
    auto& op = s.model.ops()[i];
    if (op.mode() != op_mode::active) continue;
    copy_to_host(s.ctx, op.grad().data(), s.dop(i).grad->data(), op.grad().size() * sizeof(float));
  }
}

float* stage::weights(std::size_t i) {
  return impl_->dop(i).weights->data();
}
float* stage::grads(std::size_t i) {
  return impl_->dop(i).grad->data();
}

std::size_t stage::in_flight() const {
  return impl_->cache.size();
}

void stage::abort() {
  for (auto& [mb, c] : impl_->cache) impl_->spare.push_back(std::move(c));
  impl_->cache.clear();
}

models::stage::forward_result stage::forward(int mb, const std::int32_t* tokens, const float* x_in,
                                             const std::int32_t* targets, bool training) {
  impl& s = *impl_;
  const auto& cfg = s.model.config();
  const int n = s.n, ch = cfg.d_model, v = cfg.vocab;
  const std::size_t nc = std::size_t(n) * ch;
  if (training && s.cache.count(mb) != 0) {
    throw std::logic_error("cuda::stage::forward: micro-batch " + std::to_string(mb) +
                           " is already in flight");
  }
  // inputs checked before the micro-batch counts as in flight
  if (range_.has_embedding) {
    if (tokens == nullptr) throw std::invalid_argument("cuda::stage::forward: needs tokens");
    for (int i = 0; i < n; ++i) {
      if (tokens[i] < 0 || tokens[i] >= v) {
        throw std::out_of_range("cuda::stage::forward: token out of vocabulary");
      }
    }
  } else if (x_in == nullptr) {
    throw std::invalid_argument("cuda::stage::forward: x_in is required");
  }
  if (range_.has_head && targets == nullptr) {
    throw std::invalid_argument("cuda::stage::forward: needs targets");
  }
  mb_cache local;
  if (!s.spare.empty()) {
    local = std::move(s.spare.back());
    s.spare.pop_back();
  }
  s.allocate(local);
  mb_cache& c = training ? (s.cache[mb] = std::move(local)) : local;
  float* x0 = c.layers[0].x->data();
  if (range_.has_embedding) {
    copy_to_device(s.ctx, c.tokens->data(), tokens, std::size_t(n) * sizeof(std::int32_t));
    const std::size_t emb = s.model.embedding();
    embedding_forward(s.ctx, x0, c.tokens->data(), s.w(emb, 0), s.w(emb, 1), b_, t_, ch);
  } else {
    copy_to_device(s.ctx, x0, x_in, nc * sizeof(float));
  }
  models::stage::forward_result res;
  const int layers = range_.last_layer - range_.first_layer;
  for (int i = 0; i < layers; ++i) {
    float* out = i + 1 < layers ? c.layers[std::size_t(i) + 1].x->data() : c.out->data();
    s.layer_forward(range_.first_layer + i, c.layers[std::size_t(i)], out, training);
    res.aux_loss += c.layers[std::size_t(i)].route.host.aux_loss;
  }
  if (range_.has_head) {
    copy_to_device(s.ctx, c.targets->data(), targets, std::size_t(n) * sizeof(std::int32_t));
    const std::size_t fnorm = s.model.final_norm(), head = s.model.head();
    rmsnorm_forward(s.ctx, c.nf->data(), c.rstdf->data(), c.out->data(), s.w(fnorm, 0), n, ch);
    matmul_forward(s.ctx, s.logits->data(), c.nf->data(), s.w(head, 0), n, ch, v);
    softmax_xent_forward(s.ctx, s.losses->data(), c.probs->data(), s.logits->data(),
                         c.targets->data(), n, v);
    copy_to_host(s.ctx, s.host_losses.data(), s.losses->data(), std::size_t(n) * sizeof(float));
    double sum = 0.0;
    for (const float x : s.host_losses) sum += x;
    res.loss = sum / n;
  } else {
    s.host_out.resize(nc);
    copy_to_host(s.ctx, s.host_out.data(), c.out->data(), nc * sizeof(float));
    res.activation = s.host_out;
  }
  if (!training) s.spare.push_back(std::move(local));
  return res;
}

std::span<const float> stage::backward(int mb, const float* grad_out, float loss_grad) {
  impl& s = *impl_;
  auto it = s.cache.find(mb);
  if (it == s.cache.end()) {
    throw std::logic_error("cuda::stage::backward: micro-batch " + std::to_string(mb) +
                           " has no forward in flight");
  }
  mb_cache& c = it->second;
  const auto& cfg = s.model.config();
  const int n = s.n, ch = cfg.d_model, v = cfg.vocab;
  const std::size_t nc = std::size_t(n) * ch;
  float* cur = s.d_cur->data();
  float* next = s.d_next->data();
  if (range_.has_head) {
    const std::size_t fnorm = s.model.final_norm(), head = s.model.head();
    // the micro-batch loss is a mean over its N tokens
    softmax_xent_backward(s.ctx, s.d_head->data(), c.probs->data(), c.targets->data(),
                          loss_grad / float(n), n, v);
    matmul_backward(s.ctx, s.d_nf->data(), s.g(head, 0), s.d_head->data(), c.nf->data(),
                    s.w(head, 0), n, ch, v);
    rmsnorm_backward(s.ctx, cur, s.g(fnorm, 0), s.d_nf->data(), c.out->data(), s.w(fnorm, 0),
                     c.rstdf->data(), n, ch);
  } else {
    if (grad_out == nullptr) throw std::invalid_argument("cuda::stage::backward: grad_out needed");
    copy_to_device(s.ctx, cur, grad_out, nc * sizeof(float));
  }
  const int layers = range_.last_layer - range_.first_layer;
  for (int i = layers - 1; i >= 0; --i) {
    s.layer_backward(range_.first_layer + i, c.layers[std::size_t(i)], cur, next, loss_grad);
    std::swap(cur, next);
  }
  std::span<const float> result;
  if (range_.has_embedding) {
    const std::size_t emb = s.model.embedding();
    embedding_backward(s.ctx, s.g(emb, 0), s.g(emb, 1), cur, c.tokens->data(), b_, t_, ch, v);
  } else {
    s.host_grad_in.resize(nc);
    copy_to_host(s.ctx, s.host_grad_in.data(), cur, nc * sizeof(float));
    result = s.host_grad_in;
  }
  s.spare.push_back(std::move(it->second));
  s.cache.erase(it);
  return result;
}

void stage::prepare() {
  if (!impl_->device_current) upload_weights();
}

bool stage::state_on_device() const {
  return impl_->device_current;
}

void stage::host_changed() {
  impl_->device_current = false;
  impl_->host_stale = false;
}

void stage::step(const step_plan& plan, const adamw_config& cfg, bool grads_from_host) {
  impl& s = *impl_;
  if (!s.copies) s.copies = std::make_unique<copy_stream>(s.ctx);
  for (std::size_t i = range_.first_op; i < range_.last_op; ++i) {
    auto& op = s.model.ops()[i];
    auto& d = s.dop(i);
    if (op.mode() != op_mode::active) continue;
    const std::size_t bytes = std::size_t(op.numel()) * sizeof(float);
    if (!d.master) {
      d.master = make_float_buffer(s.ctx, std::size_t(op.numel()));
      d.m = make_float_buffer(s.ctx, std::size_t(op.numel()));
      d.v = make_float_buffer(s.ctx, std::size_t(op.numel()));
      // compute bytes (2 or 4 per element) in a float buffer: numel floats always suffice
      d.compute = make_float_buffer(s.ctx, std::size_t(op.numel()));
    }
    if (!s.device_current) {  // the host's state is the current one: it goes up first
      copy_to_device(s.ctx, d.master->data(), op.master().data(), bytes);
      copy_to_device(s.ctx, d.m->data(), op.adam_m().data(), bytes);
      copy_to_device(s.ctx, d.v->data(), op.adam_v().data(), bytes);
    }
    if (grads_from_host) copy_to_device(s.ctx, d.grad->data(), op.grad().data(), bytes);
    if (plan.apply) {
      step_operator(s.ctx, op, d.master->data(), d.m->data(), d.v->data(), d.grad->data(),
                    d.weights->data(), cfg, plan.grad_mul);
    }
  }
  s.device_current = true;
  s.host_stale = s.host_stale || plan.apply;
  s.copies->mark();  // snapshot copies queued from now on follow this step
}

std::vector<double> stage::grad_sq_sums() {
  impl& s = *impl_;
  std::vector<const float*> grads;
  std::vector<long> sizes;
  std::vector<std::size_t> at;  // of each active operator in the result
  for (std::size_t i = range_.first_op; i < range_.last_op; ++i) {
    const auto& op = s.model.ops()[i];
    if (op.mode() != op_mode::active) continue;
    grads.push_back(s.dop(i).grad->data());
    sizes.push_back(long(op.numel()));
    at.push_back(i - range_.first_op);
  }
  std::vector<double> out(range_.last_op - range_.first_op, 0.0);
  if (grads.empty()) return out;
  // allocated once: a cudaFree would wait for the whole device, snapshot copies included
  if (!s.sums) s.sums = std::make_unique<device_array<double>>(s.ctx, out.size());
  sum_squares(s.ctx, s.sums->data(), grads, sizes);
  std::vector<double> got(grads.size());
  copy_to_host(s.ctx, got.data(), s.sums->data(), grads.size() * sizeof(double));
  for (std::size_t j = 0; j < at.size(); ++j) out[at[j]] = got[j];
  return out;
}

void stage::sync_to_host() {
  impl& s = *impl_;
  if (!s.host_stale) return;
  for (std::size_t i = range_.first_op; i < range_.last_op; ++i) {
    auto& op = s.model.ops()[i];
    auto& d = s.dop(i);
    if (op.mode() != op_mode::active || !d.master) continue;
    const std::size_t bytes = std::size_t(op.numel()) * sizeof(float);
    copy_to_host(s.ctx, op.master().data(), d.master->data(), bytes);
    copy_to_host(s.ctx, op.adam_m().data(), d.m->data(), bytes);
    copy_to_host(s.ctx, op.adam_v().data(), d.v->data(), bytes);
    op.refresh_compute();
  }
  s.host_stale = false;
}

void stage::copy_out(std::size_t i, tensor t, std::span<std::byte> dst) {
  impl& s = *impl_;
  if (!s.device_current || !s.copies) {
    throw std::logic_error("cuda::stage::copy_out: the device does not hold the current state");
  }
  if (i < range_.first_op || i >= range_.last_op) {
    throw std::out_of_range("cuda::stage::copy_out: operator " + std::to_string(i) +
                            " is not this stage's");
  }
  const auto& op = s.model.ops()[i];
  auto& d = s.dop(i);
  if (op.mode() != op_mode::active || !d.master) {
    throw std::logic_error("cuda::stage::copy_out: operator " + op.name() +
                           " has no state on the device");
  }
  const std::size_t numel = std::size_t(op.numel());
  const std::size_t want =
      t == tensor::compute ? numel * dtype_size(op.compute_dtype()) : numel * sizeof(float);
  if (dst.size() != want) {
    throw std::invalid_argument("cuda::stage::copy_out: " + std::to_string(dst.size()) +
                                " bytes for a tensor of " + std::to_string(want));
  }
  switch (t) {
    case tensor::master:
      s.copies->copy_to_host(dst.data(), d.master->data(), want);
      break;
    case tensor::adam_m:
      s.copies->copy_to_host(dst.data(), d.m->data(), want);
      break;
    case tensor::adam_v:
      s.copies->copy_to_host(dst.data(), d.v->data(), want);
      break;
    case tensor::compute:
      s.copies->compute_bytes(d.compute->data(), d.master->data(), long(numel), op.compute_dtype());
      s.copies->copy_to_host(dst.data(), d.compute->data(), want);
      break;
  }
}

void stage::wait_copies() {
  if (impl_->copies) impl_->copies->synchronize();
}

std::shared_ptr<void> stage::pin(std::span<std::byte> bytes) {
  return pin_host_memory(impl_->ctx, bytes);
}

std::shared_ptr<std::byte[]> stage::alloc_pinned(std::size_t n) {
  return cuda::alloc_pinned(impl_->ctx, n);
}

double stage::time_copy(std::span<std::byte> dst) {
  impl& s = *impl_;
  if (!s.copies) s.copies = std::make_unique<copy_stream>(s.ctx);
  s.ctx.synchronize();
  s.copies->mark();
  const auto t0 = std::chrono::steady_clock::now();
  std::size_t at = 0;
  for (std::size_t i = range_.first_op; at < dst.size();
       i = i + 1 < range_.last_op ? i + 1 : range_.first_op) {
    const auto& w = *s.dop(i).weights;
    const std::size_t n = std::min(w.size() * sizeof(float), dst.size() - at);
    s.copies->copy_to_host(dst.data() + at, w.data(), n);
    at += n;
  }
  s.copies->synchronize();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace moevement::models::cuda
