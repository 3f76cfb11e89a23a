#include "sim/report.hpp"

#include <fmt/format.h>

#include <cmath>
#include <stdexcept>

namespace moevement::sim {
namespace {

std::string mtbf_label(double s) {
  if (s >= 3600 && std::fmod(s, 3600) == 0) return fmt::format("{}H", s / 3600);
  if (std::fmod(s, 60) == 0) return fmt::format("{}M", s / 60);
  return fmt::format("{:.0f}s", s);
}

std::string interval_label(const result_row& row) {
  if (row.policy == policy_kind::moevement) return fmt::format("1 (W={})", row.model.w_sparse);
  if (row.policy == policy_kind::pec) {
    return fmt::format("1 (K={}/{})", row.model.pec_k.front(), row.model.experts);
  }
  return std::to_string(row.closed.interval);
}

}  // namespace

simulation_result run_simulation(const sim_config& cfg) {
  simulation_result r;
  r.name = cfg.name;
  r.model = cfg.inputs.model;
  r.plan = cfg.inputs.plan;
  r.from_trace = !cfg.trace.empty();
  const int replicas = cfg.policies.empty() ? 2 : cfg.policies.front().replicas;
  r.costs = estimate_iteration(cfg.inputs.model, cfg.inputs.cluster, cfg.inputs.plan,
                               cfg.inputs.constants, replicas);
  if (cfg.profile) r.costs = apply_profile(r.costs, *cfg.profile);
  if (cfg.failures.duration_s < r.costs.iteration_s) {
    throw std::invalid_argument(fmt::format(
        "config key 'failures.duration_hours': the run ({:.4g} s) is shorter than one iteration "
        "({:.4g} s): nothing to estimate; make it at least one iteration long",
        cfg.failures.duration_s, r.costs.iteration_s));
  }
  std::vector<double> mtbfs = cfg.mtbf_s;
  if (r.from_trace) {
    // A trace has its own failure rate: report it as the MTBF of the run.
    mtbfs = {cfg.failures.duration_s / static_cast<double>(cfg.trace.size())};
  }
  for (double mtbf : mtbfs) {
    for (const auto& ps : cfg.policies) {
      result_row row;
      row.mtbf_s = mtbf;
      row.policy = ps.kind;
      row.model = build_policy(cfg.inputs, r.costs, ps, cfg.failures, mtbf);
      row.closed = evaluate_closed_form(row.model, mtbf, cfg.failures.duration_s);
      row.mc = monte_carlo(row.model, mtbf, cfg.failures, cfg.trace);
      r.rows.push_back(std::move(row));
    }
  }
  return r;
}

void print_table(std::ostream& out, const sim_config& cfg, const simulation_result& r) {
  const auto& p = r.plan;
  out << fmt::format("{}: {} ({:.1f}B params) on {} x {} (PP {}, DP {}, EP {}, {} micro-batches)\n",
                     r.name, r.model.name, r.costs.total_params / 1e9, p.gpus(),
                     cfg.inputs.cluster.gpu, p.pp, p.dp, p.ep, r.costs.microbatches);
  out << fmt::format("iteration {:.3f} s = pipeline {:.3f} + sync {:.3f} + update {:.3f}{}\n",
                     r.costs.iteration_s, r.costs.pipeline_s, r.costs.sync_s, r.costs.update_s,
                     cfg.profile ? "  (profile applied)" : "");
  out << fmt::format("{:>5} {:>7} {:>9} {:>10} {:>10} {:>9} {:>9} {:>10} {:>9}\n", "stage",
                     "layers", "params", "mb s", "compute s", "comm s", "sync s", "snap GB/s",
                     "mem GB/GPU");
  for (std::size_t s = 0; s < r.costs.stages.size(); ++s) {
    const auto& st = r.costs.stages[s];
    int first = -1, last = -1;
    for (const auto& op : st.ops) {
      if (op.layer >= 0) {
        if (first < 0) first = op.layer;
        last = op.layer;
      }
    }
    out << fmt::format(
        "{:>5} {:>7} {:>8.2f}B {:>10.4f} {:>10.4f} {:>9.4f} {:>9.4f} {:>10.2f} {:>9.1f}\n", s,
        fmt::format("{}-{}", first, last), st.params / 1e9, st.microbatch_s, st.compute_s,
        st.comm_s, st.sync_s, st.snapshot_bytes_per_s / 1e9, st.memory_per_gpu / 1e9);
  }
  for (std::size_t s = 0; s < r.costs.stages.size(); ++s) {
    const double need = r.costs.stages[s].memory_per_gpu;
    if (need > cfg.inputs.cluster.gpu_memory_bytes) {
      out << fmt::format(
          "warning: stage {} needs {:.1f} GB per GPU for weights, gradients and optimizer state "
          "alone; cluster.gpu_memory_gb is {:.0f}\n",
          s, need / 1e9, cfg.inputs.cluster.gpu_memory_bytes / 1e9);
    }
  }
  out << fmt::format(
      "run {:.1f} h, restart {:.1f} s per failure, {} Monte Carlo trials, seed {}{}\n\n",
      cfg.failures.duration_s / 3600, cfg.failures.restart_s, cfg.failures.trials,
      cfg.failures.seed, r.from_trace ? ", failures from the trace" : "");
  out << fmt::format("{:<5} {:<13} {:>12} {:>16} {:>10} {:>10} {:>7} {:>22}\n", "MTBF", "policy",
                     "interval", "overhead s (%)", "E[R] s", "recompute s", "ETTR",
                     "ETTR MC mean±std");
  double last = -1;
  for (const auto& row : r.rows) {
    if (row.mtbf_s != last && last >= 0) out << "\n";
    last = row.mtbf_s;
    out << fmt::format("{:<5} {:<13} {:>12} {:>16} {:>10.1f} {:>10.0f} {:>7.3f} {:>14}\n",
                       mtbf_label(row.mtbf_s), policy_name(row.policy), interval_label(row),
                       fmt::format("{:.3f} ({:.1f}%)", row.closed.overhead_s_per_iter,
                                   100 * row.closed.overhead_fraction),
                       row.closed.expected_recovery_s, row.closed.total_recompute_s,
                       row.closed.ettr,
                       fmt::format("{:.3f}±{:.3f} [{:.3f},{:.3f}]", row.mc.ettr_mean,
                                   row.mc.ettr_std, row.mc.ettr_p05, row.mc.ettr_p95));
  }
}

void write_csv_header(std::ostream& out) {
  out << "name,model,gpus,pp,dp,ep,microbatches,iteration_s,mtbf_min,policy,interval,w_sparse,"
         "pec_k0,overhead_s,overhead_fraction,expected_recovery_s,total_recovery_s,ettr_closed,"
         "ettr_mc_mean,ettr_mc_std,ettr_mc_p05,ettr_mc_p95,mc_failures,mc_recovery_s,trials,"
         "snapshot_s,stall_s,restart_s,load_s,expected_recompute_s,total_recompute_s,"
         "mc_recompute_s\n";
}

void write_csv_rows(std::ostream& out, const simulation_result& r) {
  for (const auto& row : r.rows) {
    out << fmt::format(
        "{},{},{},{},{},{},{},{:.6f},{:.3f},{},{},{},{},{:.6f},{:.6f},{:.3f},{:.3f},{:.6f},{:.6f},"
        "{:.6f},{:.6f},{:.6f},{:.3f},{:.3f},{},{:.6f},{:.6f},{:.3f},{:.6f},{:.3f},{:.3f},{:.3f}\n",
        r.name, r.model.name, r.plan.gpus(), r.plan.pp, r.plan.dp, r.plan.ep, r.costs.microbatches,
        r.costs.iteration_s, row.mtbf_s / 60, policy_name(row.policy), row.closed.interval,
        row.model.w_sparse, row.model.pec_k.empty() ? 0 : row.model.pec_k.front(),
        row.closed.overhead_s_per_iter, row.closed.overhead_fraction,
        row.closed.expected_recovery_s, row.closed.total_recovery_s, row.closed.ettr,
        row.mc.ettr_mean, row.mc.ettr_std, row.mc.ettr_p05, row.mc.ettr_p95, row.mc.failures_mean,
        row.mc.recovery_s_mean, row.mc.trials, row.model.snapshot_s, row.model.stall_s,
        row.model.restart_s, row.model.load_s, row.closed.expected_recompute_s,
        row.closed.total_recompute_s, row.mc.recompute_s_mean);
  }
}

std::vector<simulation_result> run_sweep(const sim_config& cfg) {
  std::vector<simulation_result> out;
  const auto& s = cfg.sweep;
  for (std::size_t i = 0; i < s.models.size(); ++i) {
    sim_config c = cfg;
    c.name = "sweep";
    try {
      c.inputs.model = paper_model(s.models[i]);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("config key 'sweep.models': ") + e.what());
    }
    auto& p = c.inputs.plan;
    p.pp = s.stages[i];
    p.dp = s.pipelines[i];
    if (p.pp * p.dp * p.ep != s.gpus[i]) {
      throw std::invalid_argument(fmt::format(
          "config key 'sweep.gpus': entry {} is {} but stages x pipelines x plan.ep = {}", i,
          s.gpus[i], p.pp * p.dp * p.ep));
    }
    p.global_batch = s.microbatches_per_stage * p.pp * p.micro_batch * p.dp;
    c.mtbf_s.clear();
    for (double m : s.mtbf_minutes) c.mtbf_s.push_back(m * 60);
    c.policies.clear();
    for (const auto& name : s.policies) {
      policy_settings ps;
      try {
        ps.kind = parse_policy(name);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(std::string("config key 'sweep.policies': ") + e.what());
      }
      // Same settings as the configured policy of that kind; otherwise the paper's choices.
      bool configured = false;
      for (const auto& q : cfg.policies) {
        if (q.kind == ps.kind) {
          ps = q;
          configured = true;
        }
      }
      if (!configured && ps.kind == policy_kind::dense_memory) ps.rule = interval_rule::oracle;
      if (!configured && ps.kind == policy_kind::dense_disk) ps.rule = interval_rule::cap;
      c.policies.push_back(ps);
    }
    c.trace.clear();
    c.profile.reset();
    out.push_back(run_simulation(c));
  }
  return out;
}

void print_sweep(std::ostream& out, const std::vector<simulation_result>& results) {
  out << "Scale study (paper Figure 11)\n";
  out << fmt::format("{:<15} {:>6} {:>4} {:>4} {:>8} {:<5} {:<13} {:>12} {:>7} {:>14}\n", "model",
                     "GPUs", "PP", "DP", "iter s", "MTBF", "policy", "interval", "ETTR",
                     "MC mean±std");
  for (const auto& r : results) {
    for (const auto& row : r.rows) {
      out << fmt::format("{:<15} {:>6} {:>4} {:>4} {:>8.2f} {:<5} {:<13} {:>12} {:>7.3f} {:>14}\n",
                         r.model.name, r.plan.gpus(), r.plan.pp, r.plan.dp, r.costs.iteration_s,
                         mtbf_label(row.mtbf_s), policy_name(row.policy), interval_label(row),
                         row.closed.ettr,
                         fmt::format("{:.3f}±{:.3f}", row.mc.ettr_mean, row.mc.ettr_std));
    }
  }
}

}  // namespace moevement::sim
