#include "engine/schedule.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace moevement::engine {

std::vector<pipeline_step> one_f_one_b(int stage, int stages, int micro_batches) {
  if (stages < 1 || stage < 0 || stage >= stages) {
    throw std::invalid_argument("one_f_one_b: stage " + std::to_string(stage) + " is not in [0, " +
                                std::to_string(stages) + ")");
  }
  if (micro_batches < 1) {
    throw std::invalid_argument("one_f_one_b: micro_batches must be >= 1, got " +
                                std::to_string(micro_batches));
  }
  const int warmup = std::min(stages - stage - 1, micro_batches);
  std::vector<pipeline_step> steps;
  steps.reserve(std::size_t(micro_batches) * 2);
  int next_forward = 0, next_backward = 0;
  for (; next_forward < warmup; ++next_forward) steps.push_back({pass::forward, next_forward});
  // steady state: one forward, then one backward
  while (next_forward < micro_batches) {
    steps.push_back({pass::forward, next_forward++});
    steps.push_back({pass::backward, next_backward++});
  }
  while (next_backward < micro_batches) steps.push_back({pass::backward, next_backward++});
  return steps;
}

}  // namespace moevement::engine
