// MoC-System's PEC: which experts each checkpoint saves (sequential, load-aware), the stale
// experts a recovery restores (each at its own last save, checked against digests recorded
// in the fault-free run), and PLT: 0 when nothing is lost, hand-computed otherwise.
#include "recovery/pec_capture.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <memory>

#include "engine/local_pipeline.hpp"
#include "recovery/baseline_policy.hpp"
#include "recovery/baseline_recovery.hpp"
#include "tests/support/small_train.hpp"

namespace moevement::recovery {
namespace {

constexpr int pp = 2, dp = 2;

models::train_config test_train() {
  return test_support::test_train(dp);
}

// What the test checks against, recorded independently of the capture: each gate's routed
// counts per iteration, and every operator's digest at the start of each iteration.
struct recorder : engine::stage_hooks {
  engine::stage_hooks* inner = nullptr;
  // [iteration][gate operator index] -> routed counts of this replica
  std::map<std::int64_t, std::map<std::size_t, std::vector<std::int64_t>>> routed;
  std::map<std::int64_t, std::vector<std::uint64_t>> digests;  // [state iteration]
  void after_step(std::int64_t iteration, std::span<models::operator_state* const> ops) override {
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i]->kind() == models::op_kind::gate) routed[iteration][i] = ops[i]->routed_tokens();
    }
    digests[iteration + 1] = engine::operator_digests(ops);
    if (inner) inner->after_step(iteration, ops);
  }
};

struct pec_job {
  models::model_config model = models::preset("tiny");
  models::train_config train = test_train();
  engine::local_pipeline pipe{model, train, pp};
  std::vector<std::unique_ptr<pec_schedule>> schedules;  // [stage]
  std::vector<std::unique_ptr<pec_capture>> caps;        // [replica * pp + stage]
  std::vector<std::unique_ptr<recorder>> recs;           // [replica * pp + stage]

  pec_job(int experts, pec_selection order, int interval) {
    for (int s = 0; s < pp; ++s) {
      schedules.push_back(
          std::make_unique<pec_schedule>(experts, order, interval, pipe.stage(s, 0).operators()));
    }
    for (int d = 0; d < dp; ++d) {
      for (int s = 0; s < pp; ++s) {
        caps.push_back(
            std::make_unique<pec_capture>(*schedules[std::size_t(s)], s, d, &pipe.scaler()));
        recs.push_back(std::make_unique<recorder>());
        recs.back()->inner = caps.back().get();
        recs.back()->digests[0] = engine::operator_digests(pipe.stage(s, d).operators());
        pipe.set_hooks(s, d, recs.back().get());
      }
    }
  }
  recorder& rec(int s, int d) { return *recs[std::size_t(d * pp + s)]; }
  std::vector<const pec_capture*> survivors() const {
    std::vector<const pec_capture*> out;
    for (const auto& c : caps) out.push_back(c.get());
    return out;
  }
  void train_to(int iteration) {
    while (pipe.iteration() < iteration) pipe.train_iteration();
  }
  // tokens routed to expert j of the gate at op index `gate` of stage s, iterations [a, b)
  std::int64_t routed(int s, std::size_t gate, std::size_t j, std::int64_t a, std::int64_t b) {
    std::int64_t n = 0;
    for (int d = 0; d < dp; ++d) {
      for (std::int64_t it = a; it < b; ++it) n += rec(s, d).routed.at(it).at(gate)[j];
    }
    return n;
  }
};

std::vector<std::size_t> saved_experts(const pec_schedule& sched,
                                       const std::vector<capture_kind>& kinds, std::size_t layer) {
  std::vector<std::size_t> out;
  const auto& experts = sched.layers()[layer].experts;
  for (std::size_t j = 0; j < experts.size(); ++j) {
    if (kinds[experts[j]] == capture_kind::full) out.push_back(j);
  }
  return out;
}

