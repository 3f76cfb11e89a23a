// Replay: a stage restored to its pre-iteration state and run from the recorded boundary
// inputs reproduces the iteration bit for bit (outputs and, after the logged step, state);
// with a frozen operator the outputs still match and only the active operators move.
#include "engine/replay.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <utility>

#include "engine/local_pipeline.hpp"

namespace moevement::engine {
namespace {

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size_bytes()) == 0;
}

// What one (stage, replica) sent in one iteration.
struct recorder : stage_hooks {
  std::map<int, std::vector<float>> acts, grads;  // by micro-batch
  void on_boundary_send(std::int64_t, int mb, boundary kind, std::span<const float> t) override {
    (kind == boundary::activation ? acts : grads)[mb].assign(t.begin(), t.end());
  }
};

struct op_snapshot {
  std::vector<float> master, m, v;
  std::int64_t step = 0;
  std::vector<std::byte> compute;
};

std::vector<op_snapshot> snapshot(std::span<models::operator_state* const> ops) {
  std::vector<op_snapshot> out;
  for (const auto* op : ops) {
    out.push_back({{op->master().begin(), op->master().end()},
                   {op->adam_m().begin(), op->adam_m().end()},
                   {op->adam_v().begin(), op->adam_v().end()},
                   op->step(),
                   {op->compute_bytes().begin(), op->compute_bytes().end()}});
  }
  return out;
}

void restore(models::operator_state& op, const op_snapshot& s) {
  std::copy(s.master.begin(), s.master.end(), op.master().begin());
  std::copy(s.m.begin(), s.m.end(), op.adam_m().begin());
  std::copy(s.v.begin(), s.v.end(), op.adam_v().begin());
  op.set_step(s.step);
  op.refresh_compute();
}

std::vector<std::vector<float>> in_order(const std::map<int, std::vector<float>>& by_mb) {
  std::vector<std::vector<float>> out;
  for (const auto& [mb, t] : by_mb) out.push_back(t);
  return out;
}

models::train_config test_train(int dp) {
  models::train_config t;
  t.micro_batches = 3;
  t.micro_batch_size = 4;
  t.seq_len = 16;
  t.data_parallel = dp;
  return t;
}

constexpr int pp = 3;

// Trains one iteration, records iteration 1 of every (stage, replica), and returns the
// pre-iteration snapshots [replica][stage].
struct recorded_run {
  local_pipeline pipe;
  std::vector<recorder> rec;                                   // [replica * pp + stage]
  std::vector<std::vector<std::vector<op_snapshot>>> before;   // [replica][stage][op]
  std::vector<std::vector<std::vector<std::uint64_t>>> after;  // digests after the step
  recorded_run(const models::train_config& t)
      : pipe(models::preset("tiny"), t, pp), rec(std::size_t(t.data_parallel * pp)) {
    pipe.train_iteration();
    before.resize(std::size_t(t.data_parallel));
    after.resize(std::size_t(t.data_parallel));
    for (int d = 0; d < t.data_parallel; ++d) {
      for (int s = 0; s < pp; ++s) {
        before[d].push_back(snapshot(pipe.stage(s, d).operators()));
        pipe.set_hooks(s, d, &rec[std::size_t(d * pp + s)]);
      }
    }
    pipe.train_iteration();
    for (int d = 0; d < t.data_parallel; ++d) {
      for (int s = 0; s < pp; ++s) {
        after[d].push_back(operator_digests(pipe.stage(s, d).operators()));
      }
    }
  }
  replay_inputs inputs(int s, int d, int m) const {
    replay_inputs in{s, pp, m, {}, {}};
    if (s > 0) in.activations = in_order(rec[std::size_t(d * pp + s - 1)].acts);
    if (s + 1 < pp) in.gradients = in_order(rec[std::size_t(d * pp + s + 1)].grads);
    return in;
  }
};

void expect_outputs_match(const recorded_run& run, const replay_outputs& out, int s, int d) {
  const recorder& mine = run.rec[std::size_t(d * pp + s)];
  for (std::size_t mb = 0; mb < out.activations.size(); ++mb) {
    if (s + 1 < pp) {
      EXPECT_TRUE(same_bits(out.activations[mb], mine.acts.at(int(mb))))
          << "activation of stage " << s << " mb " << mb;
    }
    if (s > 0) {
      EXPECT_TRUE(same_bits(out.gradients[mb], mine.grads.at(int(mb))))
          << "gradient of stage " << s << " mb " << mb;
    }
  }
}

