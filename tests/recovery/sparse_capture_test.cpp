// The moevement capture: W_sparse from Algorithm 1 or given, one slot per iteration tagged with
// its window, stale windows, logs and plans dropped (host memory bounded over a long run).
#include "recovery/sparse_capture.hpp"

#include <gtest/gtest.h>

#include <iostream>
#include <memory>

#include "engine/local_pipeline.hpp"

namespace moevement::recovery {
namespace {

models::train_config test_train() {
  models::train_config t;
  t.micro_batches = 2;
  t.micro_batch_size = 2;
  t.seq_len = 16;
  return t;
}

TEST(sparse_capture, w_sparse_from_the_profile_is_agreed_across_stages) {
  engine::local_pipeline pipe{models::preset("tiny"), test_train(), 2};
  std::vector<std::vector<models::operator_state*>> stages{pipe.stage(0, 0).operators(),
                                                           pipe.stage(1, 0).operators()};
  // unlimited bandwidth: every operator fits in one slot
  EXPECT_EQ(find_w_sparse(stages, 1.0, 1e18), 1);
  // a bandwidth where a whole stage's full state takes ~4 iterations needs a window > 1
  std::uint64_t full = 0;
  for (const auto* op : stages[0]) {
    const auto s = sparse_sizes(*op);
    full += s.master_bytes + s.optim_bytes;
  }
  const int w = find_w_sparse(stages, 1.0, double(full) / 4);
  EXPECT_GT(w, 1);
  for (const auto& ops : stages) {
    stage_schedule sched(sparse_config{0, 1.0, double(full) / 4}, ops);
    EXPECT_LE(sched.w_sparse(), w);
    EXPECT_EQ(sim::check_schedule(sched.window_schedule(0), ops.size()), "");
  }
  EXPECT_THROW(stage_schedule(sparse_config{}, stages[0]), std::invalid_argument);
}

TEST(sparse_capture, slots_are_tagged_and_memory_stays_bounded) {
  constexpr int w = 3;
  const auto t = test_train();
  engine::local_pipeline pipe{models::preset("tiny"), t, 2};
  stage_schedule s0(sparse_config{w}, pipe.stage(0, 0).operators());
  stage_schedule s1(sparse_config{w}, pipe.stage(1, 0).operators());
  sparse_capture c0(s0, 0, 0, &pipe.scaler()), c1(s1, 1, 0, &pipe.scaler());
  pipe.set_hooks(0, 0, &c0);
  pipe.set_hooks(1, 0, &c1);
  const std::size_t tensor = pipe.stage(0, 0).boundary_floats() * sizeof(float);
  // Buffers of at most two windows (persisted + in flight, recycled), each slot at most the
  // whole stage in full.
  const auto ops0 = pipe.stage(0, 0).operators();
  const std::vector<const models::operator_state*> cops(ops0.begin(), ops0.end());
  const std::vector<capture_kind> all_full(cops.size(), capture_kind::full);
  const std::size_t snapshot_bound = 2 * w * snapshot_size(cops, all_full);
  for (int i = 0; i < 8 * w + 1; ++i) {
    pipe.train_iteration();
    if (i < w - 1) {
      EXPECT_FALSE(c0.persisted().has_value());
      continue;
    }
    const auto v = c1.persisted();
    ASSERT_TRUE(v.has_value());
    EXPECT_EQ(v->window, std::uint64_t((i + 1) / w - 1));
    EXPECT_EQ(v->first_iteration, std::int64_t(v->window) * w + 1);
    for (std::size_t j = 0; j < v->slots.size(); ++j) {
      const auto tag = parse_snapshot(v->slots[j]).tag;
      EXPECT_EQ(tag, (snapshot_tag{v->window, std::uint32_t(j),
                                   v->first_iteration + std::int64_t(j), 1, 0}));
    }
    // one persisted window and one in flight; logs and plans from the persisted window on
    EXPECT_LE(c1.windows_held(), 2u);
    EXPECT_GE(c1.log().span_held()->first, std::uint64_t(v->first_iteration));
    EXPECT_GE(c0.steps().begin()->first, v->first_iteration);
    EXPECT_LE(c0.log().bytes(), std::size_t(2 * w * t.micro_batches) * tensor);
    EXPECT_LE(c1.log().bytes(), std::size_t(2 * w * t.micro_batches) * tensor);
    EXPECT_EQ(c0.log_conflicts(), 0u);
    EXPECT_LE(c0.snapshot_bytes_held(), snapshot_bound) << "iteration " << i;
  }
  EXPECT_GT(c0.last_slot_bytes(), 0u);
}

TEST(sparse_capture, a_capture_started_mid_window_waits_for_the_next) {
  const auto t = test_train();
  engine::local_pipeline pipe{models::preset("tiny"), t, 1};
  stage_schedule sched(sparse_config{4}, pipe.stage(0, 0).operators());
  pipe.train_iteration();  // iteration 0 not captured
  sparse_capture cap(sched, 0, 0, &pipe.scaler());
  pipe.set_hooks(0, 0, &cap);
  for (int i = 1; i < 8; ++i) pipe.train_iteration();
  // window 0 (iterations 0..3) missed its slot 0; window 1 (4..7) is complete
  ASSERT_TRUE(cap.persisted().has_value());
  EXPECT_EQ(cap.persisted()->window, 1u);
  EXPECT_EQ(cap.windows_held(), 1u);
}

// Section 3.2: each slot is smaller than a dense snapshot of the stage (full state of every
// operator); the sizes are printed for docs/sparse-checkpointing.md.
TEST(sparse_capture, slots_are_smaller_than_a_dense_snapshot) {
  constexpr int w = 3;
  engine::local_pipeline pipe{models::preset("tiny"), test_train(), 1};
  const auto ops = pipe.stage(0, 0).operators();
  stage_schedule sched(sparse_config{w}, ops);
  sparse_capture cap(sched, 0, 0, &pipe.scaler());
  pipe.set_hooks(0, 0, &cap);
  for (int i = 0; i < w; ++i) pipe.train_iteration();
  const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
  const std::size_t dense =
      snapshot_size(cops, std::vector<capture_kind>(cops.size(), capture_kind::full));
  const auto v = cap.persisted();
  ASSERT_TRUE(v.has_value());
  std::cout << "tiny, one stage, W=" << w << ": dense snapshot " << dense << " bytes; slots";
  for (const auto slot : v->slots) {
    EXPECT_LT(slot.size(), dense);
    std::cout << " " << slot.size();
  }
  std::cout << "\n";
}

}  // namespace
}  // namespace moevement::recovery
