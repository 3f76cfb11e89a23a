#include "models/trainer.hpp"

#include <algorithm>
#include <vector>

#include "models/cpu/gemm.hpp"

namespace moevement::models {

namespace {
const model_config& checked(const model_config& m, const train_config& t) {
  validate(m, t);
  return m;
}
}  // namespace

trainer::trainer(const model_config& model, const train_config& train)
    : model_cfg_(checked(model, train)),
      train_(train),
      corpus_(corpus::load(train.corpus, train.val_fraction, train.seq_len)),
      model_(model_cfg_, train.seed),
      stage_(model_, partition(model_cfg_, 1)[0], train.micro_batch_size, train.seq_len) {
  cpu::set_gemm_threads(train.blis_threads);
  scaler_.enabled = model.compute_dtype == dtype::f16;
  scaler_.scale = scaler_.enabled ? train.loss_scale : 1.0f;
  scaler_.window = train.loss_scale_window;
}

iteration_stats trainer::train_iteration() {
  const int b = train_.micro_batch_size, t = train_.seq_len, m = train_.micro_batches;
  const int dp = train_.data_parallel;
  std::vector<std::int32_t> tokens(std::size_t(b) * t), targets(std::size_t(b) * t);
  for (auto& op : model_.ops()) op.reset_popularity();
  iteration_stats st;
  st.iteration = iteration_;
  st.loss_scale = scaler_.scale;
  const float loss_grad = scaler_.scale / float(m * dp);
  auto& ops = model_.ops();
  if (dp > 1) replica_sum_.resize(ops.size());
  for (int d = 0; d < dp; ++d) {
    for (auto& op : ops) op.zero_grad();
    for (int mb = 0; mb < m; ++mb) {
      fill_batch(corpus_, split::train, train_.seed, iteration_, d, mb, b, t, tokens.data(),
                 targets.data());
      const auto fr = stage_.forward(mb, tokens.data(), nullptr, targets.data());
      st.loss += fr.loss;
      st.aux_loss += fr.aux_loss;
      stage_.backward(mb, nullptr, loss_grad);
    }
    if (dp == 1) break;
    for (std::size_t i = 0; i < ops.size(); ++i) {
      const auto g = ops[i].grad();
      auto& sum = replica_sum_[i];
      if (d == 0) {
        sum.assign(g.begin(), g.end());
      } else {
        for (std::size_t j = 0; j < sum.size(); ++j) sum[j] += g[j];
      }
    }
  }
  if (dp > 1) {
    for (std::size_t i = 0; i < ops.size(); ++i) {
      std::copy(replica_sum_[i].begin(), replica_sum_[i].end(), ops[i].grad().begin());
    }
  }
  st.loss /= m * dp;
  st.aux_loss /= m * dp;
  std::vector<double> sq;
  sq.reserve(model_.ops().size());
  for (const auto& op : model_.ops()) sq.push_back(op.grad_sq_sum());
  const step_plan plan = plan_step(sq, scaler_, train_.grad_clip);
  st.applied = plan.apply;
  st.grad_norm = plan.grad_norm;
  if (plan.apply) {
    const adamw_config cfg{train_.lr, train_.beta1, train_.beta2, train_.eps, train_.weight_decay};
    for (auto& op : model_.ops()) op.adamw_step(cfg, plan.grad_mul);
  }
  ++iteration_;
  return st;
}

double trainer::validation_loss() {
  const int b = train_.micro_batch_size, t = train_.seq_len;
  std::vector<std::int32_t> tokens(std::size_t(b) * t), targets(std::size_t(b) * t);
  double sum = 0.0;
  for (int i = 0; i < train_.val_batches; ++i) {
    fill_batch(corpus_, split::val, train_.seed, i, 0, 0, b, t, tokens.data(), targets.data());
    sum += stage_.forward(-1, tokens.data(), nullptr, targets.data(), /*training=*/false).loss;
  }
  return train_.val_batches > 0 ? sum / train_.val_batches : 0.0;
}

std::uint64_t trainer::state_hash() const {
  return models::state_hash(model_.op_digests(), scaler_);
}

}  // namespace moevement::models
