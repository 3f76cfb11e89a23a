#include "models/cuda/trainer.hpp"

#include <cmath>
#include <stdexcept>
#include <vector>

#include "models/cuda/device.hpp"
#include "models/cuda/kernels.hpp"
#include "models/data.hpp"

namespace moevement::models::cuda {
namespace {

using buffer = std::unique_ptr<device_array<float>>;

buffer make(context& ctx, std::size_t n) {
  return std::make_unique<device_array<float>>(ctx, n);
}

// An operator's training state on the device; the host operator_state keeps the step.
struct device_operator {
  buffer master, m, v, grad, weights;  // [numel] each; weights: the compute dtype's fp32 values
  std::vector<std::int64_t> offsets;   // [params+1], as operator_state lays them out
  float* weight(std::size_t p) { return weights->data() + offsets[p]; }
  float* grad_of(std::size_t p) { return grad->data() + offsets[p]; }
};

// Activations of one layer for the micro-batch in flight. N = B*T, R = N*K rows at most.
struct layer_cache {
  buffer x, n1, rstd1, qkv, att, yatt, h, n2, rstd2, glogits;  // [N,C] [N,C] [N] [N,3C] ...
  buffer xs, hpre, act, ye;                                      // [R,C] [R,F] [R,F] [R,C]
  device_routing route;
};

}  // namespace

struct trainer::impl {
  model_config cfg;
  train_config train;
  corpus data;
  moe_model model;
  context ctx;
  loss_scaler scaler;
  std::int64_t iteration = 0;
  std::vector<device_operator> ops;
  std::vector<buffer> replica_sum;  // [ops][numel], only when data_parallel > 1
  int b, t, n, nk;
  std::vector<layer_cache> layers;
  std::unique_ptr<device_array<std::int32_t>> tokens, targets;  // [N]
  buffer out, nf, rstdf, logits, probs, losses;                  // [N,C] [N,C] [N] [N,V] x2 [N]
  // backward scratch
  buffer d_a, d_b, d_c, d_h, d_qkv, d_att, d_weight, d_logits, d_ye, d_xs, d_cur, d_next;
  buffer d_head, d_nf;
  std::unique_ptr<device_array<double>> sq;  // [ops]
  std::vector<float> host_losses;

