// Single-process training (what `moevement train` runs, and the reference the engine must
// match bit for bit): one stage over all layers, micro-batches 0..M-1 forward then backward in
// order, one AdamW step per iteration.
//
// With data_parallel = D > 1, replica d (in order 0..D-1) accumulates the gradients of its own
// M micro-batches from zero, with loss_grad = loss_scale / (M * D); the iteration's gradient is
// then the left fold g_0 + g_1 + ... + g_{D-1}, elementwise in replica order. A distributed
// all-reduce must sum in that order to match bit for bit (with D = 2 any order matches).
#pragma once

#include <cstdint>
#include <memory>

#include "models/config.hpp"
#include "models/data.hpp"
#include "models/model.hpp"

namespace moevement::models {

struct iteration_stats {
  std::int64_t iteration = 0;
  double loss = 0.0;      // mean cross-entropy over the micro-batches (nats per byte)
  double aux_loss = 0.0;  // mean over micro-batches of the summed load-balancing losses
  double grad_norm = 0.0;
  bool applied = true;  // false: fp16 overflow, step skipped
  float loss_scale = 1.0f;
};

class trainer {
 public:
  // Validates the config, loads the corpus, builds and initialises the model.
  trainer(const model_config& model, const train_config& train);

  iteration_stats train_iteration();
  // Mean cross-entropy over train.val_batches fixed validation micro-batches.
  double validation_loss();
  std::uint64_t state_hash() const;

  moe_model& model() { return model_; }
  // Resume: after restoring every operator's master, m, v and step (and refresh_compute()),
  // set the data position and loss scaler; nothing else is training state.
  void set_position(std::int64_t iteration, const loss_scaler& scaler) {
    iteration_ = iteration;
    scaler_ = scaler;
  }
  const loss_scaler& scaler() const { return scaler_; }
  std::int64_t iteration() const { return iteration_; }
  std::int64_t tokens_per_iteration() const {
    return std::int64_t(train_.micro_batches) * train_.micro_batch_size * train_.seq_len *
           train_.data_parallel;
  }

 private:
  model_config model_cfg_;
  train_config train_;
  corpus corpus_;
  moe_model model_;
  stage stage_;
  loss_scaler scaler_;
  std::int64_t iteration_ = 0;
  std::vector<std::vector<float>> replica_sum_;  // [ops][numel], only when data_parallel > 1
};

}  // namespace moevement::models
