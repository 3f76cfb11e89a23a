// Runs a configured simulation and prints it: a table like the paper's Table 3 (interval,
// overhead per iteration, total recovery time and ETTR per policy per MTBF), CSV, and the scale
// sweep of Figure 11.
#pragma once

#include <ostream>
#include <string>
#include <vector>

#include "sim/config.hpp"

namespace moevement::sim {

struct result_row {
  double mtbf_s = 0;
  policy_kind policy = policy_kind::moevement;
  policy_model model;
  closed_form closed;
  monte_carlo_result mc;
};

struct simulation_result {
  std::string name;
  model_shape model;
  plan_spec plan;
  iteration_costs costs;
  std::vector<result_row> rows;  // MTBF-major, policies in configured order
  bool from_trace = false;
};

// Costs (with the profile applied when configured), then every policy at every MTBF.
simulation_result run_simulation(const sim_config& cfg);

void print_table(std::ostream& out, const sim_config& cfg, const simulation_result& r);
void write_csv_header(std::ostream& out);
void write_csv_rows(std::ostream& out, const simulation_result& r);

// Figure 11: each sweep model on its cluster (stages x pipelines x plan.ep GPUs).
std::vector<simulation_result> run_sweep(const sim_config& cfg);
void print_sweep(std::ostream& out, const std::vector<simulation_result>& results);

}  // namespace moevement::sim
