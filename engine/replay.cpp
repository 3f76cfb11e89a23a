#include "engine/replay.hpp"

#include <stdexcept>
#include <string>

#include "engine/schedule.hpp"

namespace moevement::engine {

replay_outputs replay_iteration(stage_model& stage, std::int64_t iteration, float loss_grad,
                                const replay_inputs& in) {
  const bool first = in.stage == 0, last = in.stage == in.stages - 1;
  if (in.micro_batches < 1) throw std::invalid_argument("replay_iteration: micro_batches < 1");
  const auto m = std::size_t(in.micro_batches);
  if (in.activations.size() != (first ? 0 : m)) {
    throw std::invalid_argument("replay_iteration: stage " + std::to_string(in.stage) + " needs " +
                                std::to_string(first ? 0 : m) + " activations, got " +
                                std::to_string(in.activations.size()));
  }
  if (in.gradients.size() != (last ? 0 : m)) {
    throw std::invalid_argument("replay_iteration: stage " + std::to_string(in.stage) + " needs " +
                                std::to_string(last ? 0 : m) + " gradients, got " +
                                std::to_string(in.gradients.size()));
  }
  const auto steps = one_f_one_b(in.stage, in.stages, int(m));
  const auto ops = stage.operators();
  begin_operators(ops);
  stage.begin_iteration(iteration);
  replay_outputs out;
  out.activations.resize(m);
  out.gradients.resize(m);
  out.losses.assign(m, 0.0);
  out.aux_losses.assign(m, 0.0);
  for (const pipeline_step& st : steps) {
    const auto mb = std::size_t(st.micro_batch);
    if (st.what == pass::forward) {
      const stage_output o =
          stage.forward(st.micro_batch, first ? std::span<const float>() : in.activations[mb]);
      if (!last) out.activations[mb].assign(o.activation.begin(), o.activation.end());
      out.losses[mb] = o.loss;
      out.aux_losses[mb] = o.aux_loss;
    } else {
      const auto g = stage.backward(st.micro_batch,
                                    last ? std::span<const float>() : in.gradients[mb], loss_grad);
      if (!first) out.gradients[mb].assign(g.begin(), g.end());
    }
  }
  return out;
}

}  // namespace moevement::engine