TEST(pec_schedule, sequential_takes_k_experts_round_robin_per_layer) {
  engine::local_pipeline pipe(models::preset("tiny"), test_train(), pp);
  const auto ops = pipe.stage(1, 0).operators();
  pec_schedule one(1, pec_selection::sequential, 1, ops);
  ASSERT_EQ(one.layers().size(), 2u);  // tiny: 4 layers, 2 per stage, 4 experts each
  ASSERT_EQ(one.layers()[0].experts.size(), 4u);
  EXPECT_EQ(one.layers()[1].name, "layer3.gate");
  for (std::int64_t it = 0; it < 6; ++it) {
    const auto& kinds = one.checkpoint_kinds(it);
    // checkpoint n, layer l: expert (n + l) mod 4
    EXPECT_EQ(saved_experts(one, kinds, 0), (std::vector<std::size_t>{std::size_t(it % 4)}));
    EXPECT_EQ(saved_experts(one, kinds, 1), (std::vector<std::size_t>{std::size_t((it + 1) % 4)}));
    for (std::size_t i = 0; i < ops.size(); ++i) {  // every non-expert in full, every time
      if (ops[i]->kind() != models::op_kind::expert) {
        EXPECT_EQ(kinds[i], capture_kind::full);
      }
    }
  }
  pec_schedule two(2, pec_selection::sequential, 3, ops);
  EXPECT_THROW(two.checkpoint_kinds(3), std::invalid_argument);  // not a checkpoint point
  EXPECT_EQ(saved_experts(two, two.checkpoint_kinds(2), 0), (std::vector<std::size_t>{0, 1}));
  EXPECT_EQ(saved_experts(two, two.checkpoint_kinds(5), 0), (std::vector<std::size_t>{2, 3}));
  EXPECT_EQ(saved_experts(two, two.checkpoint_kinds(5), 1), (std::vector<std::size_t>{0, 3}));
  EXPECT_EQ(two.saved_at(two.layers()[0].experts[2]), 6);
  EXPECT_EQ(two.saved_at(two.layers()[0].experts[0]), 3);
  pec_schedule all(9, pec_selection::sequential, 1, ops);  // K > E: every expert
  const auto& k = all.checkpoint_kinds(0);
  EXPECT_TRUE(std::ranges::all_of(k, [](capture_kind c) { return c == capture_kind::full; }));
  EXPECT_THROW(pec_schedule(0, pec_selection::sequential, 1, ops), std::invalid_argument);
}

// Expert parallelism: each EP rank holds a block of each layer's experts; its schedule selects
// over the layer's experts as the whole stage's does and marks the selected ones it holds.
// Together the ranks save exactly what ep = 1 saves. Load-aware (it ranks experts a rank does
// not count) is refused.
TEST(pec_schedule, expert_parallel_ranks_save_together_what_one_worker_saves) {
  engine::local_pipeline whole(models::preset("tiny"), test_train(), pp);
  auto train = test_train();
  train.expert_parallel = 2;
  engine::local_pipeline sharded(models::preset("tiny"), train, pp);
  pec_schedule one(1, pec_selection::sequential, 2, whole.stage(1, 0).operators());
  std::vector<std::unique_ptr<pec_schedule>> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.push_back(std::make_unique<pec_schedule>(1, pec_selection::sequential, 2,
                                                   sharded.stage(1, r).operators(),
                                                   models::expert_split{r, 2}));
    ASSERT_EQ(ranks.back()->layers().size(), 2u);
    EXPECT_EQ(ranks.back()->layers()[0].experts.size(), 2u);  // of 4
    EXPECT_EQ(ranks.back()->layers()[0].first, std::size_t(2 * r));
    EXPECT_EQ(ranks.back()->layers()[0].total, 4u);
  }
  for (std::int64_t it = 1; it < 12; it += 2) {
    const auto& kinds = one.checkpoint_kinds(it);
    for (std::size_t l = 0; l < 2; ++l) {
      std::vector<std::size_t> together;
      for (const auto& rank : ranks) {
        for (auto j : saved_experts(*rank, rank->checkpoint_kinds(it), l)) {
          together.push_back(rank->layers()[l].first + j);
        }
      }
      EXPECT_EQ(together, saved_experts(one, kinds, l)) << "iteration " << it << " layer " << l;
    }
  }
  EXPECT_THROW(pec_schedule(1, pec_selection::load_aware, 2, sharded.stage(1, 0).operators(),
                            models::expert_split{0, 2}),
               std::invalid_argument);
}

