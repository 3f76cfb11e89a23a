#include "engine/replay.hpp"

#include <stdexcept>
#include <string>

#include "engine/schedule.hpp"

namespace moevement::engine {

replay_outputs replay_iteration(stage_model& stage, std::int64_t iteration, float loss_grad,
                                const replay_inputs& in) {
  stage_model* const one[] = {&stage};
  auto out = replay_region(one, iteration, loss_grad, in);
  return std::move(out[0]);
}

std::vector<replay_outputs> replay_region(std::span<stage_model* const> region,
                                          std::int64_t iteration, float loss_grad,
                                          const replay_inputs& in, bool begin) {
  const int k = int(region.size());
  if (k < 1) throw std::invalid_argument("replay_region: an empty region");
  if (in.stage < 0 || in.stage + k > in.stages) {
    throw std::invalid_argument("replay_region: stages " + std::to_string(in.stage) + ".." +
                                std::to_string(in.stage + k - 1) + " are outside a pipeline of " +
                                std::to_string(in.stages));
  }
  if (in.micro_batches < 1) throw std::invalid_argument("replay_iteration: micro_batches < 1");
  const auto m = std::size_t(in.micro_batches);
  const bool starts = in.stage == 0, ends = in.stage + k == in.stages;
  if (in.activations.size() != (starts ? 0 : m)) {
    throw std::invalid_argument("replay_iteration: stage " + std::to_string(in.stage) + " needs " +
                                std::to_string(starts ? 0 : m) + " activations, got " +
                                std::to_string(in.activations.size()));
  }
  if (in.gradients.size() != (ends ? 0 : m)) {
    throw std::invalid_argument("replay_iteration: stage " + std::to_string(in.stage + k - 1) +
                                " needs " + std::to_string(ends ? 0 : m) + " gradients, got " +
                                std::to_string(in.gradients.size()));
  }
  const auto ku = static_cast<std::size_t>(k);
  std::vector<std::vector<pipeline_step>> steps(ku);
  std::vector<std::size_t> next(ku, 0);
  // [k][mb]: whether stage k has produced its activation / gradient of mb yet
  std::vector<std::vector<bool>> sent_act(ku, std::vector<bool>(m, false));
  std::vector<std::vector<bool>> sent_grad = sent_act;
  std::vector<replay_outputs> out(ku);
  for (int j = 0; j < k; ++j) {
    const auto ju = std::size_t(j);
    steps[ju] = one_f_one_b(in.stage + j, in.stages, int(m));
    if (begin) {
      begin_operators(region[ju]->operators());
      region[ju]->begin_iteration(iteration);
    }
    out[ju].activations.resize(m);
    out[ju].gradients.resize(m);
    out[ju].losses.assign(m, 0.0);
    out[ju].aux_losses.assign(m, 0.0);
  }
  std::size_t left = 0;
  for (const auto& s : steps) left += s.size();
  while (left > 0) {
    bool progress = false;
    for (int j = 0; j < k; ++j) {
      const auto ju = std::size_t(j);
      const int s = in.stage + j;
      const bool first = s == 0, last = s + 1 == in.stages;
      for (; next[ju] < steps[ju].size(); ++next[ju], --left, progress = true) {
        const pipeline_step& st = steps[ju][next[ju]];
        const auto mb = std::size_t(st.micro_batch);
        if (st.what == pass::forward) {
          std::span<const float> x;
          if (j > 0) {
            if (!sent_act[ju - 1][mb]) break;  // the stage before has not got there yet
            x = out[ju - 1].activations[mb];
          } else if (!first) {
            x = in.activations[mb];
          }
          const stage_output o = region[ju]->forward(st.micro_batch, x);
          if (!last) out[ju].activations[mb].assign(o.activation.begin(), o.activation.end());
          out[ju].losses[mb] = o.loss;
          out[ju].aux_losses[mb] = o.aux_loss;
          sent_act[ju][mb] = true;
        } else {
          std::span<const float> g;
          if (j + 1 < k) {
            if (!sent_grad[ju + 1][mb]) break;  // the stage after has not got there yet
            g = out[ju + 1].gradients[mb];
          } else if (!last) {
            g = in.gradients[mb];
          }
          const auto dx = region[ju]->backward(st.micro_batch, g, loss_grad);
          if (!first) out[ju].gradients[mb].assign(dx.begin(), dx.end());
          sent_grad[ju][mb] = true;
        }
      }
    }
    // 1F1B never deadlocks in a pipeline; this guards the loop against a schedule bug.
    if (!progress) throw std::logic_error("replay_region: no stage can proceed (schedule bug)");
  }
  return out;
}

void replay_streamed(stage_model& model, std::int64_t iteration, float loss_grad, int stage,
                     int stages, int micro_batches, const replay_stream& io, bool begin) {
  if (stage < 0 || stage >= stages || micro_batches < 1) {
    throw std::invalid_argument("replay_streamed: stage " + std::to_string(stage) + " of " +
                                std::to_string(stages) + ", " + std::to_string(micro_batches) +
                                " micro-batches");
  }
  const bool first = stage == 0, last = stage + 1 == stages;
  if (begin) {
    begin_operators(model.operators());
    model.begin_iteration(iteration);
  }
  for (const pipeline_step& st : one_f_one_b(stage, stages, micro_batches)) {
    if (st.what == pass::forward) {
      std::span<const float> x;
      if (!first) x = io.activation_in(st.micro_batch);
      const stage_output o = model.forward(st.micro_batch, x);
      if (!last) io.activation_out(st.micro_batch, o.activation);
    } else {
      std::span<const float> g;
      if (!last) g = io.gradient_in(st.micro_batch);
      const auto dx = model.backward(st.micro_batch, g, loss_grad);
      if (!first) io.gradient_out(st.micro_batch, dx);
    }
  }
}

}  // namespace moevement::engine
