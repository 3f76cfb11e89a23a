#include "sim/ettr.hpp"

#include <algorithm>
#include <cmath>
#include <deque>
#include <functional>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>

#include "base/require.hpp"

namespace moevement::sim {
namespace {

constexpr int max_interval = 1'000'000;

double stage_state_bytes(const stage_costs& s) {
  return s.params * 12.0;  // FP32 master + Adam m and v; compute weights derive from the master
}

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// Checkpoint stall of dense-disk at interval k: snapshot stall plus the part of the persist to
// storage that the k iterations before the next checkpoint cannot hide.
double dense_stall(const policy_model& m, double persist_s, int k) {
  return m.stall_s + std::max(0.0, persist_s - k * m.iteration_s);
}

// Measured lag samples replace the single value: sorted, and their median where no single
// measured value is given.
void set_lag_samples(policy_model& m, const policy_settings& p) {
  if (p.persist_lag_samples_s.empty()) return;
  for (double l : p.persist_lag_samples_s)
    require(l >= 0 && std::isfinite(l), "persist lag samples must be finite and >= 0");
  m.persist_lag_samples_s = p.persist_lag_samples_s;
  std::sort(m.persist_lag_samples_s.begin(), m.persist_lag_samples_s.end());
  if (p.persist_lag_s < 0) {
    const auto& v = m.persist_lag_samples_s;
    const std::size_t n = v.size();
    m.persist_lag_s = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }
}

}  // namespace

double restart_for(const policy_model& m, int stage) {
  if (stage >= 0 && static_cast<std::size_t>(stage) < m.stage_restart_s.size() &&
      m.stage_restart_s[static_cast<std::size_t>(stage)] >= 0)
    return m.stage_restart_s[static_cast<std::size_t>(stage)];
  return m.restart_s;
}

double expected_persist_penalty_s(const policy_model& m, double span_s) {
  if (m.persist_lag_samples_s.empty()) return std::min(m.persist_lag_s, span_s);
  double sum = 0;
  for (double l : m.persist_lag_samples_s) sum += std::min(l, span_s);
  return sum / static_cast<double>(m.persist_lag_samples_s.size());
}

std::string_view policy_name(policy_kind k) {
  switch (k) {
    case policy_kind::dense_disk:
      return "dense-disk";
    case policy_kind::dense_memory:
      return "dense-memory";
    case policy_kind::pec:
      return "pec";
    case policy_kind::moevement:
      return "moevement";
  }
  return "?";
}

policy_kind parse_policy(std::string_view name) {
  for (auto k : {policy_kind::dense_disk, policy_kind::dense_memory, policy_kind::pec,
                 policy_kind::moevement}) {
    if (policy_name(k) == name) return k;
  }
  throw std::invalid_argument("unknown policy '" + std::string(name) +
                              "' (known: dense-disk, dense-memory, pec, moevement)");
}

std::string_view interval_rule_name(interval_rule r) {
  switch (r) {
    case interval_rule::young:
      return "young";
    case interval_rule::oracle:
      return "oracle";
    case interval_rule::cap:
      return "cap";
    case interval_rule::fixed:
      return "fixed";
  }
  return "?";
}

interval_rule parse_interval_rule(std::string_view name) {
  for (auto r :
       {interval_rule::young, interval_rule::oracle, interval_rule::cap, interval_rule::fixed}) {
    if (interval_rule_name(r) == name) return r;
  }
  throw std::invalid_argument("unknown interval rule '" + std::string(name) +
                              "' (known: young, oracle, cap, fixed)");
}

namespace {

// The dense baselines' interval k by the policy's rule (fixed, Young, an overhead cap, or the
// oracle's best ETTR).
int choose_dense_interval(const policy_model& m, const policy_settings& p,
                          const failure_settings& f, double mtbf_s, double persist,
                          const std::function<policy_model(int)>& with_interval) {
  int k = 1;
  switch (p.rule) {
    case interval_rule::fixed:
      require(p.fixed_interval >= 1, "policies.<dense>.fixed_interval must be >= 1");
      k = p.fixed_interval;
      break;
    case interval_rule::young: {
      // Young: tau = sqrt(2 C MTBF), C the checkpoint's cost to training.
      const double c_cost = with_interval(1).stall_s;
      k = std::clamp(static_cast<int>(std::lround(std::sqrt(2 * c_cost * mtbf_s) / m.iteration_s)),
                     1, max_interval);
      break;
    }
    case interval_rule::cap: {
      require(p.overhead_cap > 0, "policies.<dense>.overhead_cap must be positive");
      k = max_interval;
      for (int i = 1; i <= max_interval; ++i) {
        if (dense_stall(m, persist, i) / (i * m.iteration_s) <= p.overhead_cap) {
          k = i;
          break;
        }
      }
      break;
    }
    case interval_rule::oracle: {
      double best = -1;
      const int limit =
          std::clamp(static_cast<int>(8 * mtbf_s / m.iteration_s) + 1, 1, max_interval);
      for (int i = 1; i <= limit; ++i) {
        const double e = evaluate_closed_form(with_interval(i), mtbf_s, f.duration_s).ettr;
        if (e > best) {
          best = e;
          k = i;
        }
      }
      break;
    }
  }
  return k;
}

// dense-memory, dense-disk: a full snapshot every k iterations, k by the policy's rule.
policy_model build_dense(policy_model m, const model_inputs& in, const iteration_costs& costs,
                         const policy_settings& p, const failure_settings& f, double mtbf_s,
                         double overlap) {
  const auto& c = in.cluster;
  double snap = 0, load = 0, per_gpu_state = 0;
  for (const auto& s : costs.stages) {
    const double bytes = stage_state_bytes(s);
    per_gpu_state = std::max(per_gpu_state, bytes / s.gpus);
    if (p.kind == policy_kind::dense_memory) {
      snap = std::max(snap, bytes / s.snapshot_bytes_per_s);
    } else {
      // CheckFreq snapshots to local host memory only; a measured or calibrated snapshot
      // bandwidth replaces the nominal device-to-host one.
      const double bw =
          c.snapshot_bytes_per_s > 0 ? c.snapshot_bytes_per_s : c.host_device_bytes_per_s;
      snap = std::max(snap, bytes / s.gpus / bw);
    }
  }
  if (p.snapshot_s >= 0) snap = p.snapshot_s;
  m.snapshot_s = snap;
  m.stall_s = std::max(0.0, snap - overlap);
  double persist = 0;
  if (p.kind == policy_kind::dense_memory) {
    // The failed node pulls its state from a peer; the others read their local copy.
    load = std::max(per_gpu_state / c.inter_node_bytes_per_s_per_gpu(),
                    per_gpu_state / c.host_device_bytes_per_s);
  } else {
    persist = costs.total_params * 12.0 / c.storage_bytes_per_s;
    load = persist;
  }
  if (p.load_s >= 0) load = p.load_s;
  m.load_s = load;
  m.persist_lag_s = p.persist_lag_s >= 0 ? p.persist_lag_s : snap + persist;
  set_lag_samples(m, p);
  const auto with_interval = [&](int k) {
    policy_model x = m;
    x.interval = k;
    x.stall_s = dense_stall(m, persist, k);
    return x;
  };
  return with_interval(choose_dense_interval(m, p, f, mtbf_s, persist, with_interval));
}

// pec: K experts per checkpoint, doubling level by level until every expert is in.
policy_model build_pec(policy_model m, const model_inputs& in, const iteration_costs& costs,
                       const policy_settings& p, double overlap) {
  const auto& c = in.cluster;
  const int experts = in.model.experts;
  require(experts > 0, "policy pec needs a model with experts");
  require(p.pec_initial_fraction > 0 && p.pec_initial_fraction <= 1,
          "policies.pec.initial_fraction must be in (0, 1]");
  require(p.pec_persist_interval >= 1, "policies.pec.persist_interval must be >= 1");
  require(p.pec_interval >= 1, "policies.pec.interval must be >= 1");
  m.experts = experts;
  m.pec_persist_interval = p.pec_persist_interval;
  m.pec_plt_budget = p.pec_plt_budget;
  m.pec_node_fraction =
      std::min(1.0, std::max(1.0, static_cast<double>(c.gpus_per_node) / in.plan.ep) / in.plan.pp);
  int k = std::max(1, static_cast<int>(std::lround(experts * p.pec_initial_fraction)));
  double per_gpu_state = 0;
  double measured_scale = -1;  // measured / modelled time of the first level's checkpoint
  while (true) {
    double snap = 0;
    for (const auto& s : costs.stages) {
      double bytes = 0;
      for (const auto& op : s.ops) {
        bytes += op.params * 12.0 *
                 (op.kind == op_kind::expert ? static_cast<double>(k) / experts : 1.0);
      }
      snap = std::max(snap, bytes / s.snapshot_bytes_per_s);
      per_gpu_state = std::max(per_gpu_state, stage_state_bytes(s) / s.gpus);
    }
    // A measured time is of the first level's checkpoint; larger K scale with the bytes.
    if (p.snapshot_s >= 0 && measured_scale < 0)
      measured_scale = snap > 0 ? p.snapshot_s / snap : 0;
    if (measured_scale >= 0) snap = m.pec_k.empty() ? p.snapshot_s : snap * measured_scale;
    if (m.pec_k.empty()) m.snapshot_s = snap;
    m.pec_snapshot_s.push_back(snap);
    m.pec_k.push_back(k);
    m.pec_stall_s.push_back(std::max(0.0, snap - overlap));
    if (k >= experts) break;
    k = std::min(experts, 2 * k);
  }
  m.stall_s = m.pec_stall_s.front();
  m.load_s = p.load_s >= 0 ? p.load_s : per_gpu_state / c.inter_node_bytes_per_s_per_gpu();
  m.interval = p.pec_interval;
  return m;
}

// moevement: Algorithm 1 per stage; W_sparse is agreed across stages (the largest wins).
policy_model build_moevement(policy_model m, const model_inputs& in, const iteration_costs& costs,
                             const policy_settings& p, double overlap) {
  const auto& c = in.cluster;
  std::vector<std::vector<std::size_t>> orders;
  for (const auto& s : costs.stages) {
    orders.push_back(order_by_popularity(s.snapshot));
    std::vector<sparse_op> ordered;
    for (auto i : orders.back()) ordered.push_back(s.snapshot[i]);
    const auto w = find_window_size(ordered, costs.iteration_s, s.snapshot_bytes_per_s);
    if (w.w_sparse > m.w_sparse) {
      m.w_sparse = w.w_sparse;
      m.o_active = w.o_active;
    }
  }
  if (p.w_sparse > 0) {
    // At most one operator per slot, as the engine's window tuner holds it (a larger W would
    // only add empty slots, and memory for each).
    std::size_t most = 1;
    for (const auto& s : costs.stages) most = std::max(most, s.ops.size());
    m.w_sparse = int(std::min<std::size_t>(std::size_t(p.w_sparse), most));
    m.o_active = 0;
    for (const auto& s : costs.stages) {
      m.o_active = std::max(
          m.o_active, int((s.ops.size() + std::size_t(m.w_sparse) - 1) / std::size_t(m.w_sparse)));
    }
  }
  double slot_s = 0, load = 0;
  for (std::size_t si = 0; si < costs.stages.size(); ++si) {
    const auto& s = costs.stages[si];
    const std::size_t n = s.ops.size();
    const int o_active = static_cast<int>((n + m.w_sparse - 1) / m.w_sparse);
    const auto schedule = generate_schedule(orders[si], m.w_sparse, o_active);
    double window_bytes = 0;
    std::vector<double> conv;
    for (int j = 0; j < m.w_sparse; ++j) {
      const double b = slot_bytes(schedule[static_cast<std::size_t>(j)], s.snapshot);
      window_bytes += b;
      slot_s = std::max(slot_s, b / s.snapshot_bytes_per_s);
      conv.push_back(local_replay_iteration_s(s, active_after_slot(schedule, n, j),
                                              costs.microbatches, in.constants));
    }
    double catch_up =
        local_replay_iteration_s(s, std::vector<bool>(n, true), costs.microbatches, in.constants);
    if (p.replay_iteration_s > 0 && catch_up > 0) {
      // A failure replays W - 1 conversion iterations and (W - 1) / 2 all-active ones on average
      // (evaluate_closed_form): their mean iteration is scaled to the measured one (on a host
      // whose cores the stages share, a stage replaying alone computes faster than in training).
      const int w = m.w_sparse;
      double mean = catch_up;
      if (w > 1) {
        double sum = 0.5 * (w - 1) * catch_up;
        for (int j = 0; j + 1 < w; ++j) sum += conv[std::size_t(j)];
        mean = sum / (1.5 * (w - 1));
      }
      const double scale = p.replay_iteration_s / mean;
      for (double& c : conv) c *= scale;
      catch_up *= scale;
    }
    m.conversion_s.push_back(std::move(conv));
    m.catch_up_s.push_back(catch_up);
    // The replacement GPUs pull the stage's persisted window from peers' host memory.
    load = std::max(load, window_bytes / (s.gpus * c.inter_node_bytes_per_s_per_gpu()));
  }
  m.snapshot_s = slot_s;
  m.persist_lag_s = p.persist_lag_s >= 0 ? p.persist_lag_s : slot_s;
  set_lag_samples(m, p);
  m.stall_s = std::max(0.0, slot_s - overlap);
  m.load_s = p.load_s >= 0 ? p.load_s : load;
  m.interval = 1;
  return m;
}

}  // namespace

policy_model build_policy(const model_inputs& in, const iteration_costs& costs,
                          const policy_settings& p, const failure_settings& f, double mtbf_s) {
  require(mtbf_s > 0, "failures.mtbf_minutes must be positive");
  require(p.replicas >= 0, "policies.replicas must be >= 0");
  policy_model m;
  m.kind = p.kind;
  m.iteration_s = costs.iteration_s;
  m.update_s = costs.update_s;
  m.restart_s = p.restart_s >= 0 ? p.restart_s : f.restart_s;
  m.dispatch_s = costs.dispatch_s;
  m.stages = static_cast<int>(costs.stages.size());
  // Snapshots overlap the next iteration's forward and backward; the update must wait.
  const double overlap = costs.iteration_s - costs.update_s;
  switch (p.kind) {
    case policy_kind::dense_memory:
    case policy_kind::dense_disk:
      return build_dense(std::move(m), in, costs, p, f, mtbf_s, overlap);
    case policy_kind::pec:
      return build_pec(std::move(m), in, costs, p, overlap);
    case policy_kind::moevement:
      return build_moevement(std::move(m), in, costs, p, overlap);
  }
  throw std::logic_error("build_policy: unhandled policy");
}

closed_form evaluate_closed_form(const policy_model& m, double mtbf_s, double duration_s) {
  closed_form out;
  out.interval = m.interval;
  const double t = m.iteration_s;
  double recompute = 0;
  switch (m.kind) {
    case policy_kind::dense_disk:
    case policy_kind::dense_memory:
      out.overhead_s_per_iter = m.stall_s / m.interval;
      // Global rollback: half an interval on average, plus one more interval when the failure
      // hits before the newest checkpoint is persisted.
      recompute = 0.5 * m.interval * t + expected_persist_penalty_s(m, m.interval * t);
      break;
    case policy_kind::moevement: {
      out.overhead_s_per_iter = m.stall_s;
      // Localized replay of a stage drawn uniformly: W - 1 conversion iterations, then
      // (W - 1) / 2 all-active catch-up iterations on average (one window more when the failure
      // hits before the newest window is persisted), plus the aborted iteration.
      double replay = 0;
      for (std::size_t s = 0; s < m.conversion_s.size(); ++s) {
        double r = 0;
        for (int j = 0; j + 1 < m.w_sparse; ++j)
          r += m.conversion_s[s][static_cast<std::size_t>(j)];
        r += (0.5 * (m.w_sparse - 1) + expected_persist_penalty_s(m, m.w_sparse * t) / t) *
             m.catch_up_s[s];
        replay += r / static_cast<double>(m.conversion_s.size());
      }
      recompute = replay + 0.5 * t;
      break;
    }
    case policy_kind::pec: {
      // Failures at their expected times; K doubles when the lost-token budget is exceeded.
      std::size_t level = 0;
      double lost = 0, overhead_time = 0, iters_total = 0, time = 0;
      while (time < duration_s) {
        const double stall = m.pec_stall_s[level] / m.interval;  // per iteration
        const double span = std::min(mtbf_s, duration_s - time);
        const double iters = span / (t + stall);
        overhead_time += iters * stall;
        iters_total += iters;
        time += mtbf_s;
        if (time >= duration_s) break;
        const double age = (static_cast<double>(m.experts) / m.pec_k[level] - 1) / 2;
        lost += age * (m.pec_node_fraction * m.pec_persist_interval + (1 - m.pec_node_fraction));
        if (lost / std::max(1.0, iters_total) > m.pec_plt_budget && level + 1 < m.pec_k.size())
          ++level;
      }
      out.overhead_s_per_iter =
          iters_total > 0 ? overhead_time / iters_total : m.stall_s / m.interval;
      // Global rollback as for the dense policies (MoC checkpoints every iteration: k = 1).
      recompute = 0.5 * m.interval * t + std::min(m.pec_snapshot_s[level], m.interval * t);
      break;
    }
  }
  out.overhead_s_per_iter += m.dispatch_s;
  out.overhead_fraction = out.overhead_s_per_iter / t;
  // The failed stage is uniform over the stages.
  double restart = 0;
  for (int s = 0; s < m.stages; ++s) restart += restart_for(m, s);
  restart /= std::max(1, m.stages);
  out.expected_recovery_s = restart + m.load_s + recompute;
  out.expected_recompute_s = recompute;
  out.total_recovery_s = duration_s / mtbf_s * out.expected_recovery_s;
  out.total_recompute_s = duration_s / mtbf_s * recompute;
  out.ettr = 1.0 / (1.0 + out.overhead_fraction) / (1.0 + out.expected_recovery_s / mtbf_s);
  return out;
}

int oracle_interval(const policy_model& m, double mtbf_s, double duration_s) {
  int best_k = 1;
  double best = -1;
  const int limit = std::clamp(static_cast<int>(8 * mtbf_s / m.iteration_s) + 1, 1, max_interval);
  for (int k = 1; k <= limit; ++k) {
    policy_model x = m;
    x.interval = k;
    const double e = evaluate_closed_form(x, mtbf_s, duration_s).ettr;
    if (e > best) {
      best = e;
      best_k = k;
    }
  }
  return best_k;
}

std::vector<failure_event> parse_failure_trace(std::string_view text) {
  std::vector<failure_event> out;
  std::istringstream in{std::string(text)};
  std::string line;
  int line_no = 0;
  while (std::getline(in, line)) {
    ++line_no;
    if (const auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream fields(line);
    failure_event e;
    if (!(fields >> e.time_s)) {
      if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
      throw std::invalid_argument("failure trace line " + std::to_string(line_no) +
                                  ": expected 'TIME_SECONDS [STAGE]', got '" + line + "'");
    }
    e.stage = -1;
    if (std::string stage; fields >> stage) {  // a whole number >= 0, and nothing after it
      std::size_t used = 0;
      long v = -1;
      try {
        v = std::stol(stage, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (used != stage.size() || v < 0 || v > 1'000'000) {
        throw std::invalid_argument("failure trace line " + std::to_string(line_no) +
                                    ": the stage must be a whole number >= 0, got '" + stage + "'");
      }
      e.stage = int(v);
      if (std::string extra; fields >> extra) {
        throw std::invalid_argument("failure trace line " + std::to_string(line_no) +
                                    ": expected 'TIME_SECONDS [STAGE]', got more: '" + extra + "'");
      }
    }
    if (e.time_s < 0 || !std::isfinite(e.time_s) ||
        (!out.empty() && e.time_s < out.back().time_s)) {
      throw std::invalid_argument("failure trace line " + std::to_string(line_no) +
                                  ": times must be finite, >= 0 and non-decreasing");
    }
    out.push_back(e);
  }
  return out;
}

double counter_uniform(std::uint64_t seed, std::uint64_t stream, std::uint64_t counter) {
  const std::uint64_t x =
      splitmix64(splitmix64(splitmix64(seed) ^ (stream * 0xd1b54a32d192ed03ULL)) ^ counter);
  return (static_cast<double>(x >> 11) + 0.5) * 0x1.0p-53;  // in (0, 1)
}

double monte_carlo_result::stderr_mean() const {
  return trials > 1 ? ettr_std / std::sqrt(static_cast<double>(trials)) : 0.0;
}

namespace {

struct trial_outcome {
  double ettr = 0;
  int failures = 0;
  double recovery_s = 0;
  double recompute_s = 0;
  double overhead_s_per_iter = 0;
};

// One run of f.duration_s seconds. Iterations are stepped one by one; a failure aborts the
// running iteration, costs restart + load, and then either rolls everyone back to the last
// checkpoint (dense, pec) or replays the failed stage alone (moevement). Failures during a
// recovery restart it.
trial_outcome run_trial(const policy_model& m, double mtbf_s, const failure_settings& f,
                        const std::vector<failure_event>& trace, std::uint64_t trial) {
  std::uint64_t counter = 0;
  std::size_t trace_next = 0;
  const auto next_failure = [&](double after) -> failure_event {
    if (!trace.empty()) {
      while (trace_next < trace.size() && trace[trace_next].time_s < after) ++trace_next;
      if (trace_next == trace.size()) return {std::numeric_limits<double>::infinity(), -1};
      return trace[trace_next++];
    }
    const double u = counter_uniform(f.seed, trial, counter++);
    return {after - mtbf_s * std::log(u), -1};
  };
  const auto pick_stage = [&](int given) {
    if (given >= 0) return given % m.stages;
    const double u = counter_uniform(f.seed, trial, counter++);
    return std::min(m.stages - 1, static_cast<int>(u * m.stages));
  };

  const double t_iter = m.iteration_s;
  const bool dense = m.kind == policy_kind::dense_disk || m.kind == policy_kind::dense_memory;
  trial_outcome out;
  double t = 0;
  // A checkpoint (dense) or window (moevement) counts only once it is persisted, persist_lag_s
  // after the iteration that completed it; until then a failure falls back to the previous one.
  struct pending_checkpoint {
    std::int64_t progress;
    double valid_at;
  };
  std::deque<pending_checkpoint> pending;
  std::int64_t valid = 0;         // latest persisted checkpoint or window end
  std::int64_t dense_anchor = 0;  // moevement: a dense state (start, or after a recovery)
  // With drawn lags a later checkpoint can become recoverable before an earlier one; the newest
  // recoverable one counts, and the older ones still pending are no use any more.
  const auto promote = [&](double now) {
    for (const auto& c : pending) {
      if (c.valid_at <= now) valid = std::max(valid, c.progress);
    }
    while (!pending.empty() && pending.front().progress <= valid) pending.pop_front();
  };
  // Each checkpoint's lag drawn from the measured ones, on a stream of its own so that the
  // failures drawn are the same as without samples.
  std::uint64_t lag_counter = 0;
  const auto draw_lag = [&]() {
    const auto& v = m.persist_lag_samples_s;
    const double u = counter_uniform(f.seed, trial | (std::uint64_t{1} << 63), lag_counter++);
    return v[std::min(v.size() - 1, static_cast<std::size_t>(u * static_cast<double>(v.size())))];
  };
  std::int64_t progress = 0;
  std::size_t pec_level = 0;
  double lost_tokens = 0, stall_total = 0;
  std::int64_t iterations_run = 0;
  auto fail = next_failure(0);
  while (t < f.duration_s) {
    double stall = 0;
    if (dense) {
      if ((progress + 1) % m.interval == 0) stall = m.stall_s;
    } else if (m.kind == policy_kind::pec) {
      if ((progress + 1) % m.interval == 0) stall = m.pec_stall_s[pec_level];
    } else {
      stall = m.stall_s;
    }
    // The coordinator's dispatch between iterations: wall time, not training.
    stall += m.dispatch_s;
    const double end = t + t_iter + stall;
    if (end <= fail.time_s) {
      if (end > f.duration_s) break;
      t = end;
      ++progress;
      ++iterations_run;
      stall_total += stall;
      const std::int64_t every = m.kind == policy_kind::moevement ? m.w_sparse : m.interval;
      if (progress % every == 0) {
        double lag = m.persist_lag_s;
        if (m.kind == policy_kind::pec)
          lag = m.pec_snapshot_s[pec_level];
        else if (!m.persist_lag_samples_s.empty())
          lag = draw_lag();
        pending.push_back({progress, t + lag});
      }
      promote(t);
      continue;
    }
    if (fail.time_s >= f.duration_s) break;
    // A failure aborts the running iteration.
    ++out.failures;
    const int stage = pick_stage(fail.stage);
    promote(fail.time_s);
    pending.clear();  // snapshots in flight die with the failure
    double work = 0;  // recomputation after restart and load
    if (m.kind == policy_kind::moevement) {
      // The failed stage converts the last persisted window (W replayed iterations with frozen
      // operators turning active) and catches up to the others; with no window since the last
      // dense state it replays from that state.
      const auto s = static_cast<std::size_t>(stage);
      if (valid > dense_anchor) {
        // Slots were taken after iterations valid-W+1 .. valid. Loading slot j and replaying the
        // next iteration activates slot j's operators; after slot W-1 every operator is active,
        // so the window costs W-1 conversion iterations and the rest are all-active catch-up.
        for (int j = 0; j + 1 < m.w_sparse; ++j)
          work += m.conversion_s[s][static_cast<std::size_t>(j)];
        work += static_cast<double>(progress - valid) * m.catch_up_s[s];
      } else {
        work = static_cast<double>(progress - dense_anchor) * m.catch_up_s[s];
      }
      dense_anchor = progress;
    } else {
      // Global rollback: the lost iterations are redone below as ordinary iterations; they count
      // as recovery time.
      const std::int64_t lost = progress - valid;
      progress = valid;
      out.recovery_s += static_cast<double>(lost) * t_iter;
      out.recompute_s += static_cast<double>(lost) * t_iter;
      if (m.kind == policy_kind::pec) {
        const double age = (static_cast<double>(m.experts) / m.pec_k[pec_level] - 1) / 2;
        lost_tokens +=
            age * (m.pec_node_fraction * m.pec_persist_interval + (1 - m.pec_node_fraction));
        if (lost_tokens / std::max<double>(1, static_cast<double>(progress)) > m.pec_plt_budget &&
            pec_level + 1 < m.pec_k.size())
          ++pec_level;
      }
    }
    const double restart = restart_for(m, stage);
    double resume = fail.time_s + restart + m.load_s + work;
    double recompute = fail.time_s - t + work;  // the aborted iteration and the replay
    fail = next_failure(fail.time_s);
    while (fail.time_s < resume && fail.time_s < f.duration_s) {
      // A failure during recovery restarts it (same scope, same replay).
      ++out.failures;
      // Replay done before this failure is lost again.
      recompute += std::max(0.0, fail.time_s - (resume - work));
      resume = fail.time_s + restart + m.load_s + work;
      fail = next_failure(fail.time_s);
    }
    out.recompute_s += recompute;
    out.recovery_s += std::min(resume, f.duration_s) - t;  // includes the aborted iteration
    t = resume;
  }
  out.ettr = static_cast<double>(progress) * t_iter / f.duration_s;
  out.overhead_s_per_iter =
      iterations_run > 0 ? stall_total / static_cast<double>(iterations_run) : 0;
  return out;
}

}  // namespace

monte_carlo_result monte_carlo(const policy_model& m, double mtbf_s, const failure_settings& f,
                               const std::vector<failure_event>& trace) {
  require(f.trials >= 1, "failures.trials must be at least 1");
  require(f.duration_s > 0, "failures.duration_hours must be positive");
  require(mtbf_s > 0 || !trace.empty(), "failures.mtbf_minutes must be positive");
  require(m.iteration_s > 0, "iteration time must be positive");
  std::vector<double> e;
  monte_carlo_result r;
  r.trials = f.trials;
  for (int i = 0; i < f.trials; ++i) {
    const auto o = run_trial(m, mtbf_s, f, trace, static_cast<std::uint64_t>(i));
    e.push_back(o.ettr);
    r.failures_mean += o.failures;
    r.recovery_s_mean += o.recovery_s;
    r.recompute_s_mean += o.recompute_s;
    r.overhead_s_per_iter_mean += o.overhead_s_per_iter;
  }
  const double n = f.trials;
  r.failures_mean /= n;
  r.recovery_s_mean /= n;
  r.recompute_s_mean /= n;
  r.overhead_s_per_iter_mean /= n;
  double sum = 0;
  for (double x : e) sum += x;
  r.ettr_mean = sum / n;
  double sq = 0;
  for (double x : e) sq += (x - r.ettr_mean) * (x - r.ettr_mean);
  r.ettr_std = f.trials > 1 ? std::sqrt(sq / (n - 1)) : 0;
  std::sort(e.begin(), e.end());
  const auto q = [&](double p) { return e[static_cast<std::size_t>(std::lround(p * (n - 1)))]; };
  r.ettr_min = e.front();
  r.ettr_max = e.back();
  r.ettr_p05 = q(0.05);
  r.ettr_p50 = q(0.5);
  r.ettr_p95 = q(0.95);
  return r;
}

double window_ettr(double overhead, int w, double iteration_s, double restart_s, double mtbf_s) {
  const double recovery_s = restart_s + 1.5 * double(std::max(w, 1)) * iteration_s;
  return 1.0 / (1.0 + overhead) / (1.0 + recovery_s / mtbf_s);
}

}  // namespace moevement::sim