  impl(const model_config& m, const train_config& tr)
      : cfg(m),
        train(tr),
        data(corpus::load(tr.corpus, tr.val_fraction, tr.seq_len)),
        model(cfg, tr.seed),
        b(tr.micro_batch_size),
        t(tr.seq_len),
        n(tr.micro_batch_size * tr.seq_len),
        nk(tr.micro_batch_size * tr.seq_len * m.top_k) {
    scaler.enabled = m.compute_dtype == dtype::f16;
    scaler.scale = scaler.enabled ? tr.loss_scale : 1.0f;
    scaler.window = tr.loss_scale_window;
    for (auto& op : model.ops()) {
      device_operator d;
      const auto numel = std::size_t(op.numel());
      d.offsets.push_back(0);
      for (std::size_t p = 0; p < op.param_count(); ++p) {
        std::int64_t k = 1;
        for (const auto s : op.param(p).shape) k *= s;
        d.offsets.push_back(d.offsets.back() + k);
      }
      d.master = make(ctx, numel);
      d.m = make(ctx, numel);
      d.v = make(ctx, numel);
      d.grad = make(ctx, numel);
      d.weights = make(ctx, numel);
      copy_to_device(ctx, d.master->data(), op.master().data(), numel * sizeof(float));
      copy_to_device(ctx, d.m->data(), op.adam_m().data(), numel * sizeof(float));
      copy_to_device(ctx, d.v->data(), op.adam_v().data(), numel * sizeof(float));
      round_to_compute(ctx, d.weights->data(), d.master->data(), long(numel), op.compute_dtype());
      ops.push_back(std::move(d));
    }
    const std::size_t c = cfg.d_model, f = cfg.d_ff, e = cfg.experts, v = cfg.vocab;
    const std::size_t nc = std::size_t(n) * c, rows = std::size_t(nk);
    layers.resize(cfg.layers);
    for (auto& l : layers) {
      l.x = make(ctx, nc);
      l.n1 = make(ctx, nc);
      l.rstd1 = make(ctx, n);
      l.qkv = make(ctx, 3 * nc);
      l.att = make(ctx, std::size_t(b) * cfg.heads * t * t);
      l.yatt = make(ctx, nc);
      l.h = make(ctx, nc);
      l.n2 = make(ctx, nc);
      l.rstd2 = make(ctx, n);
      l.glogits = make(ctx, std::size_t(n) * e);
      l.xs = make(ctx, rows * c);
      l.hpre = make(ctx, rows * f);
      l.act = make(ctx, rows * f);
      l.ye = make(ctx, rows * c);
    }
    tokens = std::make_unique<device_array<std::int32_t>>(ctx, n);
    targets = std::make_unique<device_array<std::int32_t>>(ctx, n);
    out = make(ctx, nc);
    nf = make(ctx, nc);
    rstdf = make(ctx, n);
    logits = make(ctx, std::size_t(n) * v);
    probs = make(ctx, std::size_t(n) * v);
    losses = make(ctx, n);
    const std::size_t wide = std::max(rows * f, nc);
    d_a = make(ctx, wide);
    d_b = make(ctx, wide);
    d_c = make(ctx, nc);
    d_h = make(ctx, nc);
    d_qkv = make(ctx, 3 * nc);
    d_att = make(ctx, std::size_t(cfg.heads) * t * t);
    d_weight = make(ctx, std::size_t(n) * cfg.top_k);
    d_logits = make(ctx, std::size_t(n) * e);
    d_ye = make(ctx, rows * c);
    d_xs = make(ctx, rows * c);
    d_cur = make(ctx, nc);
    d_next = make(ctx, nc);
    d_head = make(ctx, std::size_t(n) * v);
    d_nf = make(ctx, nc);
    sq = std::make_unique<device_array<double>>(ctx, ops.size());
    host_losses.resize(n);
    ctx.synchronize();
  }

  device_operator& dop(std::size_t i) { return ops[i]; }

  // stage::layer_forward on the device; `res` receives the layer output [N,C].
  void layer_forward(int l, float* res, bool training) {
    layer_cache& c = layers[l];
    const int ch = cfg.d_model, f = cfg.d_ff, e = cfg.experts;
    auto& norm1 = dop(model.norm1(l));
    auto& attn = dop(model.attention(l));
    auto& norm2 = dop(model.norm2(l));
    auto& gate = dop(model.gate(l));
    const long nc = long(n) * ch;
    rmsnorm_forward(ctx, c.n1->data(), c.rstd1->data(), c.x->data(), norm1.weight(0), n, ch);
    matmul_forward(ctx, c.qkv->data(), c.n1->data(), attn.weight(0), n, ch, 3 * ch);
    attention_forward(ctx, c.yatt->data(), c.att->data(), c.qkv->data(), b, t, ch, cfg.heads);
    matmul_forward(ctx, c.h->data(), c.yatt->data(), attn.weight(1), n, ch, ch);
    add(ctx, c.h->data(), c.x->data(), c.h->data(), nc);
    rmsnorm_forward(ctx, c.n2->data(), c.rstd2->data(), c.h->data(), norm2.weight(0), n, ch);
    matmul_forward(ctx, c.glogits->data(), c.n2->data(), gate.weight(0), n, ch, e);
    gate_forward(ctx, c.route, c.glogits->data(), n, e, cfg.top_k, cfg.capacity_factor);
    const cpu::routing& r = c.route.host;
    if (training) {
      auto& host_gate = model.ops()[model.gate(l)];
      for (int j = 0; j < e; ++j) {
        host_gate.routed_tokens()[j] += r.routed[j];
        double s = 0.0;
        for (int i = 0; i < n; ++i) s += r.probs[std::size_t(i) * e + j];
        host_gate.prob_sums()[j] += s;
      }
    }
    moe_gather(ctx, c.xs->data(), c.n2->data(), c.route, ch);
    for (int j = 0; j < e; ++j) {
      auto& ex = dop(model.expert(l, j));
      const int r0 = r.offsets[j], rj = r.offsets[j + 1] - r0;
      if (rj == 0) continue;
      float* hp = c.hpre->data() + std::size_t(r0) * f;
      matmul_forward(ctx, hp, c.xs->data() + std::size_t(r0) * ch, ex.weight(0), rj, ch, f);
      gelu_forward(ctx, c.act->data() + std::size_t(r0) * f, hp, rj * f);
      matmul_forward(ctx, c.ye->data() + std::size_t(r0) * ch,
                     c.act->data() + std::size_t(r0) * f, ex.weight(1), rj, f, ch);
    }
    moe_combine_forward(ctx, res, c.ye->data(), c.route, ch);
    add(ctx, res, c.h->data(), res, nc);
  }

