// The example job configs resolve as `moevement launch` reads them (TOML -> resolve_job).
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "engine/job_config.hpp"
#include "launcher/config.hpp"
#include "launcher/inject.hpp"

namespace moevement::launcher {
namespace {

std::string example(const std::string& name) {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  if (root == nullptr) throw std::runtime_error("MOEVEMENT_SOURCE_ROOT is not set");
  return std::string(root) + "/examples/configs/" + name;
}

TEST(example_configs, demo_is_small_in_two_stages_by_two_replicas) {
  const auto j = engine::resolve_job(load_config_file(example("demo.toml")));
  EXPECT_EQ(j.model.preset, "small");
  EXPECT_EQ(j.pp, 2);
  EXPECT_EQ(j.dp, 2);
  EXPECT_EQ(j.workers(), 4);
  EXPECT_EQ(j.policy, engine::policy_kind::none);
}

TEST(example_configs, pipeline_tiny_is_tiny_in_two_stages_by_two_replicas) {
  const auto j = engine::resolve_job(load_config_file(example("pipeline_tiny.toml")));
  EXPECT_EQ(j.model.preset, "tiny");
  EXPECT_EQ(j.pp, 2);
  EXPECT_EQ(j.dp, 2);
  EXPECT_EQ(j.train.iterations, 20);
}

TEST(example_configs, training_examples_resolve) {
  for (const char* name : {"tiny.toml", "small.toml"}) {
    EXPECT_NO_THROW((void)engine::resolve_job(load_config_file(example(name)))) << name;
  }
}

}  // namespace
TEST(example_configs, failure_single_recovers_with_a_spare) {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  ASSERT_NE(root, nullptr);
  const auto j = engine::resolve_job(
      load_config_file(std::string(root) + "/examples/failure_single/config.toml"));
  EXPECT_EQ(j.policy, engine::policy_kind::moevement);
  EXPECT_GE(j.spares, 1);
  EXPECT_EQ(j.pp, 3);
}

TEST(example_configs, failure_contiguous_has_a_spare_per_lost_stage) {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  ASSERT_NE(root, nullptr);
  const auto j = engine::resolve_job(
      load_config_file(std::string(root) + "/examples/failure_contiguous/config.toml"));
  EXPECT_EQ(j.policy, engine::policy_kind::moevement);
  EXPECT_GE(j.spares, 2);
  EXPECT_GE(j.pp, 4) << "stages 1 and 2 lost need healthy stages on both sides";
}

}  // namespace moevement::launcher

namespace moevement::launcher {

// The failure examples' [[inject]] tables are valid for their jobs, with a spare per failure.
TEST(example_configs, failure_mtbf_has_a_spare_for_every_scheduled_failure) {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  ASSERT_NE(root, nullptr);
  const std::string path = std::string(root) + "/examples/failure_mtbf/config.toml";
  auto raw = load_config_file(path);
  const auto injections = take_inject_tables(raw, path);
  const auto j = engine::resolve_job(raw);
  EXPECT_EQ(j.policy, engine::policy_kind::moevement);
  ASSERT_EQ(injections.size(), 2u);
  EXPECT_EQ(injections[0].what, injection::kind::mtbf);
  EXPECT_EQ(injections[1].what, injection::kind::trace);
  std::size_t failures = 0;
  for (const auto& inj : injections) failures += check_injection(inj, j).size();
  EXPECT_EQ(failures, 4u);
  EXPECT_GE(std::size_t(j.spares), failures);
}

TEST(example_configs, failure_infiniband_is_failure_single_over_slurm_with_a_phase) {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  ASSERT_NE(root, nullptr);
  const std::string path = std::string(root) + "/examples/failure_infiniband/config.toml";
  auto raw = load_config_file(path);
  const auto injections = take_inject_tables(raw, path);
  const auto j = engine::resolve_job(raw);
  const auto single = engine::resolve_job(
      load_config_file(std::string(root) + "/examples/failure_single/config.toml"));
  EXPECT_EQ(j.backend, "slurm");
  EXPECT_EQ(j.model, single.model);
  EXPECT_EQ(j.train, single.train) << "the same job: the same state_hash";
  EXPECT_EQ(j.pp, single.pp);
  EXPECT_EQ(j.dp, single.dp);
  EXPECT_EQ(j.policy, engine::policy_kind::moevement);
  EXPECT_EQ(j.workers() + j.spares, 8);
  ASSERT_EQ(injections.size(), 1u);
  EXPECT_EQ(injections[0].text(), "kill:stage=1,replica=0,iter=20,phase=backward");
  EXPECT_NO_THROW((void)check_injection(injections[0], j));
}

TEST(example_configs, failure_cascading_has_a_spare_per_lost_stage) {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  ASSERT_NE(root, nullptr);
  const auto j = engine::resolve_job(
      load_config_file(std::string(root) + "/examples/failure_cascading/config.toml"));
  EXPECT_EQ(j.policy, engine::policy_kind::moevement);
  EXPECT_GE(j.spares, 2);
  EXPECT_GE(j.pp, 4);
}

}  // namespace moevement::launcher
