// The knobs of the baseline checkpoint policies (dense-memory, dense-disk, pec): the one place
// their defaults live. The job config (engine/job_config) maps the `checkpoint.*` keys onto
// these fields; see docs/policies.md.
#pragma once

#include <string>
#include <string_view>

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
  int interval = 0;
  // `checkpoint.mtbf_s`: mean time between failures of the job, seconds (Young's MTBF).
  // One hour: a failure rate that makes Young's k visible on the CPU presets.
  double mtbf_s = 3600.0;
  // `checkpoint.dir`: where dense-disk persists (one durable_store per stage replica under
  // it, stage-<s>-replica-<d>/). Relative paths are relative to the working directory.
  std::string dir = "checkpoints";
  // `checkpoint.keep`: verified snapshots kept on disk per stage replica (>= 2, so a torn or
  // corrupt newest one always has a previous good one behind it).
  int keep = 2;
  // `checkpoint.pec_experts`: K, experts per MoE layer saved in full per PEC checkpoint
  // (MoC-System's default and smallest: 1). K >= the expert count saves every expert.
  int pec_experts = 1;
  // `checkpoint.pec_order`: sequential (MoC-System's default) or load-aware.
  pec_selection pec_order = pec_selection::sequential;

  // Throws std::invalid_argument naming the key of the first bad field.
  void validate() const;
};

}  // namespace moevement::recovery