TEST(pec_schedule, load_aware_takes_the_most_unsaved_tokens) {
  pec_job job(1, pec_selection::load_aware, 2);
  job.train_to(9);  // checkpoints after steps 1, 3, 5, 7
  int differs = 0;  // experts whose last save is not the sequential order's
  for (int s = 0; s < pp; ++s) {
    const auto& sched = *job.schedules[std::size_t(s)];
    // replay the selection from the recorded counts: after step i, the expert with the most
    // tokens in [its last save, i), ties to the sequential order
    for (std::size_t l = 0; l < sched.layers().size(); ++l) {
      const auto& layer = sched.layers()[l];
      std::vector<std::int64_t> saved(layer.experts.size(), 0);
      for (std::int64_t i = 1; i < 9; i += 2) {
        const std::int64_t n = (i + 1) / 2 - 1;
        std::size_t best = 0;
        std::int64_t best_count = -1;
        for (std::size_t r = 0; r < layer.experts.size(); ++r) {
          const std::size_t j = (std::size_t(n) + l + r) % layer.experts.size();
          const auto c = job.routed(s, layer.gate, j, saved[j], i);
          if (c > best_count) best = j, best_count = c;
        }
        saved[best] = i + 1;
      }
      for (std::size_t j = 0; j < layer.experts.size(); ++j) {
        // sequential would have saved expert (n + l) mod 4 last at 2 (n + 1)
        std::int64_t seq = 0;
        for (std::int64_t n = 0; n < 4; ++n) {
          if ((std::size_t(n) + l) % 4 == j) seq = 2 * (n + 1);
        }
        differs += saved[j] != seq ? 1 : 0;
        EXPECT_EQ(sched.saved_at(layer.experts[j]), saved[j])
            << "stage " << s << " layer " << l << " expert " << j;
      }
    }
  }
  EXPECT_GT(differs, 0) << "load-aware chose exactly what sequential would have";
}

TEST(pec_recovery, saving_every_expert_loses_no_token_and_is_bit_exact) {
  engine::local_pipeline reference(models::preset("tiny"), test_train(), pp);
  for (int i = 0; i < 9; ++i) reference.train_iteration();
  pec_job job(4, pec_selection::sequential, 3);
  job.train_to(7);  // fault in iteration 7; newest checkpoint: state 6
  engine::local_pipeline fresh(job.model, job.train, pp);
  const auto rep = recover_pec(fresh, job.survivors(), 7, job.model, job.train);
  EXPECT_EQ(rep.iteration, 6);
  EXPECT_EQ(rep.stale_experts, 0u);
  EXPECT_EQ(rep.plt, 0.0);
  ASSERT_EQ(rep.lost_tokens.size(), 4u);
  for (auto n : rep.lost_tokens) EXPECT_EQ(n, 0);
  while (fresh.iteration() < 9) fresh.train_iteration();
  EXPECT_EQ(fresh.state_hash(), reference.state_hash());
}

