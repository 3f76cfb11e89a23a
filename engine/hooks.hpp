// Where checkpoint policies (recovery/) attach to the engine. The engine calls these at fixed
// points; the default does nothing (policy `none`). All calls run on the stage's compute
// thread, in iteration order, so an implementation sees a consistent stage.
#pragma once

#include <cstdint>
#include <span>

#include "models/model.hpp"
#include "models/operator_state.hpp"

namespace moevement::engine {

enum class boundary : std::uint8_t { activation, gradient };

class stage_hooks {
 public:
  virtual ~stage_hooks() = default;
  // The step of `iteration`, just before it is applied: the loss gradient its backwards used
  // and the plan of its optimizer step (job-wide), which a replay of this iteration must reuse.
  virtual void on_step(std::int64_t /*iteration*/, float /*loss_grad*/,
                       const models::step_plan& /*plan*/) {}
  // After the optimizer step of `iteration` (applied or skipped): the snapshot point. ops are
  // the stage's operators in canonical order, as they are after the step.
  virtual void after_step(std::int64_t /*iteration*/,
                          std::span<models::operator_state* const> /*ops*/) {}
  // Every tensor this stage sends across a stage boundary: activations downstream, gradients
  // upstream (the upstream log). `tensor` is valid only during the call.
  virtual void on_boundary_send(std::int64_t /*iteration*/, int /*micro_batch*/, boundary /*kind*/,
                                std::span<const float> /*tensor*/) {}
};

}  // namespace moevement::engine
