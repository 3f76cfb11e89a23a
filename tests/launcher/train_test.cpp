// `moevement train` as a user runs it: trains, ends with state_hash=, rejects bad configs by key.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tests/support/run_moevement.hpp"

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

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
           {"model.preset=moe-llava", "model.preset"},  // the paper's: shapes, not trainable
           {"model.experts=0", "model.experts"},
           {"model.top_k=9", "model.top_k"},
           {"train.corpus=/no/such/corpus", "train.corpus"},
           {"train.itertions=5", "train.itertions"},
           {"train.device=tpu", "train.device"},
           // 10^9 x 64 x (256 + 32) x 4 bytes: refused before any allocation (was an OOM kill)
           {"train.micro_batch_size=1000000000", "train.micro_batch_size"},
           {"cluster.spares=1 --set bogus.key=1", "bogus.key"},
           // the engine's keys are checked as launch checks them (then ignored)
           {"parallel.ppp=2", "parallel.ppp"},
           {"cluster.spares=-1", "cluster.spares"},
           // a custom stage type's hash would not be that job's reference
           {"engine.stage=residual_mlp", "engine.stage"}}) {
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

// --checkpoint-dir and --resume: `train` killed with SIGKILL mid-run goes on from its newest
// checkpoint and ends with the uninterrupted run's hash; a corrupt newest checkpoint is
// skipped (saying why) for the one before it, with the same hash.
TEST(train, a_killed_run_resumes_from_its_newest_checkpoint_bit_exact) {
  namespace fs = std::filesystem;
  const std::string config = tiny() + " --set train.iterations=80 --set train.seq_len=16 " +
                             "--set train.val_batches=2 --set train.val_every=0";
  const auto whole = run("train " + config);
  ASSERT_EQ(whole.exit_code, 0) << whole.output;
  const fs::path dir = fs::path(::testing::TempDir()) / ("train_ckpt_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const std::string bin = std::getenv("MOEVEMENT_BIN");
  const std::string ckpt = " --checkpoint-dir " + dir.string() + " --checkpoint-every 3";
  const pid_t pid = fork();
  if (pid == 0) {
    const std::string cmd = "exec " + bin + " train " + config + ckpt + " > /dev/null 2>&1";
    execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
    _exit(127);
  }
  // Killed once its second checkpoint is on disk (the first one pruned is then still beside).
  auto windows = [&] {
    std::vector<fs::path> w;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (fs::exists(e.path() / "MANIFEST")) w.push_back(e.path());
    }
    std::sort(w.begin(), w.end());
    return w;
  };
  for (int i = 0; i < 2000 && windows().size() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFSIGNALED(status)) << "it ended before the kill: make the run longer";
  const auto kept = windows();
  ASSERT_GE(kept.size(), 2u);
  const fs::path copy = dir.string() + ".copy";
  fs::remove_all(copy);
  fs::copy(dir, copy, fs::copy_options::recursive);

  const auto resumed = run("train " + config + ckpt + " --resume");
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_NE(resumed.output.find("resumed from the checkpoint of iteration"), std::string::npos)
      << resumed.output;
  EXPECT_EQ(hash_of(resumed.output), hash_of(whole.output)) << resumed.output;

  // The newest one corrupted: the one before it, and the same hash.
  const fs::path newest = copy / kept.back().filename() / "state";
  {
    std::fstream f(newest, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(4096);
    f.put('\x5a');
  }
  const auto older = run("train " + config + " --checkpoint-dir " + copy.string() + " --resume");
  ASSERT_EQ(older.exit_code, 0) << older.output;
  EXPECT_NE(older.output.find("skipped checkpoint"), std::string::npos) << older.output;
  EXPECT_EQ(hash_of(older.output), hash_of(whole.output)) << older.output;
  fs::remove_all(dir);
  fs::remove_all(copy);
}

// What cannot be resumed says why: another job's checkpoint (naming the setting), an empty or
// missing directory; and the flags' bad values.
TEST(train, a_resume_refuses_another_jobs_checkpoint_and_bad_flags) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / ("train_other_" + std::to_string(getpid()));
  fs::remove_all(dir);
  const std::string config = tiny() + " --set train.iterations=2 --set train.seq_len=16";
  const std::string ckpt = " --checkpoint-dir " + dir.string();
  ASSERT_EQ(run("train " + config + ckpt + " --checkpoint-every 1").exit_code, 0);
  const auto other = run("train " + config + " --set train.seed=9" + ckpt + " --resume");
  EXPECT_EQ(other.exit_code, 1);
  EXPECT_NE(other.output.find("train.seed = 1; this config has 9"), std::string::npos)
      << other.output;
  // A checkpoint past train.iterations: refused, saying which (it trained backwards before).
  const std::string fewer = tiny() + " --set train.iterations=1 --set train.seq_len=16";
  const auto past = run("train " + fewer + ckpt + " --resume");
  EXPECT_EQ(past.exit_code, 1);
  EXPECT_NE(past.output.find("is of iteration 2, past train.iterations = 1"), std::string::npos)
      << past.output;
  fs::remove_all(dir);
  fs::create_directories(dir);
  const auto empty = run("train " + config + ckpt + " --resume");
  EXPECT_EQ(empty.exit_code, 1);
  EXPECT_NE(empty.output.find("nothing to resume"), std::string::npos) << empty.output;
  fs::remove_all(dir);
  const auto missing = run("train " + config + ckpt + " --resume");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("is not a directory"), std::string::npos) << missing.output;
  EXPECT_FALSE(fs::exists(dir)) << "a failed resume creates nothing";
  for (const std::string& bad : std::vector<std::string>{
           " --resume", ckpt + " --checkpoint-every 0", ckpt + " --checkpoint-every x",
           " --checkpoint-dir", " --checkpoint-every 10"}) {  // no directory: nowhere to go
    const auto r = run("train " + config + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << "\n" << r.output;
    EXPECT_NE(r.output.find("usage:"), std::string::npos) << bad << "\n" << r.output;
  }
}

}  // namespace
