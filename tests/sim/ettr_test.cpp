#include "sim/ettr.hpp"

#include <gtest/gtest.h>

#include <cmath>

namespace moevement::sim {
namespace {

model_inputs gpt_moe_inputs() {
  model_inputs in;
  in.model = paper_model("gpt-moe");
  in.plan = {3, 4, 8, 512, 32, true};
  return in;
}

struct fixture {
  model_inputs in = gpt_moe_inputs();
  failure_settings f;
  iteration_costs costs;
  explicit fixture(double snapshot_gb_per_s = 0) {
    in.cluster.snapshot_bytes_per_s = snapshot_gb_per_s * 1e9;
    f.trials = 60;
    costs = estimate_iteration(in.model, in.cluster, in.plan, in.constants, 2);
  }
  policy_model build(policy_kind k, double mtbf, interval_rule rule = interval_rule::young,
                     int fixed = 1) const {
    policy_settings p;
    p.kind = k;
    p.rule = rule;
    p.fixed_interval = fixed;
    return build_policy(in, costs, p, f, mtbf);
  }
};

TEST(ettr, iteration_time_follows_one_f_one_b) {
  const fixture x;
  double worst = 0;
  for (const auto& s : x.costs.stages) worst = std::max(worst, s.microbatch_s);
  EXPECT_EQ(x.costs.microbatches, 512 / (32 * 4));
  EXPECT_DOUBLE_EQ(x.costs.pipeline_s, (x.costs.microbatches + 3 - 1) * worst);
  EXPECT_DOUBLE_EQ(x.costs.iteration_s, x.costs.pipeline_s + x.costs.sync_s + x.costs.update_s);
  EXPECT_NEAR(x.costs.total_params, total_params(x.in.model), 1);
}

TEST(ettr, collectives_are_affine_in_message_size) {
  const double a = ring_allreduce_s(1e6, 8, 1e9, 1e-5);
  const double b = ring_allreduce_s(2e6, 8, 1e9, 1e-5);
  const double c = ring_allreduce_s(3e6, 8, 1e9, 1e-5);
  EXPECT_NEAR(c - b, b - a, 1e-12);                   // beta(p) x m
  EXPECT_NEAR(a - (b - a), 2 * 7 * 1e-5, 1e-12);      // alpha(p) = 2 (p - 1) alpha
  EXPECT_EQ(ring_allreduce_s(1e6, 1, 1e9, 1e-5), 0);  // nothing to reduce alone
}

// pec's K grows with the failures actually seen, so its "closed form" (failures at their
// expected times) is only comparable with Monte Carlo while the budget is not exhausted.
TEST(ettr, closed_form_and_monte_carlo_agree_within_spread) {
  const fixture x(0.2);  // slow snapshots: every policy pays something
  for (auto k : {policy_kind::dense_disk, policy_kind::dense_memory, policy_kind::pec,
                 policy_kind::moevement}) {
    for (double mtbf : {3600.0, 600.0}) {
      policy_settings p;
      p.kind = k;
      p.rule = interval_rule::oracle;
      p.pec_plt_budget = 1e9;
      const auto m = build_policy(x.in, x.costs, p, x.f, mtbf);
      const auto cf = evaluate_closed_form(m, mtbf, x.f.duration_s);
      const auto mc = monte_carlo(m, mtbf, x.f);
      // The closed form is first order in 1/MTBF; allow its error on top of 3 standard errors.
      const double tolerance = 3 * mc.stderr_mean() + 0.25 * (1 - cf.ettr) + 0.002;
      EXPECT_NEAR(cf.ettr, mc.ettr_mean, tolerance) << policy_name(k) << " mtbf " << mtbf;
      EXPECT_GE(cf.ettr, mc.ettr_p05 - 0.01) << policy_name(k);
      EXPECT_LE(cf.ettr, mc.ettr_p95 + 0.01) << policy_name(k);
      EXPECT_NEAR(mc.failures_mean, x.f.duration_s / mtbf, 0.15 * x.f.duration_s / mtbf + 1);
    }
  }
}

// Our engine's pec checkpoints every k iterations (MoC: k = 1): the stall is paid once per
// checkpoint, and a rollback goes back to the newest one.
TEST(ettr, pec_at_an_interval_pays_its_stall_once_per_checkpoint) {
  const fixture x(0.01);  // so slow that pec's first K stalls too
  policy_settings p;
  p.kind = policy_kind::pec;
  p.pec_plt_budget = 1e9;
  p.pec_interval = 4;
  const auto m = build_policy(x.in, x.costs, p, x.f, 3600);
  ASSERT_EQ(m.interval, 4);
  ASSERT_GT(m.pec_stall_s.front(), 0);
  const double never = 1e15;
  const auto cf = evaluate_closed_form(m, never, x.f.duration_s);
  EXPECT_NEAR(cf.overhead_s_per_iter, m.pec_stall_s.front() / 4, 1e-12);
  const auto mc = monte_carlo(m, never, x.f);
  EXPECT_NEAR(mc.overhead_s_per_iter_mean, m.pec_stall_s.front() / 4,
              m.pec_stall_s.front() * 4 / (x.f.duration_s / m.iteration_s));
  for (double mtbf : {3600.0, 600.0}) {
    const auto c = evaluate_closed_form(m, mtbf, x.f.duration_s);
    const auto r = monte_carlo(m, mtbf, x.f);
    EXPECT_NEAR(c.ettr, r.ettr_mean, 3 * r.stderr_mean() + 0.25 * (1 - c.ettr) + 0.002) << mtbf;
  }
  p.pec_interval = 0;
  EXPECT_THROW(build_policy(x.in, x.costs, p, x.f, 3600), std::invalid_argument);
}

TEST(ettr, infinite_mtbf_gives_the_fault_free_overhead) {
  const fixture x(0.2);
  const double never = 1e15;
  for (auto k : {policy_kind::dense_memory, policy_kind::moevement, policy_kind::pec}) {
    const auto m = x.build(k, never, interval_rule::fixed, 5);
    const auto cf = evaluate_closed_form(m, never, x.f.duration_s);
    EXPECT_NEAR(cf.ettr, 1 / (1 + cf.overhead_fraction), 1e-9) << policy_name(k);
    const auto mc = monte_carlo(m, never, x.f);
    EXPECT_EQ(mc.failures_mean, 0);
    // Whole iterations only: the run ends inside one iteration.
    EXPECT_NEAR(mc.ettr_mean, cf.ettr, (m.iteration_s + m.stall_s) / x.f.duration_s + 1e-9)
        << policy_name(k);
  }
}

TEST(ettr, zero_checkpoint_cost_and_frequent_checkpoints_give_ettr_near_one) {
  fixture x(1e6);  // snapshots are free
  x.f.restart_s = 0;
  x.in.cluster.storage_bytes_per_s = 1e18;
  x.in.cluster.inter_node_bytes_per_s = 1e18;
  x.in.cluster.host_device_bytes_per_s = 1e18;
  for (auto k : {policy_kind::dense_memory, policy_kind::moevement}) {
    const auto m = x.build(k, 3600, interval_rule::fixed, 1);
    EXPECT_EQ(m.stall_s, 0);
    const auto cf = evaluate_closed_form(m, 3600, x.f.duration_s);
    EXPECT_GT(cf.ettr, 0.99) << policy_name(k);
    EXPECT_GT(monte_carlo(m, 3600, x.f).ettr_mean, 0.99) << policy_name(k);
  }
}

TEST(ettr, youngs_interval_is_the_argmax_of_the_closed_form) {
  fixture x(0.2);
  x.f.restart_s = 0;
  for (double mtbf : {600.0, 1800.0, 7200.0}) {
    const auto young = x.build(policy_kind::dense_memory, mtbf, interval_rule::young);
    ASSERT_GT(young.stall_s, 0);
    const int best = oracle_interval(young, mtbf, x.f.duration_s);
    auto at = [&](int k) {
      auto m = young;
      m.interval = k;
      return evaluate_closed_form(m, mtbf, x.f.duration_s).ettr;
    };
    // Young's first-order optimum lands on (or next to) the exact argmax.
    EXPECT_LE(std::abs(young.interval - best), std::max(1, best / 10)) << "mtbf " << mtbf;
    EXPECT_NEAR(at(young.interval), at(best), 2e-3);
    EXPECT_GE(at(best), at(best - 1));
    EXPECT_GE(at(best), at(best + 1));
    // The oracle rule returns that argmax.
    EXPECT_EQ(x.build(policy_kind::dense_memory, mtbf, interval_rule::oracle).interval, best);
  }
}

TEST(ettr, overhead_cap_picks_the_shortest_interval_under_the_cap) {
  const fixture x(0.2);
  policy_settings p;
  p.kind = policy_kind::dense_memory;
  p.rule = interval_rule::cap;
  p.overhead_cap = 0.03;
  const auto m = build_policy(x.in, x.costs, p, x.f, 3600);
  EXPECT_LE(m.stall_s / (m.interval * m.iteration_s), 0.03);
  EXPECT_GT(m.stall_s / ((m.interval - 1) * m.iteration_s), 0.03);
}

TEST(ettr, moevement_replays_between_w_and_two_w_local_iterations) {
  const fixture x(0.2);
  const auto m = x.build(policy_kind::moevement, 600);
  ASSERT_GT(m.w_sparse, 1);
  ASSERT_EQ(m.conversion_s.size(), 3u);
  for (std::size_t s = 0; s < m.conversion_s.size(); ++s) {
    ASSERT_EQ(m.conversion_s[s].size(), static_cast<std::size_t>(m.w_sparse));
    // Conversion iterations get dearer as operators turn active; never dearer than all-active.
    for (int j = 1; j < m.w_sparse; ++j) {
      EXPECT_LE(m.conversion_s[s][static_cast<std::size_t>(j - 1)],
                m.conversion_s[s][static_cast<std::size_t>(j)]);
    }
    EXPECT_DOUBLE_EQ(m.conversion_s[s].back(), m.catch_up_s[s]);
    // Localized replay has no pipeline bubble: cheaper than a global iteration.
    EXPECT_LT(m.catch_up_s[s], m.iteration_s);
  }
  const auto cf = evaluate_closed_form(m, 600, x.f.duration_s);
  const double fixed = m.restart_s + m.load_s + 0.5 * m.iteration_s;
  double lo = 1e300, hi = 0;
  for (std::size_t s = 0; s < m.conversion_s.size(); ++s) {
    lo = std::min(lo, (m.w_sparse - 1) * m.conversion_s[s].front());
    hi = std::max(hi, 2.0 * m.w_sparse * m.catch_up_s[s]);
  }
  EXPECT_GE(cf.expected_recovery_s - fixed, lo);
  EXPECT_LE(cf.expected_recovery_s - fixed, hi);
}

TEST(ettr, pec_doubles_k_when_the_lost_token_budget_runs_out) {
  fixture x(0.2);
  policy_settings p;
  p.kind = policy_kind::pec;
  p.pec_plt_budget = 1e-4;
  const auto tight = build_policy(x.in, x.costs, p, x.f, 600);
  ASSERT_GT(tight.pec_k.size(), 1u);
  EXPECT_EQ(tight.pec_k.back(), x.in.model.experts);
  p.pec_plt_budget = 1e6;
  const auto loose = build_policy(x.in, x.costs, p, x.f, 600);
  const auto a = evaluate_closed_form(tight, 600, x.f.duration_s);
  const auto b = evaluate_closed_form(loose, 600, x.f.duration_s);
  EXPECT_GT(a.overhead_s_per_iter, b.overhead_s_per_iter);
  EXPECT_DOUBLE_EQ(b.overhead_s_per_iter, loose.pec_stall_s.front());
  EXPECT_GT(monte_carlo(tight, 600, x.f).overhead_s_per_iter_mean,
            monte_carlo(loose, 600, x.f).overhead_s_per_iter_mean);
}

TEST(ettr, monte_carlo_is_reproducible_from_its_seed) {
  fixture x(0.2);
  const auto m = x.build(policy_kind::moevement, 900);
  const auto a = monte_carlo(m, 900, x.f);
  const auto b = monte_carlo(m, 900, x.f);
  EXPECT_EQ(a.ettr_mean, b.ettr_mean);
  EXPECT_EQ(a.ettr_std, b.ettr_std);
  EXPECT_EQ(a.recovery_s_mean, b.recovery_s_mean);
  x.f.seed = 2;
  EXPECT_NE(monte_carlo(m, 900, x.f).ettr_mean, a.ettr_mean);
  EXPECT_EQ(counter_uniform(7, 3, 11), counter_uniform(7, 3, 11));
  double sum = 0;
  for (std::uint64_t i = 0; i < 10000; ++i) {
    const double u = counter_uniform(1, 0, i);
    ASSERT_GT(u, 0);
    ASSERT_LT(u, 1);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.01);
}

TEST(ettr, a_trace_is_replayed_as_given) {
  fixture x(0.2);
  const auto trace = parse_failure_trace("# time stage\n600 0\n1800\n\n3600 2  # last\n");
  ASSERT_EQ(trace.size(), 3u);
  EXPECT_EQ(trace[1].stage, -1);
  x.f.duration_s = 7200;
  const auto m = x.build(policy_kind::dense_memory, 2400, interval_rule::fixed, 10);
  const auto r = monte_carlo(m, 2400, x.f, trace);
  EXPECT_EQ(r.failures_mean, 3);
  EXPECT_NEAR(r.ettr_std, 0, 1e-12);  // dense recovery does not depend on the drawn stage
  EXPECT_THROW(parse_failure_trace("10\nfive\n"), std::invalid_argument);
  EXPECT_THROW(parse_failure_trace("10\n5\n"), std::invalid_argument);  // not sorted
  for (const char* bad : {"10 -1\n", "10 1.5\n", "10 1 extra\n", "10 x\n"}) {
    EXPECT_THROW(parse_failure_trace(bad), std::invalid_argument) << bad;  // the stage field
  }
}

TEST(ettr, unknown_names_are_errors) {
  EXPECT_THROW(parse_policy("gemini"), std::invalid_argument);
  EXPECT_THROW(parse_interval_rule("daly"), std::invalid_argument);
  EXPECT_THROW(paper_model("gpt-5"), std::invalid_argument);
  model_inputs in = gpt_moe_inputs();
  in.plan.ep = 5;
  EXPECT_THROW(estimate_iteration(in.model, in.cluster, in.plan, in.constants, 2),
               std::invalid_argument);
}

TEST(ettr, paper_models_match_table_two) {
  for (const char* name : {"moe-llava", "gpt-moe", "qwen-moe", "deepseek-moe", "deepseek-32b",
                           "deepseek-67b", "deepseek-145b", "deepseek-671b"}) {
    const auto m = paper_model(name);
    EXPECT_NEAR(total_params(m) / m.nominal_total_params, 1.0, 0.05) << name;
    if (m.nominal_active_params > 0 && m.name != "deepseek-671b") {
      EXPECT_NEAR(active_params(m) / m.nominal_active_params, 1.0, 0.15) << name;
    }
  }
}

}  // namespace
}  // namespace moevement::sim