// K = 1, every 2 iterations, sequential, fault in iteration 7: checkpoints at states 2, 4, 6
// (numbers 0, 1, 2), the job resumes at 6. Layer l of a stage saved expert (n + l) mod 4 at
// checkpoint n, so
//   l = 0: e0 at 2, e1 at 4, e2 at 6, e3 never      -> stale e0 [2,6), e1 [4,6), e3 [0,6)
//   l = 1: e1 at 2, e2 at 4, e3 at 6, e0 never      -> stale e1 [2,6), e2 [4,6), e0 [0,6)
TEST(pec_recovery, stale_experts_and_plt_on_a_hand_checked_case) {
  pec_job job(1, pec_selection::sequential, 2);
  job.train_to(7);
  engine::local_pipeline fresh(job.model, job.train, pp);
  const auto rep = recover_pec(fresh, job.survivors(), 7, job.model, job.train);
  EXPECT_EQ(rep.iteration, 6);
  EXPECT_EQ(rep.failed_at, 7);
  EXPECT_EQ(rep.stale_experts, 3u * 4u);  // 3 per layer, 4 layers
  ASSERT_EQ(rep.layers,
            (std::vector<std::string>{"layer0.gate", "layer1.gate", "layer2.gate", "layer3.gate"}));
  const std::int64_t saved[2][4] = {{2, 4, 6, 0}, {0, 2, 4, 6}};
  // tokens per layer: 2 micro-batches x 2 sequences x 16 tokens x 2 replicas x top-2 x 7
  EXPECT_EQ(rep.tokens_per_layer, 2 * 2 * 16 * 2 * 2 * 7);
  double plt = 0.0;
  for (int s = 0; s < pp; ++s) {
    const auto& sched = *job.schedules[std::size_t(s)];
    for (std::size_t l = 0; l < 2; ++l) {
      const auto& layer = sched.layers()[l];
      std::int64_t lost = 0;
      for (std::size_t j = 0; j < 4; ++j) {
        const auto at = saved[l][j];
        if (at < 6) lost += job.routed(s, layer.gate, j, at, 6);
        // each expert is back at its own save, every non-expert at 6 (recorded digests)
        for (int d = 0; d < dp; ++d) {
          EXPECT_EQ(fresh.stage(s, d).operators()[layer.experts[j]]->digest(),
                    job.rec(s, d).digests.at(at)[layer.experts[j]])
              << "stage " << s << " layer " << l << " expert " << j;
        }
      }
      EXPECT_GT(lost, 0);
      EXPECT_EQ(rep.lost_tokens[std::size_t(s) * 2 + l], lost) << "stage " << s << " layer " << l;
      plt += double(lost) / double(rep.tokens_per_layer);
    }
    const auto ops = fresh.stage(s, 1).operators();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i]->kind() != models::op_kind::expert) {
        EXPECT_EQ(ops[i]->digest(), job.rec(s, 1).digests.at(6)[i]) << ops[i]->name();
      }
    }
  }
  EXPECT_DOUBLE_EQ(rep.plt, plt / 4);
  EXPECT_GT(rep.plt, 0.0);
  // the run's PLT over the same fault and 7 iterations is the same number
  EXPECT_DOUBLE_EQ(proportion_of_lost_tokens(rep.lost_tokens, 4, 2 * 2 * 16 * 2 * 7, 2), rep.plt);
  // the recovered job trains on (stale experts, so not the fault-free bits)
  fresh.train_iteration();
  EXPECT_EQ(fresh.iteration(), 7);
}

TEST(pec_recovery, plt_formula_and_bad_inputs) {
  // 2 layers, 100 tokens, top-1: (10 + 30) lost over 200 = 0.2
  const std::vector<std::int64_t> lost{10, 30};
  EXPECT_DOUBLE_EQ(proportion_of_lost_tokens(lost, 2, 100, 1), 0.2);
  EXPECT_THROW(proportion_of_lost_tokens(lost, 0, 100, 1), std::invalid_argument);
  pec_job job(1, pec_selection::sequential, 4);
  job.train_to(2);  // no checkpoint yet
  engine::local_pipeline fresh(job.model, job.train, pp);
  EXPECT_THROW(recover_pec(fresh, job.survivors(), 2, job.model, job.train), rollback_error);
  job.train_to(5);
  // a used job instead of a fresh one: experts never saved would keep diverged state
  EXPECT_THROW(recover_pec(job.pipe, job.survivors(), 5, job.model, job.train), rollback_error);
}

