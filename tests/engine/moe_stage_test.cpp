// The built-in stage: setup errors name the key, boundary sizes are checked, an aborted
// iteration leaves nothing in flight, the registry builds it by name.
#include <gtest/gtest.h>

#include <stdexcept>

#include "engine/stage_model.hpp"
#include "engine/stage_registry.hpp"

namespace moevement::engine {
namespace {

stage_setup tiny_setup(int stage, int stages) {
  stage_setup s;
  s.model = models::preset("tiny");
  s.train.micro_batches = 2;
  s.train.micro_batch_size = 2;
  s.train.seq_len = 8;
  s.stage = stage;
  s.stages = stages;
  return s;
}

std::string key_of(const stage_setup& s) {
  try {
    make_moe_stage(s);
  } catch (const models::config_error& e) {
    return e.key();
  }
  return "(accepted)";
}

TEST(moe_stage, bad_setup_names_the_key) {
  EXPECT_EQ(key_of(tiny_setup(2, 2)), "parallel.pp");  // stage >= stages
  EXPECT_EQ(key_of(tiny_setup(-1, 2)), "parallel.pp");
  EXPECT_EQ(key_of(tiny_setup(0, 5)), "parallel.pp");  // more stages than tiny's 4 layers
  auto s = tiny_setup(0, 2);
  s.replica = 1;  // of 1
  EXPECT_EQ(key_of(s), "parallel.dp");
  s.replicas = 2;  // but train.data_parallel is 1
  EXPECT_EQ(key_of(s), "parallel.dp");
  s = tiny_setup(0, 1);
  s.train.seq_len = 1000;  // > model.max_seq_len
  EXPECT_NE(key_of(s), "(accepted)");
  try {
    make_moe_stage(tiny_setup(0, 5));
  } catch (const models::config_error& e) {
    EXPECT_NE(std::string(e.what()).find("model.layers"), std::string::npos) << e.what();
  }
}

TEST(moe_stage, owns_its_partition_and_checks_boundaries) {
  const auto s0 = make_moe_stage(tiny_setup(0, 2));
  const auto s1 = make_moe_stage(tiny_setup(1, 2));
  const auto parts = models::partition(models::preset("tiny"), 2);
  EXPECT_EQ(s0->operators().size(), parts[0].last_op - parts[0].first_op);
  EXPECT_EQ(s1->operators().size(), parts[1].last_op - parts[1].first_op);
  EXPECT_EQ(s0->operators().front()->name(), "embedding");
  EXPECT_EQ(s1->operators().back()->name(), "head");
  EXPECT_EQ(s0->boundary_floats(), 2u * 8u * 32u);
  s0->begin_iteration(0);
  s1->begin_iteration(0);
  const std::vector<float> wrong(7);
  EXPECT_THROW(s0->forward(0, wrong), std::invalid_argument);  // the first stage takes none
  EXPECT_THROW(s1->forward(0, wrong), std::invalid_argument);
  EXPECT_THROW(s0->forward(2, {}), std::out_of_range);  // micro_batches is 2
  const auto a = s0->forward(0, {});
  const std::vector<float> x(a.activation.begin(), a.activation.end());
  ASSERT_EQ(x.size(), s0->boundary_floats());
  const auto out = s1->forward(0, x);
  EXPECT_TRUE(out.activation.empty());
  EXPECT_GT(out.loss, 0.0);
  // validation carries an activation too, and matches the last stage's loss path
  const auto v0 = s0->validate(0, {});
  const std::vector<float> xv(v0.activation.begin(), v0.activation.end());
  EXPECT_EQ(xv.size(), s0->boundary_floats());
  EXPECT_GT(s1->validate(0, xv).loss, 0.0);
}

TEST(moe_stage, abort_drops_micro_batches_in_flight) {
  const auto s0 = make_moe_stage(tiny_setup(0, 2));
  s0->begin_iteration(0);
  s0->forward(0, {});
  EXPECT_THROW(s0->forward(0, {}), std::logic_error);  // already in flight
  s0->abort_iteration();
  EXPECT_THROW(s0->backward(0, std::vector<float>(s0->boundary_floats()), 1.0f),
               std::logic_error);     // nothing left to run backward on
  const auto a = s0->forward(0, {});  // runs again after the abort
  const auto b_first = std::vector<float>(a.activation.begin(), a.activation.end());
  s0->begin_iteration(0);  // a new iteration also drops what is in flight
  const auto b = s0->forward(0, {});
  EXPECT_EQ(std::vector<float>(b.activation.begin(), b.activation.end()), b_first);
}

TEST(moe_stage, registry_builds_moe_by_name) {
  const auto reg = stage_registry::with_builtins();
  const auto st = reg.find("moe")(tiny_setup(0, 1));
  EXPECT_EQ(st->operators().size(), models::moe_model(models::preset("tiny"), 1).ops().size());
  try {
    reg.find("nope");
    FAIL();
  } catch (const models::config_error& e) {
    EXPECT_EQ(e.key(), "engine.stage");
  }
}

}  // namespace
}  // namespace moevement::engine
