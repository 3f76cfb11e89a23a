// The in-process engine against models::trainer: pipelining (pp) and data parallelism (dp)
// change no bit of the training state, the loss, the gradient norm or the validation loss.
#include "engine/local_pipeline.hpp"

#include <gtest/gtest.h>

#include "models/trainer.hpp"

namespace moevement::engine {
namespace {

models::train_config test_train(int dp) {
  models::train_config t;
  t.micro_batches = 3;  // more than 2 so that 1F1B interleaves on pp = 4
  t.micro_batch_size = 4;
  t.seq_len = 16;
  t.val_batches = 2;
  t.data_parallel = dp;
  return t;
}

void expect_same_run(const models::model_config& m, const models::train_config& t, int pp,
                     int iterations) {
  SCOPED_TRACE(testing::Message() << "pp=" << pp << " dp=" << t.data_parallel);
  models::trainer ref(m, t);
  local_pipeline pipe(m, t, pp);
  for (int it = 0; it < iterations; ++it) {
    const auto want = ref.train_iteration();
    const auto got = pipe.train_iteration();
    EXPECT_EQ(got.iteration, want.iteration);
    EXPECT_EQ(got.loss, want.loss) << "iteration " << it;  // bitwise: same sums, same order
    EXPECT_EQ(got.grad_norm, want.grad_norm) << "iteration " << it;
    EXPECT_EQ(got.applied, want.applied) << "iteration " << it;
    EXPECT_EQ(got.loss_scale, want.loss_scale) << "iteration " << it;
    EXPECT_NEAR(got.aux_loss, want.aux_loss, 1e-12);  // summed per stage: rounding may differ
  }
  EXPECT_EQ(pipe.state_hash(), ref.state_hash());
  EXPECT_EQ(pipe.iteration(), ref.iteration());
  EXPECT_EQ(pipe.validation_loss(), ref.validation_loss());
}

TEST(local_pipeline, matches_the_trainer_bit_for_bit_for_every_pp_and_dp) {
  const auto m = models::preset("tiny");
  for (int dp : {1, 2, 3}) {
    for (int pp : {1, 2, 4}) expect_same_run(m, test_train(dp), pp, 3);
  }
}

TEST(local_pipeline, expert_parallelism_changes_no_bit) {
  // ep = 1, 2, 4 at dp = 4 against the trainer, which holds every expert in one process
  const auto m = models::preset("tiny");
  for (const auto& [ep, pp] : {std::pair{1, 1}, std::pair{2, 2}, std::pair{4, 1}}) {
    auto t = test_train(4);
    t.expert_parallel = ep;
    SCOPED_TRACE(testing::Message() << "ep=" << ep);
    expect_same_run(m, t, pp, 2);
  }
  auto t = test_train(2);  // one EP group of two, f16 with the loss scale changing
  t.expert_parallel = 2;
  t.loss_scale_window = 1;
  auto f16 = m;
  f16.compute_dtype = models::dtype::f16;
  expect_same_run(f16, t, 2, 2);
}

TEST(local_pipeline, an_ep_rank_holds_its_block_of_experts_only) {
  const auto m = models::preset("tiny");  // 4 experts per layer
  auto t = test_train(4);
  t.expert_parallel = 4;
  local_pipeline pipe(m, t, 2);
  for (int d = 0; d < 4; ++d) {
    for (int s = 0; s < 2; ++s) {
      auto& stage = pipe.stage(s, d);
      ASSERT_NE(stage.experts(), nullptr);
      EXPECT_EQ(stage.experts()->split().index, d % 4);
      int experts = 0;
      for (auto* op : stage.operators()) {
        if (op->kind() != models::op_kind::expert) continue;
        ++experts;
        EXPECT_EQ(op->name().back(), char('0' + d % 4)) << op->name();
      }
      EXPECT_EQ(experts, 2) << "one expert in each of the stage's two layers";
    }
  }
}

TEST(local_pipeline, f16_with_loss_scaling_matches_the_trainer) {
  auto m = models::preset("tiny");
  m.compute_dtype = models::dtype::f16;
  auto t = test_train(2);
  t.loss_scale_window = 2;  // the scale changes within the run
  expect_same_run(m, t, 2, 4);
}

TEST(local_pipeline, pp_changes_no_bit_against_itself) {
  const auto m = models::preset("tiny");
  const auto t = test_train(2);
  local_pipeline a(m, t, 1), b(m, t, 3);
  for (int it = 0; it < 2; ++it) {
    a.train_iteration();
    b.train_iteration();
  }
  EXPECT_EQ(a.state_hash(), b.state_hash());
  EXPECT_NE(a.state_hash(), local_pipeline(m, t, 1).state_hash()) << "training changed nothing";
}

TEST(local_pipeline, loss_falls) {
  const auto m = models::preset("tiny");
  auto t = test_train(2);
  local_pipeline pipe(m, t, 2);
  const double before = pipe.validation_loss();
  double first = 0.0, last = 0.0;
  for (int it = 0; it < 30; ++it) {
    const auto st = pipe.train_iteration();
    if (it < 3) first += st.loss;
    if (it >= 27) last += st.loss;
  }
  EXPECT_LT(last, first * 0.9);
  EXPECT_LT(pipe.validation_loss(), before);
}

TEST(local_pipeline, hooks_see_every_boundary_send_and_step) {
  struct counting : stage_hooks {
    int acts = 0, grads = 0, steps = 0;
    void after_step(std::int64_t, std::span<models::operator_state* const> ops) override {
      ++steps;
      EXPECT_FALSE(ops.empty());
    }
    void on_boundary_send(std::int64_t, int, boundary kind, std::span<const float> t) override {
      ++(kind == boundary::activation ? acts : grads);
      EXPECT_EQ(t.size(), 4u * 16u * 32u);
    }
  };
  const auto m = models::preset("tiny");
  const auto t = test_train(2);
  local_pipeline pipe(m, t, 3);
  std::vector<counting> h(6);
  for (int d = 0; d < 2; ++d) {
    for (int s = 0; s < 3; ++s) pipe.set_hooks(s, d, &h[std::size_t(d * 3 + s)]);
  }
  pipe.train_iteration();
  pipe.train_iteration();
  for (int d = 0; d < 2; ++d) {
    for (int s = 0; s < 3; ++s) {
      const auto& c = h[std::size_t(d * 3 + s)];
      EXPECT_EQ(c.acts, s < 2 ? 2 * 3 : 0);
      EXPECT_EQ(c.grads, s > 0 ? 2 * 3 : 0);
      EXPECT_EQ(c.steps, 2);
    }
  }
}

TEST(local_pipeline, bad_setup_names_the_key) {
  const auto m = models::preset("tiny");
  try {
    local_pipeline pipe(m, test_train(1), 5);  // tiny has 4 layers
    FAIL() << "pp > layers accepted";
  } catch (const models::config_error& e) {
    EXPECT_EQ(e.key(), "parallel.pp");
  }
  try {
    local_pipeline pipe(m, test_train(1), 0);
    FAIL() << "pp = 0 accepted";
  } catch (const models::config_error& e) {
    EXPECT_EQ(e.key(), "parallel.pp");
  }
  for (const auto& [dp, ep] : {std::pair{4, 3}, std::pair{3, 3}, std::pair{2, 0}}) {
    auto t = test_train(dp);
    t.expert_parallel = ep;  // 3 divides neither dp = 4 nor the 4 experts; 0 is no size
    try {
      local_pipeline pipe(m, t, 1);
      FAIL() << "ep " << ep << " at dp " << dp << " accepted";
    } catch (const models::config_error& e) {
      EXPECT_EQ(e.key(), "parallel.ep") << e.what();
    }
  }
}

}  // namespace
}  // namespace moevement::engine