namespace moevement::sim {
namespace {

TEST(ettr, moevement_stalls_only_when_two_active_operators_do_not_fit) {
  const fixture fast(0.2);
  EXPECT_EQ(fast.build(policy_kind::moevement, 600).stall_s, 0);
  const fixture slow(1e-4);  // 0.1 MB/s: nothing fits
  const auto m = slow.build(policy_kind::moevement, 600);
  EXPECT_GT(m.stall_s, 0);
  EXPECT_GT(evaluate_closed_form(m, 600, slow.f.duration_s).overhead_fraction, 0);
  // W_sparse = ceil(operators / 2) for the stage with the most operators.
  std::size_t most = 0;
  for (const auto& s : slow.costs.stages) most = std::max(most, s.ops.size());
  EXPECT_EQ(m.w_sparse, static_cast<int>((most + 1) / 2));
}

// Section 3.5: deferring popular experts keeps them frozen longer during conversion, so the
// ascending-popularity order replays cheaper than the opposite order when popularity is skewed.
TEST(ettr, popularity_order_makes_conversion_cheaper) {
  model_inputs in = gpt_moe_inputs();
  in.constants.expert_popularity_zipf = 1.0;
  const auto costs = estimate_iteration(in.model, in.cluster, in.plan, in.constants, 2);
  const auto& stage = costs.stages[1];
  const auto ascending = order_by_popularity(stage.snapshot);
  const std::vector<std::size_t> descending(ascending.rbegin(), ascending.rend());
  const auto conversion = [&](const std::vector<std::size_t>& order) {
    const int w = 4;
    const int a = static_cast<int>((order.size() + w - 1) / w);
    const auto schedule = generate_schedule(order, w, a);
    double total = 0;
    for (int j = 0; j + 1 < w; ++j) {
      total += local_replay_iteration_s(stage, active_after_slot(schedule, order.size(), j),
                                        costs.microbatches, in.constants);
    }
    return total;
  };
  EXPECT_LT(conversion(ascending), conversion(descending));
}

}  // namespace
// A measured lag distribution: equal samples behave exactly like the single value (the failures
// drawn stay the same: the lags have their own random stream); a tail costs more rollbacks, in
// the Monte Carlo run as in the closed form's E[min(lag, k T)].
TEST(ettr, persist_lag_samples_model_the_tail_of_the_lag) {
  const fixture x(0.2);
  auto single = x.build(policy_kind::dense_disk, 3600, interval_rule::fixed, 20);
  single.persist_lag_s = 0.5;
  auto same = single;
  same.persist_lag_samples_s.assign(7, 0.5);
  const double mtbf = 1800;
  const auto a = monte_carlo(single, mtbf, x.f), b = monte_carlo(same, mtbf, x.f);
  EXPECT_EQ(a.ettr_mean, b.ettr_mean);
  EXPECT_EQ(a.failures_mean, b.failures_mean);
  EXPECT_EQ(evaluate_closed_form(single, mtbf, x.f.duration_s).ettr,
            evaluate_closed_form(same, mtbf, x.f.duration_s).ettr);
  // Half the checkpoints take a whole interval to persist: more recomputation.
  const double span = single.interval * single.iteration_s;
  auto tail = same;
  tail.persist_lag_samples_s = {0.5, 0.5, 0.5, 2 * span};
  EXPECT_DOUBLE_EQ(expected_persist_penalty_s(tail, span), (3 * 0.5 + span) / 4);
  EXPECT_DOUBLE_EQ(expected_persist_penalty_s(single, span), 0.5);
  const auto c = monte_carlo(tail, mtbf, x.f);
  EXPECT_EQ(c.failures_mean, a.failures_mean);
  EXPECT_GT(c.recompute_s_mean, a.recompute_s_mean);
  const auto cf_single = evaluate_closed_form(single, mtbf, x.f.duration_s);
  const auto cf_tail = evaluate_closed_form(tail, mtbf, x.f.duration_s);
  EXPECT_NEAR(cf_tail.expected_recompute_s - cf_single.expected_recompute_s, (span - 0.5) / 4,
              1e-9);
}

}  // namespace moevement::sim
