// The engine on the GPU (train.device = cuda): real worker processes, each stage's layers on
// the device, the training state on the host. Pipelining changes no bit (the same state_hash as
// `moevement train` on the GPU), and a killed stage is rebuilt bit-exact by sparse-to-dense
// replay on the GPU. Needs a GPU: skips, saying why, without one.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>

#include "tests/support/launch_job.hpp"
#include "tests/support/run_moevement.hpp"

namespace {

using namespace moevement::test_support;

std::string tiny() {
  return source_path("examples/configs/tiny.toml");
}

const std::string on_gpu = " --set train.device=cuda --set train.seq_len=16";

// Empty when the GPU path runs here; else the error naming train.device (no GPU, or a build
// without CUDA). Any other failure of the probe is a failure of the GPU path, not a skip.
const std::string& no_gpu() {
  static const std::string why = [] {
    const auto r = run_moevement("train " + tiny() + on_gpu + " --set train.iterations=1");
    if (r.exit_code == 0) return std::string();
    EXPECT_EQ(r.exit_code, 1) << r.output;
    EXPECT_NE(r.output.find("train.device:"), std::string::npos) << r.output;
    return r.output;
  }();
  return why;
}

std::string gpu_train(int iterations, int dp, const std::string& extra = "") {
  const auto r = run_moevement("train " + tiny() + on_gpu +
                               " --set train.iterations=" + std::to_string(iterations) +
                               " --set parallel.dp=" + std::to_string(dp) + extra);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return r.output;
}
std::string gpu_reference(int iterations, int dp) {
  return hash_of(gpu_train(iterations, dp));
}

// The text after "val_loss " on the final line ("" if none).
std::string val_loss_of(const std::string& out) {
  const auto at = out.rfind("val_loss ");
  if (at == std::string::npos) return "";
  return out.substr(at + 9, out.find_first_of(" \n", at + 9) - (at + 9));
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

// Validation runs after the step: the GPU stages must see the stepped weights, as the trainer
// does (the same final validation loss, to the printed digit, and the same hash).
TEST_F(cuda_launch, gpu_stages_validate_on_the_current_weights) {
  const std::string val = " --set train.val_every=2 --set train.val_batches=2";
  const std::string t = gpu_train(4, 1, val);
  const auto o =
      launch("gpu_val", tiny() + on_gpu + val + " --set train.iterations=4 --set parallel.pp=2");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  ASSERT_FALSE(val_loss_of(t).empty()) << t;
  EXPECT_EQ(val_loss_of(o.output), val_loss_of(t)) << o.output << "\n" << t;
  EXPECT_EQ(o.hash, hash_of(t));
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

// The dense baselines with GPU stages: a capture reads the host copy, synced from the device
// at each checkpoint; a rollback writes the survivors' host copies, which their devices then
// take up. Both must keep every bit.
TEST_F(cuda_launch, a_gpu_job_rolls_back_bit_exact_under_dense_memory) {
  const std::string want = gpu_reference(10, 2);
  const auto o = launch("gpu_dense", tiny() + on_gpu +
                                         " --set train.iterations=10 --set parallel.pp=2 "
                                         "--set parallel.dp=2 --set cluster.spares=1 "
                                         "--set checkpoint.policy=dense-memory "
                                         "--set checkpoint.interval=3 "
                                         "--set cluster.failure_timeout_ms=3000 "
                                         "--inject kill:stage=1,replica=1,iter=7");
  ASSERT_EQ(o.exit_code, 0) << o.output;
  const std::string* end = o.first("recovery_end");
  ASSERT_NE(end, nullptr) << o.output;
  EXPECT_NE(o.output.find("rolled back to iteration 6"), std::string::npos) << o.output;
  EXPECT_EQ(o.hash, want);
}

// dp = 2: the replicas of a GPU stage sum their gradients through NCCL (train.collectives =
// auto, device to device) or through the host: the same bits, the GPU trainer's. The run log
// says which path summed (device_sum_s in each iteration record, NCCL only).
TEST_F(cuda_launch, nccl_and_host_gradient_sums_give_the_same_bits) {
  const std::string want = gpu_reference(6, 2);
  for (const std::string c : {"auto", "host"}) {
    const auto o = launch("gpu_sum_" + c, tiny() + on_gpu +
                                              " --set train.iterations=6 --set parallel.pp=2 "
                                              "--set parallel.dp=2 --set train.collectives=" +
                                              c);
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_EQ(o.hash, want) << c;
    int summed_on_device = 0;
    for (const auto& l : o.log) {
      if (l.find("\"kind\":\"iteration\"") == std::string::npos) continue;
      if (number_field(l, "device_sum_s") > 0) ++summed_on_device;
    }
    EXPECT_EQ(summed_on_device, c == "auto" ? 6 : 0) << o.output;
  }
}

// A replica lost during an NCCL sum: killed, or hung (SIGSTOP) before its backward while its
// peer waits in the sum. The survivors' groups are aborted (never waiting on the dead or hung
// peer), the replacement joins new ones, and the hash is the fault-free run's.
TEST_F(cuda_launch, a_replica_lost_in_an_nccl_group_is_rebuilt_bit_exact) {
  const std::string job = tiny() + on_gpu +
                          " --set train.iterations=10 --set parallel.pp=2 --set parallel.dp=2 "
                          "--set checkpoint.policy=moevement --set checkpoint.w_sparse=2 "
                          "--set cluster.spares=1 --set cluster.failure_timeout_ms=3000";
  const std::string want = gpu_reference(10, 2);
  for (const std::string how :
       {"kill:stage=1,replica=1,iter=6", "hang:stage=1,replica=1,iter=6,phase=backward"}) {
    const auto o = launch("gpu_nccl_" + how.substr(0, 4), job + " --inject " + how);
    ASSERT_EQ(o.exit_code, 0) << o.output;
    EXPECT_EQ(o.hash, want) << how;
    const std::string* end = o.first("recovery_end");
    ASSERT_NE(end, nullptr) << o.output;
    EXPECT_GE(number_field(*end, "group_abort_s"), 0.0) << *end;
    // the first iteration after the recovery waited for the new groups to form
    double formed = 0;
    for (const auto& l : o.log) {
      if (l.find("\"kind\":\"iteration\"") != std::string::npos) {
        formed = std::max(formed, number_field(l, "group_form_s"));
      }
    }
    EXPECT_GT(formed, 0.0) << how;
  }
}

}  // namespace
