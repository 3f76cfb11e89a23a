#include "models/cuda/trainer.hpp"

#include <stdexcept>
#include <vector>

#include "models/cuda/device.hpp"
#include "models/cuda/kernels.hpp"
#include "models/cuda/stage.hpp"
#include "models/data.hpp"

namespace moevement::models::cuda {
namespace {

using buffer = float_buffer;

// An operator's optimizer state on the device; its compute weights and gradient are the
// stage's, its step is kept by the host operator_state.
struct optimizer_state {
  buffer master, m, v;  // [numel] each
};

}  // namespace

struct trainer::impl {
  model_config cfg;
  train_config train;
  corpus data;
  moe_model model;
  context ctx;
  stage body;  // every layer, the embedding and the head
  loss_scaler scaler;
  std::int64_t iteration = 0;
  std::vector<optimizer_state> ops;
  std::vector<buffer> replica_sum;           // [ops][numel], only when data_parallel > 1
  std::unique_ptr<device_array<double>> sq;  // [ops]
  std::vector<const float*> grad_ptrs;
  std::vector<long> grad_sizes;

  impl(const model_config& m, const train_config& tr)
      : cfg(m),
        train(tr),
        data(corpus::load(tr.corpus, tr.val_fraction, tr.seq_len)),
        model(cfg, tr.seed),
        body(ctx, model, partition(cfg, 1)[0], tr.micro_batch_size, tr.seq_len) {
    scaler.enabled = m.compute_dtype == dtype::f16;
    scaler.scale = scaler.enabled ? tr.loss_scale : 1.0f;
    scaler.window = tr.loss_scale_window;
    for (std::size_t i = 0; i < model.ops().size(); ++i) {
      const auto& op = model.ops()[i];
      const auto numel = std::size_t(op.numel());
      optimizer_state d;
      d.master = make_float_buffer(ctx, numel);
      d.m = make_float_buffer(ctx, numel);
      d.v = make_float_buffer(ctx, numel);
      copy_to_device(ctx, d.master->data(), op.master().data(), numel * sizeof(float));
      copy_to_device(ctx, d.m->data(), op.adam_m().data(), numel * sizeof(float));
      copy_to_device(ctx, d.v->data(), op.adam_v().data(), numel * sizeof(float));
      ops.push_back(std::move(d));
      grad_ptrs.push_back(body.grads(i));
      grad_sizes.push_back(long(numel));
    }
    sq = std::make_unique<device_array<double>>(ctx, ops.size());
    ctx.synchronize();
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
  const int n = s.body.tokens();
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n)), targets(tokens.size());
  for (auto& op : s.model.ops()) op.reset_popularity();
  iteration_stats st;
  st.iteration = s.iteration;
  st.loss_scale = s.scaler.scale;
  const float loss_grad = s.scaler.scale / float(m * dp);
  const std::size_t nops = s.ops.size();
  if (dp > 1 && s.replica_sum.empty()) {
    for (std::size_t i = 0; i < nops; ++i)
      s.replica_sum.push_back(make_float_buffer(s.ctx, s.grad_sizes[i]));
  }
  for (int d = 0; d < dp; ++d) {
    s.body.zero_grads();
    for (int mb = 0; mb < m; ++mb) {
      fill_batch(s.data, split::train, s.train.seed, s.iteration, d, mb, s.train.micro_batch_size,
                 s.train.seq_len, tokens.data(), targets.data());
      const auto fr = s.body.forward(mb, tokens.data(), nullptr, targets.data());
      st.loss += fr.loss;
      st.aux_loss += fr.aux_loss;
      s.body.backward(mb, nullptr, loss_grad);
    }
    if (dp == 1) break;
    for (std::size_t i = 0; i < nops; ++i) {  // left fold in replica order, as the CPU trainer
      float* sum = s.replica_sum[i]->data();
      if (d == 0) {
        copy_on_device(s.ctx, sum, s.body.grads(i), std::size_t(s.grad_sizes[i]) * sizeof(float));
      } else {
        add(s.ctx, sum, sum, s.body.grads(i), s.grad_sizes[i]);
      }
    }
  }
  if (dp > 1) {
    for (std::size_t i = 0; i < nops; ++i) {
      copy_on_device(s.ctx, s.body.grads(i), s.replica_sum[i]->data(),
                     std::size_t(s.grad_sizes[i]) * sizeof(float));
    }
  }
  st.loss /= m * dp;
  st.aux_loss /= m * dp;
  sum_squares(s.ctx, s.sq->data(), s.grad_ptrs, s.grad_sizes);
  const std::vector<double> sq = s.sq->download();
  const step_plan plan = plan_step(sq, s.scaler, s.train.grad_clip);
  st.applied = plan.apply;
  st.grad_norm = plan.grad_norm;
  if (plan.apply) {
    const auto& tr = s.train;
    const adamw_config cfg{tr.lr, tr.beta1, tr.beta2, tr.eps, tr.weight_decay};
    for (std::size_t i = 0; i < nops; ++i) {
      auto& d = s.ops[i];
      step_operator(s.ctx, s.model.ops()[i], d.master->data(), d.m->data(), d.v->data(),
                    s.body.grads(i), s.body.weights(i), cfg, plan.grad_mul);
    }
  }
  ++s.iteration;
  return st;
}

double trainer::validation_loss() {
  impl& s = *impl_;
  const int n = s.body.tokens();
  std::vector<std::int32_t> tokens(static_cast<std::size_t>(n)), targets(tokens.size());
  double sum = 0.0;
  for (int i = 0; i < s.train.val_batches; ++i) {
    fill_batch(s.data, split::val, s.train.seed, i, 0, 0, s.train.micro_batch_size, s.train.seq_len,
               tokens.data(), targets.data());
    sum += s.body.forward(-1, tokens.data(), nullptr, targets.data(), /*training=*/false).loss;
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