  // stage::layer_backward on the device.
  void layer_backward(int l, const float* dout, float* dx, float loss_grad) {
    layer_cache& c = layers[l];
    const int ch = cfg.d_model, f = cfg.d_ff, e = cfg.experts;
    auto& norm1 = dop(model.norm1(l));
    auto& attn = dop(model.attention(l));
    auto& norm2 = dop(model.norm2(l));
    auto& gate = dop(model.gate(l));
    const long nc = long(n) * ch;
    const cpu::routing& r = c.route.host;
    moe_combine_backward(ctx, d_ye->data(), d_weight->data(), dout, c.ye->data(), c.route, ch);
    for (int j = 0; j < e; ++j) {
      auto& ex = dop(model.expert(l, j));
      const int r0 = r.offsets[j], rj = r.offsets[j + 1] - r0;
      if (rj == 0) continue;
      matmul_backward(ctx, d_a->data(), ex.grad_of(1), d_ye->data() + std::size_t(r0) * ch,
                      c.act->data() + std::size_t(r0) * f, ex.weight(1), rj, f, ch);
      gelu_backward(ctx, d_b->data(), d_a->data(), c.hpre->data() + std::size_t(r0) * f, rj * f);
      matmul_backward(ctx, d_xs->data() + std::size_t(r0) * ch, ex.grad_of(0), d_b->data(),
                      c.xs->data() + std::size_t(r0) * ch, ex.weight(0), rj, ch, f);
    }
    gate_backward(ctx, d_logits->data(), c.route, d_weight->data(),
                  cfg.aux_loss_coef * loss_grad);
    matmul_backward(ctx, d_c->data(), gate.grad_of(0), d_logits->data(), c.n2->data(),
                    gate.weight(0), n, ch, e);
    moe_scatter_add(ctx, d_c->data(), d_xs->data(), c.route, ch);
    rmsnorm_backward(ctx, d_a->data(), norm2.grad_of(0), d_c->data(), c.h->data(), norm2.weight(0),
                     c.rstd2->data(), n, ch);
    add(ctx, d_h->data(), dout, d_a->data(), nc);
    matmul_backward(ctx, d_c->data(), attn.grad_of(1), d_h->data(), c.yatt->data(), attn.weight(1),
                    n, ch, ch);
    attention_backward(ctx, d_qkv->data(), d_att->data(), d_c->data(), c.att->data(),
                       c.qkv->data(), b, t, ch, cfg.heads);
    matmul_backward(ctx, d_b->data(), attn.grad_of(0), d_qkv->data(), c.n1->data(),
                    attn.weight(0), n, ch, 3 * ch);
    rmsnorm_backward(ctx, d_a->data(), norm1.grad_of(0), d_b->data(), c.x->data(),
                     norm1.weight(0), c.rstd1->data(), n, ch);
    add(ctx, dx, d_h->data(), d_a->data(), nc);
  }

