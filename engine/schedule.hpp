// The 1F1B pipeline schedule (PipeDream-Flush / Megatron): what one stage runs, in order, in
// one iteration. Stage s of p warms up with min(p - s - 1, m) forwards, then alternates one
// forward and one backward, then drains the remaining backwards. Backwards run in micro-batch
// order 0..m-1 on every stage, which the models' bit-exactness across partitions relies on.
#pragma once

#include <cstdint>
#include <vector>

namespace moevement::engine {

enum class pass : std::uint8_t { forward, backward };

struct pipeline_step {
  pass what = pass::forward;
  int micro_batch = 0;
  bool operator==(const pipeline_step&) const = default;
};

// Throws std::invalid_argument unless 0 <= stage < stages and micro_batches >= 1.
std::vector<pipeline_step> one_f_one_b(int stage, int stages, int micro_batches);

}  // namespace moevement::engine
