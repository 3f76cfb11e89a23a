// `moevement train` as a user runs it: trains, ends with state_hash=, rejects bad configs by key.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include "tests/support/run_moevement.hpp"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

namespace {

using moevement::test_support::run_result;
run_result run(const std::string& args) {
  return moevement::test_support::run_moevement(args);
}

std::string tiny() {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  if (root == nullptr) throw std::runtime_error("MOEVEMENT_SOURCE_ROOT is not set");
  return std::string(root) + "/examples/configs/tiny.toml";
}

// The 16 hex digits of a final line "state_hash=<16 hex>", or "" if the output does not end so.
// (No std::regex: GCC 12 warns inside it under the sanitizers.)
std::string hash_of(const std::string& out) {
  const std::string tag = "state_hash=";
  const auto at = out.rfind(tag);
  if (at == std::string::npos || (at != 0 && out[at - 1] != '\n')) return "";
  const std::string rest = out.substr(at + tag.size());
  if (rest.size() != 17 || rest.back() != '\n') return "";
  const std::string hex = rest.substr(0, 16);
  if (hex.find_first_not_of("0123456789abcdef") != std::string::npos) return "";
  return hex;
}

TEST(train, prints_losses_and_ends_with_the_same_state_hash_twice) {
  const std::string args = "train " + tiny() + " --set train.iterations=3 --set train.seq_len=16";
  const auto a = run(args);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  EXPECT_NE(a.output.find("val_loss"), std::string::npos) << a.output;
  EXPECT_NE(a.output.find("tokens/s"), std::string::npos) << a.output;
  const auto h = hash_of(a.output);
  ASSERT_EQ(h.size(), 16u) << a.output;
  const auto b = run(args);
  EXPECT_EQ(hash_of(b.output), h);
  const auto c = run(args + " --set train.seed=2");
  EXPECT_NE(hash_of(c.output), h) << "the seed reaches the state";
}

TEST(train, bad_configs_exit_1_naming_the_key) {
  for (const auto& [set, key] : std::vector<std::pair<std::string, std::string>>{
           {"model.preset=gigantic", "model.preset"},
           {"model.experts=0", "model.experts"},
           {"model.top_k=9", "model.top_k"},
           {"train.corpus=/no/such/corpus", "train.corpus"},
           {"train.itertions=5", "train.itertions"},
           {"train.device=tpu", "train.device"},
           // 10^9 x 64 x (256 + 32) x 4 bytes: refused before any allocation (was an OOM kill)
           {"train.micro_batch_size=1000000000", "train.micro_batch_size"},
           {"cluster.spares=1 --set bogus.key=1", "bogus.key"}}) {
    const auto r = run("train " + tiny() + " --set " + set);
    EXPECT_EQ(r.exit_code, 1) << set << "\n" << r.output;
    EXPECT_NE(r.output.find(key + ":"), std::string::npos) << set << "\n" << r.output;
  }
  const std::string bad = ::testing::TempDir() + "/bad.toml";
  std::ofstream(bad) << "[model]\npreset = \"tiny\"\nlayers = [1, 2]\n";
  const auto r = run("train " + bad);
  EXPECT_EQ(r.exit_code, 1);
  EXPECT_NE(r.output.find("model.layers"), std::string::npos) << r.output;
  const auto missing = run("train /no/such/file.toml");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("/no/such/file.toml"), std::string::npos) << missing.output;
}

// train.device = "cuda": on a GPU it trains and repeats its state_hash bit for bit; without
// one (or without the CUDA backend) it stops with an error naming the key.
TEST(train, the_cuda_device_trains_on_a_gpu_or_names_the_key) {
  const std::string args =
      "train " + tiny() +
      " --set train.iterations=3 --set train.seq_len=16 --set train.device=cuda";
  const auto a = run(args);
  if (a.exit_code != 0) {
    EXPECT_EQ(a.exit_code, 1) << a.output;
    EXPECT_NE(a.output.find("train.device:"), std::string::npos) << a.output;
    GTEST_SKIP() << "no usable GPU here; the error names the key: " << a.output;
  }
  EXPECT_NE(a.output.find("device: "), std::string::npos) << a.output;
  const auto h = hash_of(a.output);
  ASSERT_EQ(h.size(), 16u) << a.output;
  EXPECT_EQ(hash_of(run(args).output), h) << "two GPU runs must end in the same state";
}

}  // namespace
