// Replay mode (recovery): run one replica of one stage for one iteration from supplied
// boundary inputs, with operators in whatever mode the caller set. A frozen operator
// (operator_state::set_mode(frozen) + set_compute_bytes from a snapshot) computes with its
// snapshot weights and produces no weight gradient; active operators accumulate their weight
// gradients exactly as in training. The caller then reduces the gradients and applies the
// logged step plan (apply_step). The outputs let the caller check against its logs.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
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

// Joint replay of a region: one replica of stages inputs.stage .. inputs.stage + k - 1
// (region[0..k-1]) for one iteration, in one process. `inputs` holds the region's boundary:
// the activations the stage before it sent (none when it starts at stage 0) and the
// gradients the stage after it sent back (none when it ends at the last stage). Tensors
// between region stages pass in memory. Each stage runs its own 1F1B steps in their order
// (whichever stage can proceed does), so each computes exactly what it computed in the
// pipeline. Returns [k] outputs: what each stage sent (the internal ones included, for the
// stages' own logs). With k = 1 it is replay_iteration. begin = false: the caller began the
// iteration on the region's stages already (begin_operators, begin_iteration), as it must when
// replicas exchange expert rows: an owner's shard holds every source's gradients, and its own
// replica's begin_iteration would zero those of the replicas replayed before it.
std::vector<replay_outputs> replay_region(std::span<stage_model* const> region,
                                          std::int64_t iteration, float loss_grad,
                                          const replay_inputs& inputs, bool begin = true);

// A stage replaying alone beside the neighbours it exchanges tensors with (a joint region
// replayed as a pipeline across workers, recovery/sparse_to_dense.hpp): its boundary inputs
// are taken as it needs them, its outputs handed on as they are made.
struct replay_stream {
  // The activation of micro-batch mb from the stage before (never called on stage 0) and the
  // gradient from the stage after (never on the last stage); each may wait until it is there.
  // The span must stay valid until the next call.
  std::function<std::span<const float>(int mb)> activation_in, gradient_in;
  // What the stage sent: its activation (not on the last stage) and its input gradient (not on
  // the first), the moment each is made.
  std::function<void(int mb, std::span<const float>)> activation_out, gradient_out;
};

// Replays one stage (`stage` of `stages`) for one iteration in its own 1F1B order, as
// replay_iteration does, through `io`. Because each stage's order is the one it trains in,
// stages replaying side by side this way never wait on each other in a cycle. Weight
// gradients stay in the operators. begin = false: the caller began the iteration (as
// replay_region's).
void replay_streamed(stage_model& model, std::int64_t iteration, float loss_grad, int stage,
                     int stages, int micro_batches, const replay_stream& io, bool begin = true);

}  // namespace moevement::engine
