#include "engine/local_pipeline.hpp"

#include <optional>
#include <stdexcept>
#include <string>

#include "engine/schedule.hpp"

namespace moevement::engine {

local_pipeline::local_pipeline(const models::model_config& model, const models::train_config& train,
                               int stages, const stage_factory& factory)
    : train_(train), stages_(stages), replicas_(train.data_parallel), ep_(train.expert_parallel) {
  if (stages < 1) throw models::config_error("parallel.pp", "must be >= 1");
  if (replicas_ < 1) throw models::config_error("parallel.dp", "must be >= 1");
  slots_.resize(std::size_t(stages_) * std::size_t(replicas_));
  for (int d = 0; d < replicas_; ++d) {
    for (int s = 0; s < stages_; ++s) {
      stage_setup setup{model, train, s, stages_, d, replicas_};
      slot& sl = at(s, d);
      sl.model = factory(setup);
      sl.ops = sl.model->operators();
    }
  }
  for (int s = 0; s < stages_; ++s) {
    std::vector<stage_model*> replicas;
    for (int d = 0; d < replicas_; ++d) replicas.push_back(at(s, d).model.get());
    groups_.push_back(std::make_unique<local_group>(replicas, ep_));
  }
  // as models::trainer initialises it
  scaler_.enabled = model.compute_dtype == models::dtype::f16;
  scaler_.scale = scaler_.enabled ? train.loss_scale : 1.0f;
  scaler_.window = train.loss_scale_window;
}

void local_pipeline::set_hooks(int stage, int replica, stage_hooks* hooks) {
  local_pipeline::stage(stage, replica);  // range check
  at(stage, replica).hooks = hooks;
}

stage_model& local_pipeline::stage(int stage, int replica) {
  if (stage < 0 || stage >= stages_ || replica < 0 || replica >= replicas_) {
    throw std::out_of_range("local_pipeline: no stage " + std::to_string(stage) + " replica " +
                            std::to_string(replica));
  }
  return *at(stage, replica).model;
}

void local_pipeline::run_replica(int replica, std::vector<double>& losses,
                                 std::vector<double>& aux) {
  const int m = train_.micro_batches;
  // act[s][mb]: what stage s sent downstream; grad[s][mb]: what stage s sent upstream.
  using inbox = std::vector<std::optional<std::vector<float>>>;  // [mb]: received or not
  const auto p = std::size_t(stages_);
  std::vector<inbox> act(p), grad(p);
  std::vector<std::vector<pipeline_step>> steps(p);
  std::vector<std::size_t> next(std::size_t(stages_), 0);
  std::vector<std::vector<double>> stage_aux(std::size_t(stages_),
                                             std::vector<double>(std::size_t(m), 0.0));
  for (int s = 0; s < stages_; ++s) {
    act[std::size_t(s)].resize(std::size_t(m));
    grad[std::size_t(s)].resize(std::size_t(m));
    steps[std::size_t(s)] = one_f_one_b(s, stages_, m);
  }
  std::size_t remaining = std::size_t(stages_) * std::size_t(m) * 2;
  while (remaining > 0) {
    bool progressed = false;
    for (int s = 0; s < stages_; ++s) {
      const auto si = std::size_t(s);
      slot& sl = at(s, replica);
      // run this stage's steps as long as their inputs are there
      while (next[si] < steps[si].size()) {
        const pipeline_step st = steps[si][next[si]];
        const auto mb = std::size_t(st.micro_batch);
        if (st.what == pass::forward) {
          std::span<const float> x_in;
          if (s > 0) {
            if (!act[si - 1][mb]) break;  // not received yet
            x_in = *act[si - 1][mb];
          }
          const stage_output out = sl.model->forward(st.micro_batch, x_in);
          if (s > 0) act[si - 1][mb].reset();  // consumed
          stage_aux[si][mb] = out.aux_loss;
          if (s + 1 < stages_) {
            act[si][mb].emplace(out.activation.begin(), out.activation.end());
            if (sl.hooks) {
              sl.hooks->on_boundary_send(iteration_, st.micro_batch, boundary::activation,
                                         out.activation);
              sl.hooks->settle_sends();  // the model's output buffer: the next forward's
            }
          } else {
            losses[mb] = out.loss;
          }
        } else {
          std::span<const float> g_out;
          if (s + 1 < stages_) {
            if (!grad[si + 1][mb]) break;
            g_out = *grad[si + 1][mb];
          }
          const auto g_in = sl.model->backward(st.micro_batch, g_out, loss_grad_);
          if (s + 1 < stages_) grad[si + 1][mb].reset();
          if (s > 0) {
            grad[si][mb].emplace(g_in.begin(), g_in.end());
            if (sl.hooks) {
              sl.hooks->on_boundary_send(iteration_, st.micro_batch, boundary::gradient, g_in);
              sl.hooks->settle_sends();
            }
          }
        }
        ++next[si];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) throw std::logic_error("local_pipeline: the 1F1B schedules deadlocked");
  }
  for (std::size_t mb = 0; mb < std::size_t(m); ++mb) {
    double a = 0.0;
    for (std::size_t s = 0; s < std::size_t(stages_); ++s) a += stage_aux[s][mb];
    aux[mb] = a;
  }
}

std::vector<models::operator_state*> local_pipeline::canonical_ops(int stage) {
  if (ep_ == 1) return at(stage, 0).ops;
  std::vector<std::vector<models::op_kind>> kinds;
  for (int k = 0; k < ep_; ++k) kinds.push_back(operator_kinds(at(stage, k).ops));
  std::vector<models::operator_state*> out;
  for (const auto& a : canonical_order(kinds)) out.push_back(at(stage, a.rank).ops[a.index]);
  return out;
}

models::iteration_stats local_pipeline::train_iteration() {
  const int m = train_.micro_batches;
  models::iteration_stats st;
  st.iteration = iteration_;
  st.loss_scale = scaler_.scale;
  loss_grad_ = scaler_.scale / float(m * replicas_);
  for (auto& sl : slots_) {
    begin_operators(sl.ops);
    sl.model->begin_iteration(iteration_);
  }
  const auto mbs = std::size_t(m);
  std::vector<double> losses(mbs), aux(mbs);
  for (int d = 0; d < replicas_; ++d) {
    run_replica(d, losses, aux);
    // the trainer's order: replica-major, micro-batch-minor
    for (std::size_t mb = 0; mb < std::size_t(m); ++mb) {
      st.loss += losses[mb];
      st.aux_loss += aux[mb];
    }
  }
  st.loss /= m * replicas_;
  st.aux_loss /= m * replicas_;
  if (replicas_ > 1) {
    for (auto& g : groups_) g->all_reduce();
  }
  std::vector<double> sq;
  for (int s = 0; s < stages_; ++s) {
    const auto part = gradient_sq_sums(canonical_ops(s));
    sq.insert(sq.end(), part.begin(), part.end());
  }
  plan_ = models::plan_step(sq, scaler_, train_.grad_clip);
  st.applied = plan_.apply;
  st.grad_norm = plan_.grad_norm;
  for (auto& sl : slots_) {
    if (sl.hooks) sl.hooks->on_step(iteration_, loss_grad_, plan_);
    apply_step(sl.ops, plan_, train_);
  }
  for (int d = 0; d < replicas_; ++d) {
    for (int s = 0; s < stages_; ++s) {
      slot& sl = at(s, d);
      if (sl.hooks) sl.hooks->after_step(iteration_, sl.ops);
    }
  }
  ++iteration_;
  return st;
}

double local_pipeline::validation_loss() {
  double sum = 0.0;
  std::vector<float> x;
  for (int i = 0; i < train_.val_batches; ++i) {
    x.clear();
    for (int s = 0; s < stages_; ++s) {
      const stage_output out = at(s, 0).model->validate(i, x);
      if (s + 1 < stages_) {
        x.assign(out.activation.begin(), out.activation.end());
      } else {
        sum += out.loss;
      }
    }
  }
  return train_.val_batches > 0 ? sum / train_.val_batches : 0.0;
}

std::uint64_t local_pipeline::state_hash() {
  std::vector<std::uint64_t> digests;
  for (int s = 0; s < stages_; ++s) {
    const auto part = operator_digests(canonical_ops(s));
    digests.insert(digests.end(), part.begin(), part.end());
  }
  return models::state_hash(digests, scaler_);
}

}  // namespace moevement::engine
