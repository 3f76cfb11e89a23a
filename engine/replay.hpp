// Replay mode (recovery): run one replica of one stage for one iteration from supplied
// boundary inputs, with operators in whatever mode the caller set. A frozen operator
// (operator_state::set_mode(frozen) + set_compute_bytes from a snapshot) computes with its
// snapshot weights and produces no weight gradient; active operators accumulate their weight
// gradients exactly as in training. The caller then reduces the gradients and applies the
// logged step plan (apply_step). The outputs let the caller check against its logs.
#pragma once

#include <cstdint>
#include <vector>

#include "engine/stage_model.hpp"

namespace moevement::engine {

struct replay_inputs {
  int stage = 0, stages = 1;  // where the stage sits (its 1F1B order)
  int micro_batches = 1;
  // [micro_batch][B*T*C]: the activation received from upstream (none on the first stage:
  // leave the outer vector empty) and the gradient received from downstream (none on the last).
  std::vector<std::vector<float>> activations, gradients;
};

struct replay_outputs {
  // [micro_batch]: activations sent downstream (empty vectors on the last stage), gradients
  // sent upstream (empty on the first), losses (last stage) and aux losses of this stage.
  std::vector<std::vector<float>> activations, gradients;
  std::vector<double> losses, aux_losses;
};

// Zeroes gradients and popularity (begin_operators), begin_iteration(iteration), then runs
// one_f_one_b(stage, stages, micro_batches) with loss_grad. Throws std::invalid_argument
// when the inputs do not fit the stage. Weight gradients stay in the operators.
replay_outputs replay_iteration(stage_model& stage, std::int64_t iteration, float loss_grad,
                                const replay_inputs& inputs);

}  // namespace moevement::engine
