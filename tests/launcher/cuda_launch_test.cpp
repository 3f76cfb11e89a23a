// The engine on the GPU (train.device = cuda): real worker processes, each stage's layers on
// the device, the training state on the host. Pipelining changes no bit (the same state_hash as
// `moevement train` on the GPU), and a killed stage is rebuilt bit-exact by sparse-to-dense
// replay on the GPU. Needs a GPU: skips, saying why, without one.
#include <gtest/gtest.h>

#include <string>

#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace {

using namespace moevement::test_support;

std::string tiny() {
  return source_path("examples/configs/tiny.toml");
}

const std::string on_gpu = " --set train.device=cuda --set train.seq_len=16";

// Empty when the GPU path runs here, else why not.
const std::string& no_gpu() {
  static const std::string why = [] {
    const auto r = run_moevement("train " + tiny() + on_gpu + " --set train.iterations=1");
    return r.exit_code == 0 ? std::string() : r.output;
  }();
  return why;
}

std::string gpu_reference(int iterations, int dp) {
  const auto r = run_moevement("train " + tiny() + on_gpu +
                               " --set train.iterations=" + std::to_string(iterations) +
                               " --set parallel.dp=" + std::to_string(dp));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return hash_of(r.output);
}

class cuda_launch : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!no_gpu().empty()) GTEST_SKIP() << "no usable GPU: " << no_gpu();
  }
};

TEST_F(cuda_launch, pipelined_gpu_stages_equal_the_gpu_trainer) {
  for (const auto& [pp, dp] : std::vector<std::pair<int, int>>{{1, 1}, {2, 1}, {4, 1}, {2, 2}}) {
    const std::string name = "gpu_pp" + std::to_string(pp) + "dp" + std::to_string(dp);
    const auto o =
        launch(name, tiny() + on_gpu + " --set train.iterations=4 --set parallel.pp=" +
                         std::to_string(pp) + " --set parallel.dp=" + std::to_string(dp));
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_EQ(o.hash, gpu_reference(4, dp)) << name;
  }
}

TEST_F(cuda_launch, a_killed_gpu_stage_is_rebuilt_bit_exact) {
  const std::string job = tiny() + on_gpu +
                          " --set train.iterations=12 --set parallel.pp=3 "
                          "--set checkpoint.policy=moevement --set checkpoint.w_sparse=2 "
                          "--set cluster.spares=2 --set cluster.failure_timeout_ms=3000";
  const std::string want = gpu_reference(12, 1);
  const auto one = launch("gpu_kill", job + " --inject kill:stage=1,replica=0,iter=7");
  ASSERT_EQ(one.exit_code, 0) << one.output;
  EXPECT_EQ(one.hash, want);
  ASSERT_NE(one.first("recovery_end"), nullptr) << one.output;
  // two neighbours at once: one region replayed jointly, on the GPU
  const auto two = launch("gpu_joint", job +
                                           " --inject kill:stage=1,replica=0,iter=7"
                                           " --inject kill:stage=2,replica=0,iter=7");
  ASSERT_EQ(two.exit_code, 0) << two.output;
  EXPECT_EQ(two.hash, want);
}

}  // namespace