  // stage::forward over all layers; returns the mean loss and adds the layers' aux losses.
  double forward(const std::vector<std::int32_t>& tok, const std::vector<std::int32_t>& tgt,
                 bool training, double& aux) {
    const int ch = cfg.d_model, v = cfg.vocab;
    copy_to_device(ctx, tokens->data(), tok.data(), tok.size() * sizeof(std::int32_t));
    copy_to_device(ctx, targets->data(), tgt.data(), tgt.size() * sizeof(std::int32_t));
    auto& emb = dop(model.embedding());
    embedding_forward(ctx, layers[0].x->data(), tokens->data(), emb.weight(0), emb.weight(1), b, t,
                      ch);
    for (int l = 0; l < cfg.layers; ++l) {
      float* res = l + 1 < cfg.layers ? layers[l + 1].x->data() : out->data();
      layer_forward(l, res, training);
      aux += layers[l].route.host.aux_loss;
    }
    auto& fnorm = dop(model.final_norm());
    auto& head = dop(model.head());
    rmsnorm_forward(ctx, nf->data(), rstdf->data(), out->data(), fnorm.weight(0), n, ch);
    matmul_forward(ctx, logits->data(), nf->data(), head.weight(0), n, ch, v);
    softmax_xent_forward(ctx, losses->data(), probs->data(), logits->data(), targets->data(), n, v);
    copy_to_host(ctx, host_losses.data(), losses->data(), host_losses.size() * sizeof(float));
    double sum = 0.0;
    for (const float x : host_losses) sum += x;
    return sum / n;
  }

