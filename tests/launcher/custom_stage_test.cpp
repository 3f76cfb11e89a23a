// The custom stage example (examples/custom_stage) end to end: a stage type registered by name
// in its own program, with a stage actor of its own, trains under `launch`, and its pipelining
// changes no bit either; a custom MoE type takes expert parallelism bit-exact. Its actor answers a
// message of its own (StatsQuery, asked by the head every log_every iterations), the rebuilt ones
// after a kill too, with the same bits.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdlib>
#include <string>

#include "tests/support/run_moevement.hpp"

namespace {

using moevement::test_support::source_path;

moevement::test_support::run_result run_example(const std::string& args) {
  const char* bin = std::getenv("CUSTOM_STAGE_BIN");
  if (bin == nullptr) throw std::runtime_error("CUSTOM_STAGE_BIN is not set (run via meson test)");
  ::setenv("MOEVEMENT_BIN", bin, 1);  // run_moevement runs whatever MOEVEMENT_BIN names
  return moevement::test_support::run_moevement(args);
}

std::string hash_of(const std::string& out) {
  const auto at = out.rfind("state_hash=");
  return at == std::string::npos ? "" : out.substr(at + 11, 16);
}

// The head's `stats` line after iteration `iter` (an index, from 0; empty: none).
std::string stats_line(const std::string& out, int iter) {
  const std::string key =
      "stats  iter " + std::string(iter < 10 ? "    " : "   ") + std::to_string(iter) + ":";
  const auto at = out.find(key);
  if (at == std::string::npos) return "";
  return out.substr(at, out.find('\n', at) - at);
}

std::size_t count_of(const std::string& s, const std::string& what) {
  std::size_t n = 0;
  for (auto at = s.find(what); at != std::string::npos; at = s.find(what, at + 1)) ++n;
  return n;
}

std::string config() {
  return source_path("examples/custom_stage/residual_mlp.toml");
}
std::string log() {
  return " --set engine.run_log=" + ::testing::TempDir() + "custom_stage_" +
         std::to_string(::getpid()) + ".jsonl";
}

TEST(custom_stage, trains_and_pipelining_changes_no_bit) {
  const std::string common = " --set train.iterations=4 --set parallel.dp=1" + log();
  const auto one = run_example("launch " + config() + common + " --set parallel.pp=1");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  const auto four = run_example("launch " + config() + common + " --set parallel.pp=4");
  ASSERT_EQ(four.exit_code, 0) << four.output;
  EXPECT_EQ(hash_of(one.output).size(), 16u);
  EXPECT_EQ(hash_of(one.output), hash_of(four.output));
}

TEST(custom_stage, a_killed_custom_stage_is_rebuilt_bit_exact) {
  // Recovery treats a custom stage like the built-in one: under policy moevement, two workers
  // killed in turn (different stages and replicas) are rebuilt on spares by sparse-to-dense
  // replay, and the job ends with the fault-free hash.
  const std::string common = " --set train.iterations=12 --set parallel.pp=2" + log();
  const auto clean = run_example("launch " + config() + common);
  ASSERT_EQ(clean.exit_code, 0) << clean.output;
  const auto killed = run_example(
      "launch " + config() + common +
      " --set checkpoint.policy=moevement --set checkpoint.w_sparse=2 --set cluster.spares=2"
      " --set cluster.failure_timeout_ms=3000"
      " --inject kill:stage=1,replica=0,iter=7 --inject kill:stage=0,replica=1,iter=9");
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("stage 1 recovered"), std::string::npos) << killed.output;
  EXPECT_NE(killed.output.find("stage 0 recovered"), std::string::npos) << killed.output;
  EXPECT_EQ(hash_of(killed.output).size(), 16u);
  EXPECT_EQ(hash_of(killed.output), hash_of(clean.output));
  // Every stage actor, the rebuilt ones included, answers the custom message after the last
  // iteration, with the fault-free run's statistics.
  const std::string last = stats_line(clean.output, 11);
  EXPECT_EQ(count_of(last, "weight_rms"), 4u) << clean.output;
  EXPECT_EQ(count_of(last, "no answer"), 0u) << last;
  EXPECT_EQ(stats_line(killed.output, 11), last) << killed.output;
  EXPECT_EQ(count_of(stats_line(killed.output, 0), "weight_rms"), 4u) << killed.output;
}

TEST(custom_stage, learns) {
  const auto r = run_example("launch " + config() + " --set train.iterations=30" + log());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  // byte-level text starts near ln(256) = 5.5 nats; 30 steps bring it well under 4
  const auto at = r.output.find("final: loss ");
  ASSERT_NE(at, std::string::npos) << r.output;
  EXPECT_LT(std::strtod(r.output.c_str() + at + 12, nullptr), 4.0) << r.output;
}

std::string moe_config() {
  return source_path("examples/custom_stage/residual_moe.toml");
}

TEST(custom_stage, a_custom_moe_stage_takes_expert_parallelism_bit_exact) {
  // residual_moe (stage_traits::expert_parallel): its experts sharded over the replicas, the
  // routed rows through the engine's all-to-all. ep 1 and 2 at dp 2 end with the same hash, and
  // so does a kill under policy moevement at ep 2 (the group replays spread over its workers,
  // the EP rows between their replay routers).
  const std::string common = " --set train.iterations=12" + log();
  const auto one = run_example("launch " + moe_config() + common + " --set parallel.ep=1");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(hash_of(one.output).size(), 16u);
  const auto two = run_example("launch " + moe_config() + common);  // its config: ep 2
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_EQ(hash_of(two.output), hash_of(one.output));
  const auto killed = run_example(
      "launch " + moe_config() + common +
      " --set checkpoint.policy=moevement --set checkpoint.w_sparse=2 --set cluster.spares=1"
      " --set cluster.failure_timeout_ms=3000 --inject kill:stage=1,replica=0,iter=7");
  ASSERT_EQ(killed.exit_code, 0) << killed.output;
  EXPECT_NE(killed.output.find("the group replaying on workers"), std::string::npos)
      << killed.output;
  EXPECT_EQ(hash_of(killed.output), hash_of(one.output));
}

TEST(custom_stage, a_type_without_experts_refuses_expert_parallelism) {
  const auto r = run_example("launch " + config() + " --set parallel.ep=2" + log());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("parallel.ep"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("residual_mlp"), std::string::npos) << r.output;
  // refused at the head, before any worker starts
  EXPECT_NE(r.output.find("has no experts to shard"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("workers +"), std::string::npos) << r.output;
}

TEST(custom_stage, the_plain_binary_does_not_know_it) {
  const char* plain = std::getenv("MOEVEMENT_PLAIN_BIN");
  ASSERT_NE(plain, nullptr);
  ::setenv("MOEVEMENT_BIN", plain, 1);
  const auto r = moevement::test_support::run_moevement("launch " + config() + log());
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.output.find("engine.stage"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("residual_mlp"), std::string::npos) << r.output;
}

}  // namespace