TEST(replay, restored_stage_replays_the_iteration_bit_for_bit) {
  for (int dp : {1, 2}) {
    const auto t = test_train(dp);
    recorded_run run(t);
    for (int s = 0; s < pp; ++s) {
      SCOPED_TRACE(testing::Message() << "dp=" << dp << " stage " << s);
      for (int d = 0; d < dp; ++d) {
        auto ops = run.pipe.stage(s, d).operators();
        for (std::size_t i = 0; i < ops.size(); ++i) restore(*ops[i], run.before[d][s][i]);
        EXPECT_NE(operator_digests(ops), run.after[d][s]) << "restore changed nothing";
        const auto out = replay_iteration(run.pipe.stage(s, d), 1, run.pipe.last_loss_grad(),
                                          run.inputs(s, d, t.micro_batches));
        expect_outputs_match(run, out, s, d);
        if (s == pp - 1) {
          for (double l : out.losses) EXPECT_GT(l, 0.0);
        }
      }
      // the all-reduce (left fold in replica order), then the logged plan
      auto ops0 = run.pipe.stage(s, 0).operators();
      std::vector<float> acc(gradient_floats(ops0)), g(acc.size());
      copy_gradients_out(ops0, acc);
      for (int d = 1; d < dp; ++d) {
        copy_gradients_out(run.pipe.stage(s, d).operators(), g);
        accumulate(acc, g);
      }
      for (int d = 0; d < dp; ++d) {
        auto ops = run.pipe.stage(s, d).operators();
        copy_gradients_in(ops, acc);
        apply_step(ops, run.pipe.last_plan(), t);
        EXPECT_EQ(operator_digests(ops), run.after[d][s]);
      }
    }
  }
}

TEST(replay, frozen_operator_keeps_its_state_and_outputs_still_match) {
  const auto t = test_train(1);
  recorded_run run(t);
  for (int s = 0; s < pp; ++s) {
    SCOPED_TRACE(testing::Message() << "stage " << s);
    auto ops = run.pipe.stage(s, 0).operators();
    std::size_t frozen = ops.size();
    for (std::size_t i = 0; i < ops.size(); ++i) {
      if (ops[i]->kind() == models::op_kind::expert && frozen == ops.size()) {
        frozen = i;  // the stage's first expert: its compute weights from before the step
        ops[i]->set_mode(models::op_mode::frozen);
        ops[i]->set_compute_bytes(run.before[0][s][i].compute);
      } else {
        restore(*ops[i], run.before[0][s][i]);
      }
    }
    ASSERT_LT(frozen, ops.size());
    const auto out =
        replay_iteration(run.pipe.stage(s, 0), 1, run.pipe.last_loss_grad(), run.inputs(s, 0, 3));
    expect_outputs_match(run, out, s, 0);
    EXPECT_EQ(ops[frozen]->grad_sq_sum(), 0.0) << "a frozen operator computed a gradient";
    apply_step(ops, run.pipe.last_plan(), t);
    const auto digests = operator_digests(ops);
    for (std::size_t i = 0; i < ops.size(); ++i) {
      // the frozen one kept the state it had (the pipeline's post-step state); active ones
      // reproduced the step
      EXPECT_EQ(digests[i], run.after[0][s][i]) << ops[i]->name();
    }
    ops[frozen]->set_mode(models::op_mode::active);
  }
}

TEST(replay, single_stage_replays_from_the_data_alone) {
  const auto t = test_train(1);
  local_pipeline pipe(models::preset("tiny"), t, 1);
  pipe.train_iteration();
  auto ops = pipe.stage(0, 0).operators();
  const auto before = snapshot(ops);
  const auto st = pipe.train_iteration();
  const auto after = operator_digests(ops);
  for (std::size_t i = 0; i < ops.size(); ++i) restore(*ops[i], before[i]);
  const auto out = replay_iteration(pipe.stage(0, 0), 1, pipe.last_loss_grad(), {0, 1, 3, {}, {}});
  double loss = 0.0;
  for (double l : out.losses) loss += l;
  EXPECT_EQ(loss / 3, st.loss);
  apply_step(ops, pipe.last_plan(), t);
  EXPECT_EQ(operator_digests(ops), after);
}

TEST(replay, inputs_that_do_not_fit_throw) {
  const auto t = test_train(1);
  local_pipeline pipe(models::preset("tiny"), t, 2);
  replay_inputs in{1, 2, 3, {}, {}};  // stage 1 needs 3 activations
  EXPECT_THROW(replay_iteration(pipe.stage(1, 0), 0, 1.0f, in), std::invalid_argument);
  in = {0, 2, 3, {}, {std::vector<float>(4 * 16 * 32)}};  // stage 0 needs 3 gradients
  EXPECT_THROW(replay_iteration(pipe.stage(0, 0), 0, 1.0f, in), std::invalid_argument);
}

}  // namespace
}  // namespace moevement::engine
