// Single-process training on one GPU (`moevement train --set train.device=cuda`): the CPU
// trainer's iteration (same batches, micro-batch order, loss scaler, clipping and AdamW
// arithmetic) with every operator's master, m, v, gradient and compute weights resident on the
// device. Routing is planned on the host (cpu::gate_forward), as in kernels.hpp.
//
// Determinism: run to run and across processes on the same GPU model and CUDA version, the
// state_hash is bitwise the same (one stream, fixed cuBLAS workspace, no atomics, fixed-order
// reductions). It is not the CPU's state_hash: cuBLAS and BLIS sum GEMMs in different orders.
// The optimizer alone is bitwise the CPU's (adamw_step, round_to_compute), so a state moved
// between the two continues on the same arithmetic.
#pragma once

#include <cstdint>
#include <memory>

#include "models/config.hpp"
#include "models/model.hpp"
#include "models/trainer.hpp"

namespace moevement::models::cuda {

class trainer {
 public:
  // Validates the config, loads the corpus, initialises the model on the host (the same
  // counter-based init as the CPU) and uploads it. Throws when no GPU is visible or the build
  // has no CUDA backend, saying which.
  trainer(const model_config& model, const train_config& train);
  ~trainer();
  trainer(const trainer&) = delete;
  trainer& operator=(const trainer&) = delete;

  iteration_stats train_iteration();
  double validation_loss();
  // Downloads master, m, v and step into model() and hashes them as models::state_hash does.
  std::uint64_t state_hash();
  // The host mirror, current after state_hash() or sync_to_host().
  moe_model& model();
  void sync_to_host();
  std::int64_t tokens_per_iteration() const;

 private:
  struct impl;
  std::unique_ptr<impl> impl_;
};

}  // namespace moevement::models::cuda
