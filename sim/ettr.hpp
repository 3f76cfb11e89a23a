// Checkpoint policies and the effective training time ratio (ETTR) they reach under failures:
// per-policy checkpoint cost and stall, checkpoint interval (Young, oracle, overhead cap or
// fixed), expected recovery time (global rollback vs localized replay), and ETTR both by the
// paper's closed form and by a Monte Carlo run over Poisson failures or a failure trace.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "sim/cost_model.hpp"

namespace moevement::sim {

enum class policy_kind { dense_disk, dense_memory, pec, moevement };
std::string_view policy_name(policy_kind k);
policy_kind parse_policy(std::string_view name);  // throws naming the known names

enum class interval_rule { young, oracle, cap, fixed };
std::string_view interval_rule_name(interval_rule r);
interval_rule parse_interval_rule(std::string_view name);

struct policy_settings {
  policy_kind kind = policy_kind::moevement;
  interval_rule rule = interval_rule::young;  // dense policies only
  int fixed_interval = 1;                     // rule == fixed
  double overhead_cap = 0.03;                 // rule == cap (CheckFreq's 3%)
  int replicas = 2;                           // peer copies in host memory (paper: r = 2)
  double pec_initial_fraction = 0.125;        // K0 / experts (MoC starts at 12.5%, Fig. 10c)
  double pec_plt_budget = 0.0375;             // MoC's lost-token threshold (3.75%)
  int pec_persist_interval = 50;              // iterations between persisted PEC checkpoints
  int pec_interval = 1;                       // iterations between PEC checkpoints (MoC: 1)
  int w_sparse = 0;  // moevement: > 0 fixes W_sparse (our engine tunes it); 0: Algorithm 1's
  // moevement: the measured replay per iteration (profile); > 0 scales the modelled replay so
  // that its expected replayed iteration costs this; <= 0: modelled.
  double replay_iteration_s = -1;
  double snapshot_s = -1;     // measured snapshot time (profile); < 0: model
  double persist_lag_s = -1;  // measured persist lag (profile; dense and moevement); < 0: model
  // Measured persist lags, one per checkpoint (profile); non-empty: the lag is this empirical
  // distribution (its median replaces persist_lag_s where that is not given).
  std::vector<double> persist_lag_samples_s;
  double load_s = -1;     // measured checkpoint load on recovery (profile); < 0: model
  double restart_s = -1;  // measured restart of this policy (profile); < 0: the failures'
};

struct failure_settings {
  double restart_s = 10;            // detection + respawn on a spare + runtime re-initialization
  double duration_s = 12 * 3600.0;  // length of the run (paper: 12-hour runs)
  int trials = 200;                 // Monte Carlo runs
  std::uint64_t seed = 1;
};

// What a policy costs, precomputed for one MTBF (the interval may depend on it).
struct policy_model {
  policy_kind kind = policy_kind::moevement;
  double iteration_s = 0;  // fault-free iteration time
  double update_s = 0;
  int interval = 1;          // iterations per checkpoint
  double stall_s = 0;        // training stall per checkpoint
  double snapshot_s = 0;     // time to take one checkpoint (before overlap)
  double persist_lag_s = 0;  // from the end of the checkpointed iteration until the checkpoint
                             // can be recovered from (snapshot + replication, or + disk persist)
  // The measured lags, sorted (empty: every checkpoint lags persist_lag_s). A tail matters: a
  // failure inside a checkpoint's lag rolls back one interval further. Monte Carlo draws each
  // checkpoint's lag from them; the closed form takes the expectation over them.
  std::vector<double> persist_lag_samples_s;
  double restart_s = 0;
  // Measured restart per failed stage (a stage's replacement builds that stage: the first and
  // last hold the embedding and the head); empty, or an entry < 0: restart_s.
  std::vector<double> stage_restart_s;
  double load_s = 0;  // reading the checkpoint back on recovery
  // Wall time per iteration outside the iteration itself (the coordinator's messaging between
  // iterations; measured by our engine's profile, 0 in the analytical model): overhead, like a
  // stall, in both the closed form and Monte Carlo.
  double dispatch_s = 0;
  int stages = 1;
  // moevement: per stage, time of conversion iteration j and of an all-active replay.
  int w_sparse = 0;
  int o_active = 0;  // of the stage that set W_sparse
  std::vector<std::vector<double>> conversion_s;
  std::vector<double> catch_up_s;
  // pec: stall and experts per checkpoint at each doubling level.
  std::vector<double> pec_stall_s;
  std::vector<double> pec_snapshot_s;
  std::vector<int> pec_k;
  int experts = 0;
  double pec_node_fraction = 0;  // fraction of MoE layers whose experts a failed node held
  int pec_persist_interval = 1;
  double pec_plt_budget = 0;
};

struct model_inputs {
  model_shape model;
  cluster_spec cluster;
  plan_spec plan;
  model_constants constants;
};

// Builds the policy's costs; `mtbf_s` feeds the interval rules (Young, oracle).
policy_model build_policy(const model_inputs& in, const iteration_costs& costs,
                          const policy_settings& p, const failure_settings& f, double mtbf_s);

struct closed_form {
  int interval = 1;
  double overhead_s_per_iter = 0;
  double overhead_fraction = 0;
  double expected_recovery_s = 0;   // E[R] per failure: restart + load + recomputation
  double expected_recompute_s = 0;  // of which recomputation (rollback or localized replay)
  double total_recovery_s = 0;      // expected failures in the run x E[R]
  double total_recompute_s = 0;     // expected failures in the run x recomputation (what the
                                    // paper's Table 3 calls total recovery time)
  double ettr = 0;
};

// The restart after a failure of `stage` (stage_restart_s where measured, else restart_s).
double restart_for(const policy_model& m, int stage);

// Expected extra loss from the persist lag when the failure hits uniformly within `span_s` after a
// checkpoint (a dense interval k x T, or moevement's window W x T): the failure finds the
// checkpoint not yet recoverable with probability P(lag > u), losing one span more, so the
// expectation is E[min(lag, span)] over the lag's distribution (the samples, or the one value).
double expected_persist_penalty_s(const policy_model& m, double span_s);

// Policy moevement's predicted ETTR for windows of w iterations whose capture costs `overhead`
// of the capture-free iteration time iteration_s, a failure costing restart_s plus a replay
// of 1.5 w iterations (the persisted window one to two windows back), each at iteration_s (an
// upper bound), one every mtbf_s: 1 / (1 + overhead) x 1 / (1 + E[R] / mtbf_s). What the head
// re-chooses W_sparse by under checkpoint.window_rule = "ettr" (recovery/window_tuner.hpp).
double window_ettr(double overhead, int w, double iteration_s, double restart_s, double mtbf_s);
// ETTR = 1 / (1 + T_ckpt / (T_iter k)) x 1 / (1 + E[R] / MTBF)  (paper 2.4 and appendix C).
closed_form evaluate_closed_form(const policy_model& m, double mtbf_s, double duration_s);

// The interval that maximizes the closed form for a dense policy's costs (the paper's oracle).
int oracle_interval(const policy_model& m, double mtbf_s, double duration_s);

struct failure_event {
  double time_s = 0;
  int stage = -1;  // -1: drawn at random
};
// One event per line: "TIME_SECONDS [STAGE]"; '#' starts a comment. Throws naming the line.
std::vector<failure_event> parse_failure_trace(std::string_view text);

struct monte_carlo_result {
  int trials = 0;
  double ettr_mean = 0, ettr_std = 0, ettr_p05 = 0, ettr_p50 = 0, ettr_p95 = 0;
  double ettr_min = 0, ettr_max = 0;
  double failures_mean = 0;
  double recovery_s_mean = 0;   // total over the run
  double recompute_s_mean = 0;  // of which recomputation (no restart, no load)
  double overhead_s_per_iter_mean = 0;
  double stderr_mean() const;
};

// Counter-based RNG: a pure function of (seed, stream, counter), so any trial can be rerun alone.
double counter_uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter);

// Poisson failures with mean gap mtbf_s, or (when `trace` is non-empty) the trace's events in
// every trial (stages drawn where the trace names none).
monte_carlo_result monte_carlo(const policy_model& m, double mtbf_s, const failure_settings& f,
                               const std::vector<failure_event>& trace = {});

}  // namespace moevement::sim
