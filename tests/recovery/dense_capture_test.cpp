// The dense baselines: Young's interval, full snapshots every k iterations, global rollback
// from host memory and from the durable tier (bit-exact against the fault-free run, pp=2
// dp=2), and a corrupt or truncated newest file rejected with the previous good one used.
#include "recovery/dense_capture.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <fstream>
#include <memory>

#include "engine/local_pipeline.hpp"
#include "recovery/baseline_recovery.hpp"
#include "tests/support/small_train.hpp"

namespace moevement::recovery {
namespace {

TEST(young_interval, is_sqrt_2_c_mtbf_over_the_iteration_time) {
  EXPECT_EQ(young_interval(2.0, 3600.0, 1.0), 120);  // sqrt(14400) = 120
  EXPECT_EQ(young_interval(0.5, 100.0, 2.5), 4);     // sqrt(100) / 2.5 = 4
  EXPECT_EQ(young_interval(0.02, 3600.0, 0.5), 24);  // sqrt(144) / 0.5 = 24
  EXPECT_EQ(young_interval(0.0, 3600.0, 1.0), 1);    // free snapshots: every iteration
  EXPECT_EQ(young_interval(1e-9, 1.0, 10.0), 1);     // never below 1
  EXPECT_THROW(young_interval(-1.0, 3600.0, 1.0), std::invalid_argument);
  EXPECT_THROW(young_interval(1.0, 0.0, 1.0), std::invalid_argument);
  EXPECT_THROW(young_interval(1.0, 3600.0, 0.0), std::invalid_argument);
}

// Young's k is the integer argmin of the expected overhead C/(kT) + kT/(2 MTBF).
TEST(young_interval, is_the_argmin_of_the_expected_overhead) {
  for (double c : {0.01, 0.3, 1.0, 7.0, 45.0}) {
    for (double mtbf : {60.0, 1800.0, 86400.0}) {
      for (double t : {0.05, 0.9, 4.0}) {
        int best = 1;
        for (int k = 2; k <= 200000; ++k) {
          if (expected_overhead(k, c, mtbf, t) < expected_overhead(best, c, mtbf, t)) best = k;
        }
        const int k = young_interval(c, mtbf, t);
        // rounding the continuous optimum and the integer argmin agree up to float ties
        EXPECT_NEAR(expected_overhead(k, c, mtbf, t), expected_overhead(best, c, mtbf, t),
                    1e-12 * expected_overhead(best, c, mtbf, t))
            << "C=" << c << " MTBF=" << mtbf << " T=" << t << " young " << k << " argmin " << best;
      }
    }
  }
}

TEST(young_interval, resolve_uses_the_configured_interval_unless_zero) {
  policy_config cfg;
  cfg.interval = 7;
  EXPECT_EQ(resolve_interval(cfg, 5.0, 1.0), 7);
  cfg.interval = 0;
  cfg.mtbf_s = 100.0;
  EXPECT_EQ(resolve_interval(cfg, 0.5, 2.5), 4);
  cfg.mtbf_s = -1;
  EXPECT_THROW(resolve_interval(cfg, 0.5, 2.5), std::invalid_argument);
  cfg = {};
  cfg.keep = 1;
  EXPECT_THROW(cfg.validate(), std::invalid_argument);
  EXPECT_EQ(parse_pec_order("load-aware"), pec_selection::load_aware);
  EXPECT_THROW(parse_pec_order("random"), std::invalid_argument);
}

using test_support::test_train;

constexpr int pp = 2, dp = 2;
constexpr int total_iterations = 10;

std::uint64_t fault_free_hash(const models::model_config& m, const models::train_config& t) {
  engine::local_pipeline pipe(m, t, pp);
  for (int i = 0; i < total_iterations; ++i) pipe.train_iteration();
  return pipe.state_hash();
}

struct dense_job {
  models::model_config model;
  models::train_config train;
  engine::local_pipeline pipe;
  std::vector<std::unique_ptr<dense_capture>> caps;