  // stage::backward over all layers, after forward(training = true).
  void backward(float loss_grad) {
    const int ch = cfg.d_model, v = cfg.vocab;
    auto& fnorm = dop(model.final_norm());
    auto& head = dop(model.head());
    softmax_xent_backward(ctx, d_head->data(), probs->data(), targets->data(),
                          loss_grad / float(n), n, v);
    matmul_backward(ctx, d_nf->data(), head.grad_of(0), d_head->data(), nf->data(),
                    head.weight(0), n, ch, v);
    float* cur = d_cur->data();
    float* next = d_next->data();
    rmsnorm_backward(ctx, cur, fnorm.grad_of(0), d_nf->data(), out->data(), fnorm.weight(0),
                     rstdf->data(), n, ch);
    for (int l = cfg.layers - 1; l >= 0; --l) {
      layer_backward(l, cur, next, loss_grad);
      std::swap(cur, next);
    }
    auto& emb = dop(model.embedding());
    embedding_backward(ctx, emb.grad_of(0), emb.grad_of(1), cur, tokens->data(), b, t, ch);
  }
};

trainer::trainer(const model_config& model, const train_config& train) {
  validate(model, train);
  if (device_count() == 0) {
    throw config_error("train.device", "'cuda' but no GPU is usable here (" + describe_device() +
                                           "); set train.device = \"cpu\"");
  }
  impl_ = std::make_unique<impl>(model, train);
}

trainer::~trainer() = default;

iteration_stats trainer::train_iteration() {
  impl& s = *impl_;
  const int m = s.train.micro_batches, dp = s.train.data_parallel;
  std::vector<std::int32_t> tokens(std::size_t(s.n)), targets(std::size_t(s.n));
  for (auto& op : s.model.ops()) op.reset_popularity();
  iteration_stats st;
  st.iteration = s.iteration;
  st.loss_scale = s.scaler.scale;
  const float loss_grad = s.scaler.scale / float(m * dp);
  const std::size_t nops = s.ops.size();
  if (dp > 1 && s.replica_sum.empty()) {
    for (std::size_t i = 0; i < nops; ++i) s.replica_sum.push_back(make(s.ctx, s.ops[i].grad->size()));
  }
  for (int d = 0; d < dp; ++d) {
    for (auto& op : s.ops) fill_zero(s.ctx, op.grad->data(), op.grad->size() * sizeof(float));
    for (int mb = 0; mb < m; ++mb) {
      fill_batch(s.data, split::train, s.train.seed, s.iteration, d, mb, s.b, s.t, tokens.data(),
                 targets.data());
      st.loss += s.forward(tokens, targets, true, st.aux_loss);
      s.backward(loss_grad);
    }
    if (dp == 1) break;
    for (std::size_t i = 0; i < nops; ++i) {  // left fold in replica order, as the CPU trainer
      auto& sum = *s.replica_sum[i];
      const auto& g = *s.ops[i].grad;
      if (d == 0) {
        copy_on_device(s.ctx, sum.data(), g.data(), g.size() * sizeof(float));
      } else {
        add(s.ctx, sum.data(), sum.data(), g.data(), long(g.size()));
      }
    }
  }
  if (dp > 1) {
    for (std::size_t i = 0; i < nops; ++i) {
      copy_on_device(s.ctx, s.ops[i].grad->data(), s.replica_sum[i]->data(),
                     s.ops[i].grad->size() * sizeof(float));
    }
  }
  st.loss /= m * dp;
  st.aux_loss /= m * dp;
  for (std::size_t i = 0; i < nops; ++i) {
    sum_squares(s.ctx, s.sq->data() + i, s.ops[i].grad->data(), long(s.ops[i].grad->size()));
  }
  const std::vector<double> sq = s.sq->download();
  const step_plan plan = plan_step(sq, s.scaler, s.train.grad_clip);
  st.applied = plan.apply;
  st.grad_norm = plan.grad_norm;
  if (plan.apply) {
    const auto& tr = s.train;
    for (std::size_t i = 0; i < nops; ++i) {
      auto& host = s.model.ops()[i];
      auto& d = s.ops[i];
      const std::int64_t step = host.step() + 1;
      // operator_state::adamw_step's bias corrections: fp64, one rounding to fp32
      adamw_scalars a{tr.lr,
                      tr.beta1,
                      tr.beta2,
                      tr.eps,
                      0.0f,
                      static_cast<float>(1.0 - std::pow(double(tr.beta1), double(step))),
                      static_cast<float>(1.0 - std::pow(double(tr.beta2), double(step))),
                      plan.grad_mul};
      for (std::size_t p = 0; p < host.param_count(); ++p) {
        a.weight_decay = host.param(p).decay ? tr.weight_decay : 0.0f;
        const long off = long(d.offsets[p]), len = long(d.offsets[p + 1] - d.offsets[p]);
        adamw_step(s.ctx, d.master->data() + off, d.m->data() + off, d.v->data() + off,
                   d.grad->data() + off, len, a);
      }
      round_to_compute(s.ctx, d.weights->data(), d.master->data(), long(d.master->size()),
                       host.compute_dtype());
      host.set_step(step);
    }
  }
  ++s.iteration;
  return st;
}

double trainer::validation_loss() {
  impl& s = *impl_;
  std::vector<std::int32_t> tokens(std::size_t(s.n)), targets(std::size_t(s.n));
  double sum = 0.0, aux = 0.0;
  for (int i = 0; i < s.train.val_batches; ++i) {
    fill_batch(s.data, split::val, s.train.seed, i, 0, 0, s.b, s.t, tokens.data(),
               targets.data());
    sum += s.forward(tokens, targets, false, aux);
  }
  return s.train.val_batches > 0 ? sum / s.train.val_batches : 0.0;
}

void trainer::sync_to_host() {
  impl& s = *impl_;
  for (std::size_t i = 0; i < s.ops.size(); ++i) {
    auto& host = s.model.ops()[i];
    auto& d = s.ops[i];
    const std::size_t bytes = d.master->size() * sizeof(float);
    copy_to_host(s.ctx, host.master().data(), d.master->data(), bytes);
    copy_to_host(s.ctx, host.adam_m().data(), d.m->data(), bytes);
    copy_to_host(s.ctx, host.adam_v().data(), d.v->data(), bytes);
    host.refresh_compute();
  }
}

std::uint64_t trainer::state_hash() {
  sync_to_host();
  return models::state_hash(impl_->model.op_digests(), impl_->scaler);
}

moe_model& trainer::model() {
  return impl_->model;
}

std::int64_t trainer::tokens_per_iteration() const {
  const auto& t = impl_->train;
  return std::int64_t(t.micro_batches) * t.micro_batch_size * t.seq_len * t.data_parallel;
}

}  // namespace moevement::models::cuda
