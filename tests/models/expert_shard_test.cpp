// Expert parallelism's owner side: a shard computes a source's rows exactly as the whole
// stage does, keeps each source's weight gradient apart, and refuses calls that do not fit.
#include "models/expert_shard.hpp"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "models/config.hpp"
#include "models/operator_state.hpp"

namespace moevement::models {
namespace {

constexpr int rows_per_expert = 3;

// A one-layer stage's worth of the tiny model, shard `index` of 2.
struct two_shards {
  model_config cfg = preset("tiny");
  stage_range range = partition(cfg, 4)[1];  // layer 1
  moe_model whole{cfg, 7, range.first_op, range.last_op};
  moe_model half0{cfg, 7, range.first_op, range.last_op, true, {0, 2}};
  moe_model half1{cfg, 7, range.first_op, range.last_op, true, {1, 2}};
  expert_shard shard0{half0, range, {0, 2}}, shard1{half1, range, {1, 2}};
  std::vector<float> xs;
  two_shards() {
    xs.resize(std::size_t(rows_per_expert) * 2 * std::size_t(cfg.d_model));
    for (std::size_t i = 0; i < xs.size(); ++i) xs[i] = float(int(i % 17) - 8) / 16.0f;
    shard0.begin_iteration();
    shard1.begin_iteration();
  }
};

TEST(expert_shard, holds_its_block_and_computes_what_the_whole_model_does) {
  two_shards t;
  const int c = t.cfg.d_model, f = t.cfg.d_ff, l = t.range.first_layer;
  ASSERT_EQ(t.shard1.experts().size(), 2u);  // experts 2 and 3 of the layer
  EXPECT_EQ(t.shard1.experts()[0]->name(), "layer1.expert2");
  EXPECT_FALSE(t.half1.ops()[t.half1.expert(l, 0)].allocated());
  const std::vector<int> rows{rows_per_expert, rows_per_expert};
  std::vector<float> ye(t.xs.size()), want(t.xs.size());
  t.shard1.forward(1, l, 0, rows, t.xs, ye, true);
  std::vector<float> hpre(std::size_t(rows_per_expert) * f), act(hpre.size());
  for (int j = 0; j < 2; ++j) {
    const std::size_t at = std::size_t(j * rows_per_expert * c);
    expert_forward(t.whole.ops()[t.whole.expert(l, 2 + j)], rows_per_expert, c, f, t.xs.data() + at,
                   hpre.data(), act.data(), want.data() + at);
  }
  EXPECT_EQ(ye, want);
  // the backward adds to source 1's gradient only
  std::vector<float> d_xs(t.xs.size());
  t.shard1.backward(1, l, 0, ye, d_xs);
  const auto g0 = t.shard1.source_gradient(0), g1 = t.shard1.source_gradient(1);
  EXPECT_TRUE(std::all_of(g0.begin(), g0.end(), [](float v) { return v == 0.0f; }));
  EXPECT_FALSE(std::all_of(g1.begin(), g1.end(), [](float v) { return v == 0.0f; }));
  EXPECT_EQ(t.shard1.in_flight(), 0u);
  t.shard1.begin_iteration();
  const auto z = t.shard1.source_gradient(1);
  EXPECT_TRUE(std::all_of(z.begin(), z.end(), [](float v) { return v == 0.0f; }));
}

TEST(expert_shard, refuses_calls_that_do_not_fit) {
  two_shards t;
  const int l = t.range.first_layer;
  std::vector<float> ye(t.xs.size());
  const std::vector<int> rows{rows_per_expert, rows_per_expert};
  EXPECT_THROW(t.shard0.forward(2, l, 0, rows, t.xs, ye, true), std::invalid_argument);  // source
  EXPECT_THROW(t.shard0.forward(0, 0, 0, rows, t.xs, ye, true), std::invalid_argument);  // layer
  EXPECT_THROW(t.shard0.forward(0, l, 0, std::vector<int>{6}, t.xs, ye, true),
               std::invalid_argument);  // row counts for one expert of two
  EXPECT_THROW(t.shard0.forward(0, l, 0, std::vector<int>{4, 3}, t.xs, ye, true),
               std::invalid_argument);  // 7 rows, 6 given
  EXPECT_THROW(t.shard0.forward(0, l, 0, std::vector<int>{-1, 7}, t.xs, ye, true),
               std::invalid_argument);
  std::vector<float> d_xs(t.xs.size());
  EXPECT_THROW(t.shard0.backward(0, l, 0, ye, d_xs), std::logic_error);  // no forward
  t.shard0.forward(0, l, 0, rows, t.xs, ye, true);
  EXPECT_THROW(t.shard0.forward(0, l, 0, rows, t.xs, ye, true), std::logic_error);  // twice
  EXPECT_THROW(t.shard0.backward(0, l, 0, std::span<const float>(ye).first(3), d_xs),
               std::invalid_argument);
  t.shard0.abort();
  EXPECT_EQ(t.shard0.in_flight(), 0u);
  EXPECT_THROW(expert_shard(t.half0, t.range, {0, 3}), std::invalid_argument);  // 3 of 4 experts
  EXPECT_THROW(expert_shard(t.half0, t.range, {1, 2}), std::invalid_argument);  // not held
}

TEST(expert_shard, a_direct_exchange_splits_rows_by_owner) {
  two_shards t;
  const int l = t.range.first_layer, c = t.cfg.d_model;
  direct_exchange x({&t.shard0, &t.shard1}, 0, t.cfg.experts, c);
  // experts 0..3 get 0, 2, 1, 3 rows
  const std::vector<int> offsets{0, 0, 2, 3, 6};
  std::vector<float> ye(t.xs.size());
  x.forward(l, 5, offsets, t.xs, ye, true);
  EXPECT_EQ(t.shard0.in_flight(), 1u);
  EXPECT_EQ(t.shard1.in_flight(), 1u);
  std::vector<float> want(t.xs.size());
  t.shard1.abort();
  t.shard1.forward(0, l, 5, std::vector<int>{1, 3}, std::span<const float>(t.xs).subspan(2 * c),
                   std::span<float>(want).subspan(2 * c), false);
  EXPECT_TRUE(std::equal(ye.begin() + 2 * c, ye.end(), want.begin() + 2 * c));
  EXPECT_THROW(x.forward(l, 6, std::vector<int>{0, 6}, t.xs, ye, true), std::invalid_argument);
}

}  // namespace
}  // namespace moevement::models
