#include "recovery/policy_config.hpp"

#include <cmath>
#include <stdexcept>

namespace moevement::recovery {

pec_selection parse_pec_order(std::string_view text) {
  if (text == "sequential") return pec_selection::sequential;
  if (text == "load-aware") return pec_selection::load_aware;
  throw std::invalid_argument("checkpoint.pec_order: '" + std::string(text) +
                              "' is not one of sequential, load-aware");
}

std::string_view pec_order_name(pec_selection order) {
  return order == pec_selection::sequential ? "sequential" : "load-aware";
}

void policy_config::validate() const {
  if (interval < 0) {
    throw std::invalid_argument("checkpoint.interval: must be >= 0 (0: Young's optimum)");
  }
  if (!(mtbf_s > 0) || !std::isfinite(mtbf_s)) {
    throw std::invalid_argument("checkpoint.mtbf_s: must be a finite number of seconds > 0");
  }
  if (dir.empty()) throw std::invalid_argument("checkpoint.dir: must not be empty");
  if (keep < 2) {
    throw std::invalid_argument(
        "checkpoint.keep: must be >= 2 (a corrupt newest snapshot needs a previous good one)");
  }
  if (pec_experts < 1) throw std::invalid_argument("checkpoint.pec_experts: must be >= 1");
}

policy_config policy_config_of(const engine::baseline_knobs& knobs) {
  policy_config c;
  c.interval = knobs.interval;
  c.mtbf_s = knobs.mtbf_s;
  c.dir = knobs.dir;
  c.keep = knobs.keep;
  c.pec_experts = knobs.pec_experts;
  c.pec_order = parse_pec_order(knobs.pec_order);
  c.validate();
  return c;
}

}  // namespace moevement::recovery