  dense_job(int interval, const std::filesystem::path* dir = nullptr,
            const models::model_config& m = models::preset("tiny"),
            const models::train_config& t = test_train(dp))
      : model(m), train(t), pipe(m, t, pp) {
    for (int d = 0; d < dp; ++d) {
      for (int s = 0; s < pp; ++s) {
        caps.push_back(dir ? std::make_unique<dense_capture>(s, d, interval, &pipe.scaler(), *dir,
                                                             policy_config{}.keep)
                           : std::make_unique<dense_capture>(s, d, interval, &pipe.scaler()));
        pipe.set_hooks(s, d, caps.back().get());
      }
    }
  }
  std::vector<const dense_capture*> survivors() const {
    std::vector<const dense_capture*> out;
    for (const auto& c : caps) out.push_back(c.get());
    return out;
  }
  void train_to(int iteration) {
    while (pipe.iteration() < iteration) pipe.train_iteration();
  }
};

void expect_resumes_bit_exactly(engine::local_pipeline& restored, std::uint64_t want) {
  while (restored.iteration() < total_iterations) restored.train_iteration();
  EXPECT_EQ(restored.state_hash(), want);
}

TEST(dense_capture, snapshots_every_k_iterations_and_keeps_two) {
  dense_job job(3);
  job.train_to(5);
  auto held = job.caps[0]->held();
  ASSERT_EQ(held.size(), 1u);
  EXPECT_EQ(held[0].iteration, 3);
  job.train_to(9);  // states 3, 6, 9 captured; the buffer of 3 now holds 9
  held = job.caps[0]->held();
  ASSERT_EQ(held.size(), 2u);
  EXPECT_EQ(held[0].iteration, 9);
  EXPECT_EQ(held[1].iteration, 6);
  EXPECT_EQ(job.caps[0]->snapshots(), 3u);
  // every operator in full, the bytes equal the live state
  const auto view = parse_snapshot(held[0].bytes);
  const auto ops = job.pipe.stage(0, 0).operators();
  ASSERT_EQ(view.entries.size(), ops.size());
  engine::local_pipeline other(job.model, job.train, pp);
  const auto other_ops = other.stage(0, 0).operators();
  for (std::size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(view.entries[i].mode, models::op_mode::active);
    load_operator(view.entries[i], *other_ops[i]);
  }
  EXPECT_EQ(engine::operator_digests(other_ops), engine::operator_digests(ops));
  // reused buffers: no growth after the second snapshot
  const auto bytes = job.caps[0]->bytes_held();
  job.train_to(12);
  EXPECT_EQ(job.caps[0]->bytes_held(), bytes);
  EXPECT_THROW(dense_capture(0, 0, 0, nullptr), std::invalid_argument);
}

TEST(dense_rollback, from_memory_is_bit_exact_for_pp2_dp2) {
  const auto want = fault_free_hash(models::preset("tiny"), test_train(dp));
  dense_job job(3);
  job.train_to(8);  // the fault aborts iteration 8; the newest snapshot is of iteration 6
  // the replacement job: every process restarted, then restored from peers' host memory
  engine::local_pipeline fresh(job.model, job.train, pp);
  const auto rep = rollback_from_memory(fresh, job.survivors());
  EXPECT_EQ(rep.iteration, 6);
  EXPECT_TRUE(rep.rejected.empty());
  ASSERT_EQ(rep.sources.size(), std::size_t(pp));
  expect_resumes_bit_exactly(fresh, want);
  // the same into the surviving (diverged) pipeline itself, with replica 0's memory lost
  auto survivors = job.survivors();
  survivors[0] = nullptr;
  survivors[1] = nullptr;
  job.pipe.set_hooks(0, 0, nullptr);  // its capture is gone with it
  EXPECT_EQ(rollback_from_memory(job.pipe, survivors).iteration, 6);
  expect_resumes_bit_exactly(job.pipe, want);
}

TEST(dense_rollback, one_stage_from_bytes_checks_before_it_loads) {
  dense_job job(2);
  job.train_to(4);  // state 4 captured
  engine::local_pipeline fresh(job.model, job.train, pp);
  const auto bytes0 = job.caps[0]->latest()->bytes;  // stage 0 replica 0
  std::vector<engine::stage_model*> stage1{&fresh.stage(1, 0), &fresh.stage(1, 1)};
  const auto before = engine::operator_digests(fresh.stage(1, 0).operators());
  try {
    restore_full_snapshot(bytes0, 1, 4, stage1);
    FAIL() << "stage 0's snapshot was loaded into stage 1";
  } catch (const snapshot_error& e) {
    EXPECT_NE(std::string(e.what()).find("stage 0's snapshot"), std::string::npos) << e.what();
  }
  EXPECT_EQ(engine::operator_digests(fresh.stage(1, 0).operators()), before);  // untouched
  std::vector<engine::stage_model*> stage0{&fresh.stage(0, 0), &fresh.stage(0, 1)};
  EXPECT_THROW(restore_full_snapshot(bytes0, 0, 2, stage0), snapshot_error);  // wrong iteration
  const auto got = restore_full_snapshot(bytes0, 0, -1, stage0);
  EXPECT_EQ(got.tag.state_iteration, 4);
  for (int d = 0; d < dp; ++d) {
    EXPECT_EQ(engine::operator_digests(fresh.stage(0, d).operators()),
              engine::operator_digests(job.pipe.stage(0, d).operators()));
  }
}

TEST(dense_rollback, f16_loss_scaler_is_restored) {
  auto m = models::preset("tiny");
  m.compute_dtype = models::dtype::f16;
  auto t = test_train(dp);
  t.loss_scale_window = 1;  // the scale moves every iteration
  const auto want = fault_free_hash(m, t);
  dense_job job(4, nullptr, m, t);
  job.train_to(7);
  engine::local_pipeline fresh(m, t, pp);
  EXPECT_EQ(rollback_from_memory(fresh, job.survivors()).iteration, 4);
  EXPECT_EQ(fresh.scaler().scale, parse_snapshot(job.caps[0]->latest()->bytes).scaler.scale);
  EXPECT_TRUE(fresh.scaler().enabled);
  expect_resumes_bit_exactly(fresh, want);
}

TEST(dense_rollback, nothing_to_roll_back_to_is_an_error) {
  dense_job job(5);
  job.train_to(3);
  engine::local_pipeline fresh(job.model, job.train, pp);
  EXPECT_THROW(rollback_from_memory(fresh, job.survivors()), rollback_error);
}

class dense_disk : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("dense_capture_test_" + std::to_string(::getpid()) + "_" +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  // Trains to iteration 9 with dense-disk every 2 iterations: states 2, 4, 6, 8 persisted,
  // 6 and 8 kept on disk per stage replica.
  void run() {
    dense_job job(2, &dir_);
    job.train_to(9);
    for (auto& c : job.caps) {
      c->flush();
      EXPECT_EQ(c->persisted(), 4u);
      EXPECT_EQ(c->stalls() == 0, c->stall_seconds() == 0.0);
    }
    model_ = job.model;
    train_ = job.train;
  }
  std::filesystem::path snapshot_file(int s, int d, std::uint64_t window) const {
    char name[40];
    std::snprintf(name, sizeof name, "window-%020llu", static_cast<unsigned long long>(window));
    return replica_dir(dir_, s, d) / name / "snapshot";
  }
  void flip_byte(const std::filesystem::path& p) {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(100);
    char c = 0;
    f.seekg(100);
    f.read(&c, 1);
    c ^= 0x20;
    f.seekp(100);
    f.write(&c, 1);
  }
  std::filesystem::path dir_;
  models::model_config model_;
  models::train_config train_;
};

TEST_F(dense_disk, persists_in_the_background_and_rolls_back_bit_exactly) {
  const auto want = fault_free_hash(models::preset("tiny"), test_train(dp));
  run();
  durable_store store(replica_dir(dir_, 1, 1));
  EXPECT_EQ(store.windows(), (std::vector<std::uint64_t>{6, 8}));
  engine::local_pipeline fresh(model_, train_, pp);
  const auto rep = rollback_from_disk(fresh, dir_);
  EXPECT_EQ(rep.iteration, 8);
  EXPECT_TRUE(rep.rejected.empty());
  expect_resumes_bit_exactly(fresh, want);
}

TEST_F(dense_disk, a_corrupt_newest_file_is_rejected_and_the_previous_good_one_used) {
  const auto want = fault_free_hash(models::preset("tiny"), test_train(dp));
  run();
  // only replica 0's copy of stage 1 is corrupt: replica 1's copy of iteration 8 serves
  flip_byte(snapshot_file(1, 0, 8));
  {
    engine::local_pipeline fresh(model_, train_, pp);
    const auto rep = rollback_from_disk(fresh, dir_);
    EXPECT_EQ(rep.iteration, 8);
    ASSERT_EQ(rep.rejected.size(), 1u);
    EXPECT_NE(rep.rejected[0].find("checksum mismatch"), std::string::npos) << rep.rejected[0];
    EXPECT_NE(rep.rejected[0].find("stage-1-replica-0"), std::string::npos) << rep.rejected[0];
    expect_resumes_bit_exactly(fresh, want);
  }
  // both copies of stage 1 at 8 bad (one corrupt, one truncated): every stage rolls back to 6
  std::filesystem::resize_file(snapshot_file(1, 1, 8), 1000);
  engine::local_pipeline fresh(model_, train_, pp);
  const auto rep = rollback_from_disk(fresh, dir_);
  EXPECT_EQ(rep.iteration, 6);
  ASSERT_EQ(rep.rejected.size(), 2u);
  EXPECT_NE(rep.rejected[1].find("truncated"), std::string::npos) << rep.rejected[1];
  expect_resumes_bit_exactly(fresh, want);
}

TEST_F(dense_disk, a_verified_file_that_is_no_snapshot_is_rejected) {
  run();
  // well-formed durable windows whose blob is not a snapshot of this stage
  for (int d = 0; d < dp; ++d) {
    durable_store store(replica_dir(dir_, 0, d));
    const std::vector<std::byte> junk(200, std::byte{7});
    const blob_view blob{"snapshot", junk};
    store.write_window(10, std::span(&blob, 1));
  }
  engine::local_pipeline fresh(model_, train_, pp);
  const auto rep = rollback_from_disk(fresh, dir_);
  EXPECT_EQ(rep.iteration, 8);  // 10 exists only for stage 0, and is junk there
  ASSERT_EQ(rep.rejected.size(), 2u);
  EXPECT_NE(rep.rejected[0].find("bad magic"), std::string::npos) << rep.rejected[0];
  // every copy of every window of stage 0 gone bad: a clear error, nothing half restored
  for (int d = 0; d < dp; ++d) {
    for (std::uint64_t w : {6, 8}) std::filesystem::resize_file(snapshot_file(0, d, w), 10);
  }
  engine::local_pipeline fresh2(model_, train_, pp);
  try {
    rollback_from_disk(fresh2, dir_);
    FAIL() << "rolled back without a usable snapshot";
  } catch (const rollback_error& e) {
    EXPECT_NE(std::string(e.what()).find("no iteration has a verified full snapshot"),
              std::string::npos)
        << e.what();
  }
  EXPECT_THROW(rollback_from_disk(fresh2, dir_ / "missing"), rollback_error);
}

TEST_F(dense_disk, an_unusable_directory_is_named) {
  std::filesystem::create_directories(dir_);
  std::ofstream(dir_ / "file") << "x";
  try {
    dense_capture cap(0, 0, 1, nullptr, dir_ / "file", 2);
    FAIL() << "a directory under a file was accepted";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("file"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moevement::recovery