TEST(pec_capture, memory_stays_bounded_and_buffers_are_reused) {
  pec_job job(1, pec_selection::sequential, 1);
  job.train_to(12);
  const auto bytes = job.caps[0]->bytes_held();
  const auto held = job.caps[0]->held().size();
  EXPECT_LE(held, 5u);  // at most E checkpoints + the one before
  job.train_to(30);
  EXPECT_EQ(job.caps[0]->held().size(), held);
  EXPECT_EQ(job.caps[0]->bytes_held(), bytes);
  EXPECT_EQ(job.caps[0]->checkpoints(), 30u);
}

// Under launch the counts come from the coordinator (popularity summed over replicas): the
// same counts as each replica's gates added up, and what a rollback to c loses per expert.
TEST(pec_schedule, popularity_counts_unsaved_tokens_and_restart) {
  engine::local_pipeline pipe(models::preset("tiny"), test_train(), pp);
  const auto ops = pipe.stage(0, 0).operators();
  pec_schedule a(1, pec_selection::sequential, 2, ops), b(1, pec_selection::sequential, 2, ops);
  for (std::int64_t it = 0; it < 4; ++it) {
    pipe.train_iteration();
    std::vector<double> pop(ops.size(), 0.0);
    for (int d = 0; d < dp; ++d) {
      a.add_counts(it, pipe.stage(0, d).operators());
      const auto p = engine::operator_popularity(pipe.stage(0, d).operators());
      for (std::size_t i = 0; i < p.size(); ++i) pop[i] += p[i];
    }
    b.add_popularity(it, pop);
    if (a.is_checkpoint(it)) {
      EXPECT_EQ(a.checkpoint_kinds(it), b.checkpoint_kinds(it));
    }
  }
  const auto unsaved = b.unsaved_tokens(4);
  EXPECT_EQ(unsaved, a.unsaved_tokens(4));
  std::int64_t stale_tokens = 0;
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const bool expert = a.saved_at(i) < 4 && ops[i]->kind() == models::op_kind::expert;
    if (!expert) {
      EXPECT_EQ(unsaved[i], 0) << i;
      continue;
    }
    EXPECT_EQ(unsaved[i], a.routed_tokens(i, a.saved_at(i), 4)) << i;
    stale_tokens += unsaved[i];
  }
  EXPECT_GT(stale_tokens, 0) << "K=1: some experts were last saved before iteration 4";
  // Restarted at 4 from those saves and counts: later counts add to them.
  std::vector<std::int64_t> saved(ops.size());
  for (std::size_t i = 0; i < ops.size(); ++i) saved[i] = a.saved_at(i);
  pec_schedule c(1, pec_selection::sequential, 2, ops);
  c.restart(4, saved, unsaved);
  EXPECT_EQ(c.unsaved_tokens(4), unsaved);
  for (std::size_t i = 0; i < ops.size(); ++i) EXPECT_EQ(c.saved_at(i), saved[i]);
}

TEST(pec_meta, round_trip_and_corruption) {
  pec_meta m;
  m.saved_at = {0, 2, 4, 4};
  m.unsaved = {0, 17, 0, 3};
  auto bytes = encode_pec_meta(m);
  const auto back = decode_pec_meta(bytes, 4);
  EXPECT_EQ(back.saved_at, m.saved_at);
  EXPECT_EQ(back.unsaved, m.unsaved);
  EXPECT_THROW(decode_pec_meta(bytes, 5), snapshot_error);
  EXPECT_THROW(decode_pec_meta(std::span(bytes).first(bytes.size() - 1), 4), snapshot_error);
  bytes[20] ^= std::byte{1};
  EXPECT_THROW(decode_pec_meta(bytes, 4), snapshot_error);
}

}  // namespace
}  // namespace moevement::recovery
