// The knobs of the baseline checkpoint policies (dense-memory, dense-disk, pec), typed for
// recovery/. Their defaults live in one place, engine::baseline_knobs (engine/job_config.hpp,
// the `checkpoint.*` keys); policy_config starts from them. See docs/policies.md.
#pragma once

#include <string>
#include <string_view>

#include "engine/job_config.hpp"

namespace moevement::recovery {

// Which experts a PEC checkpoint saves (MoC-System section 3.2).
enum class pec_selection {
  sequential,  // round robin over each layer's experts, offset per layer (interleaved)
  load_aware,  // the experts with the most routed tokens since their own last save
};

// "sequential" | "load-aware"; throws std::invalid_argument naming the key otherwise.
pec_selection parse_pec_order(std::string_view text);
std::string_view pec_order_name(pec_selection order);

struct policy_config {
  // `checkpoint.interval`: iterations between two checkpoints of dense-memory, dense-disk
  // and pec. 0: Young's optimum round(sqrt(2 * C * MTBF) / iteration time) from the measured
  // snapshot cost C (young_interval in dense_capture.hpp).
  int interval = engine::baseline_knobs{}.interval;
  // `checkpoint.mtbf_s`: mean time between failures of the job, seconds (Young's MTBF).
  // One hour: a failure rate that makes Young's k visible on the CPU presets.
  double mtbf_s = engine::baseline_knobs{}.mtbf_s;
  // `checkpoint.dir`: where dense-disk persists (one durable_store per stage replica under
  // it, stage-<s>-replica-<d>/). Relative paths are relative to the working directory.
  std::string dir = engine::baseline_knobs{}.dir;
  // `checkpoint.keep`: verified snapshots kept on disk per stage replica (>= 2, so a torn or
  // corrupt newest one always has a previous good one behind it).
  int keep = engine::baseline_knobs{}.keep;
  // `checkpoint.pec_experts`: K, experts per MoE layer saved in full per PEC checkpoint
  // (MoC-System's default and smallest: 1). K >= the expert count saves every expert.
  int pec_experts = engine::baseline_knobs{}.pec_experts;
  // `checkpoint.pec_order`: sequential (MoC-System's default) or load-aware.
  pec_selection pec_order = parse_pec_order(engine::baseline_knobs{}.pec_order);

  // Throws std::invalid_argument naming the key of the first bad field.
  void validate() const;
};

// The job's checkpoint.* knobs as a policy_config.
policy_config policy_config_of(const engine::baseline_knobs& knobs);

}  // namespace moevement::recovery
