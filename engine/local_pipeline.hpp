// The whole engine protocol in one thread: P stages x D replicas of stage_models, driven
// exactly as the distributed engine drives them (1F1B per stage, boundary tensors copied as the
// network would, the gradient all-reduce as a left fold in replica order, per-operator squared
// sums gathered in canonical order, one step plan for all). It is the reference the actor
// engine is tested against and what the replay tests record from; see docs/engine.md.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "engine/hooks.hpp"
#include "engine/local_group.hpp"
#include "engine/stage_registry.hpp"
#include "models/trainer.hpp"

namespace moevement::engine {

class local_pipeline {
 public:
  // Builds stages x train.data_parallel stage models with `factory` (make_moe_stage by
  // default). Throws config_error for a bad setup (naming the key).
  local_pipeline(const models::model_config& model, const models::train_config& train, int stages,
                 const stage_factory& factory = make_moe_stage);

  // Hooks of one (stage, replica); not owned, must outlive the pipeline's use. nullptr: none.
  void set_hooks(int stage, int replica, stage_hooks* hooks);

  // One iteration: forwards and backwards of every micro-batch on every replica, the
  // all-reduce, the step. Stats as models::trainer reports them.
  models::iteration_stats train_iteration();
  // Mean validation loss over train.val_batches batches through replica 0's stages.
  double validation_loss();
  // models::state_hash over replica 0's operator digests in stage order and the loss scaler.
  std::uint64_t state_hash();

  // The step plan of the last iteration (what a replay applies).
  const models::step_plan& last_plan() const { return plan_; }
  float last_loss_grad() const { return loss_grad_; }
  const models::loss_scaler& scaler() const { return scaler_; }
  std::int64_t iteration() const { return iteration_; }
  // Resume: after restoring every stage's operators, the data position and the loss scaler.
  void set_position(std::int64_t iteration, const models::loss_scaler& scaler) {
    iteration_ = iteration;
    scaler_ = scaler;
  }
  int stages() const { return stages_; }
  int replicas() const { return replicas_; }
  stage_model& stage(int stage, int replica);

 private:
  struct slot {
    std::unique_ptr<stage_model> model;
    std::vector<models::operator_state*> ops;
    stage_hooks* hooks = nullptr;
  };
  slot& at(int stage, int replica) {
    return slots_[std::size_t(replica) * std::size_t(stages_) + std::size_t(stage)];
  }
  // Runs every stage's 1F1B steps of one replica, in an order where inputs exist; fills
  // losses[mb] and aux[mb] (summed over stages in stage order).
  void run_replica(int replica, std::vector<double>& losses, std::vector<double>& aux);
  // Stage s's operators in canonical order (from replica 0, or EP group 0's ranks).
  std::vector<models::operator_state*> canonical_ops(int stage);

  models::train_config train_;
  int stages_, replicas_, ep_;
  std::vector<slot> slots_;  // [replica][stage]
  // [stage]: its replicas' EP groups and all-reduce (declared after slots_: destroyed first)
  std::vector<std::unique_ptr<local_group>> groups_;
  models::loss_scaler scaler_;
  models::step_plan plan_;
  float loss_grad_ = 0.0f;
  std::int64_t iteration_ = 0;
};

}  // namespace moevement::engine
