// Policy moevement's windows in the durable tier: a window written from a capture loads back
// byte for byte; a corrupt slot, a torn window or another stage's window is rejected with its
// reason and the one before it is used; a pinned window outlives drop_before until the
// writer is done with it; the writer runs its jobs in order and drains.
#include "recovery/durable_window.hpp"

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <fstream>

#include <fmt/format.h>

#include "engine/local_pipeline.hpp"
#include "recovery/sparse_capture.hpp"
#include "tests/support/small_train.hpp"

namespace moevement::recovery {
namespace {

using test_support::test_train;

class durable_window_test : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = std::filesystem::temp_directory_path() /
            ("durable_window_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(root_);
    ops_ = pipe_.stage(1, 0).operators();
    sched_.emplace(sparse_config{2}, ops_);
    cap_.emplace(*sched_, 1, 0, &pipe_.scaler());
    pipe_.set_hooks(1, 0, &*cap_);
  }
  void TearDown() override {
    pipe_.set_hooks(1, 0, nullptr);
    std::filesystem::remove_all(root_);
  }
  // Trains until window `w` (W = 2) is complete and writes it.
  std::uint64_t write(durable_store& store, std::uint64_t w) {
    while (!cap_->complete(w)) pipe_.train_iteration();
    const auto slots = cap_->window_slots(w);
    return write_durable_window(store, {1, 0, w, cap_->first_iteration(w), 2}, slots);
  }
  std::filesystem::path window_path(std::uint64_t id) const {
    return durable_window_dir(root_, 1, 0) / fmt::format("window-{:020}", id);
  }

  std::filesystem::path root_;
  engine::local_pipeline pipe_{models::preset("tiny"), test_train(), 2};
  std::vector<models::operator_state*> ops_;
  std::optional<stage_schedule> sched_;
  std::optional<sparse_capture> cap_;
};

TEST_F(durable_window_test, a_written_window_loads_back_byte_for_byte) {
  durable_store store(durable_window_dir(root_, 1, 0));
  const auto bytes = write(store, 0);
  const auto slots = cap_->window_slots(0);
  std::uint64_t slot_bytes = 0;
  for (auto s : slots) slot_bytes += s.size();
  EXPECT_GT(bytes, slot_bytes) << "the slots plus the meta";
  auto w = load_durable_window(store, 0, 1, 0);
  ASSERT_TRUE(w.ok()) << w.err().message;
  EXPECT_EQ(w->meta, (durable_window_meta{1, 0, 0, cap_->first_iteration(0), 2}));
  ASSERT_EQ(w->slots.size(), 2u);
  for (std::size_t j = 0; j < 2; ++j) {
    ASSERT_EQ(w->slots[j].size(), slots[j].size());
    EXPECT_TRUE(std::equal(slots[j].begin(), slots[j].end(), w->slots[j].begin()));
  }
}

TEST_F(durable_window_test, a_corrupt_newest_window_is_rejected_and_the_previous_one_used) {
  durable_store store(durable_window_dir(root_, 1, 0));
  write(store, 0);
  write(store, 1);
  {
    std::fstream f(window_path(1) / "slot-000001.snap",
                   std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good());
    f.seekp(40);
    f.put('\x5a');
  }
  std::vector<std::string> rejected;
  EXPECT_EQ(verified_durable_windows(store, 1, 0, &rejected), std::vector<std::uint64_t>{0});
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_NE(rejected[0].find("window 1"), std::string::npos) << rejected[0];
  EXPECT_NE(rejected[0].find("checksum mismatch"), std::string::npos) << rejected[0];

  // Torn: the newest window lost its last slot (a crash between files cannot do this, the
  // manifest is written last, but a damaged disk can).
  std::filesystem::remove(window_path(1) / "slot-000001.snap");
  rejected.clear();
  EXPECT_EQ(verified_durable_windows(store, 1, 0, &rejected), std::vector<std::uint64_t>{0});
  ASSERT_EQ(rejected.size(), 1u);
  EXPECT_NE(rejected[0].find("missing"), std::string::npos) << rejected[0];
}

TEST_F(durable_window_test, another_stage_replicas_window_is_refused) {
  durable_store store(durable_window_dir(root_, 1, 0));
  write(store, 0);
  auto w = load_durable_window(store, 0, 2, 0);
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.err().message.find("window.meta names stage 1 replica 0"), std::string::npos)
      << w.err().message;
  std::vector<std::string> rejected;
  EXPECT_TRUE(verified_durable_windows(store, 1, 1, &rejected).empty());
  EXPECT_EQ(rejected.size(), 1u);
}

TEST_F(durable_window_test, clear_deletes_every_window) {
  durable_store store(durable_window_dir(root_, 1, 0));
  write(store, 0);
  write(store, 1);
  store.clear();
  EXPECT_TRUE(store.windows().empty());
}

TEST_F(durable_window_test, a_pinned_window_outlives_drop_before_until_unpinned) {
  while (!cap_->complete(0)) pipe_.train_iteration();
  cap_->pin(0);
  const auto slots = cap_->window_slots(0);
  const std::vector<std::byte> copy(slots[0].begin(), slots[0].end());
  while (!cap_->complete(2)) pipe_.train_iteration();  // persists 1, then 2
  EXPECT_TRUE(cap_->complete(0)) << "pinned: still held";
  EXPECT_EQ(cap_->windows_held(), 1u) << "only window 2 counts against the capture's bound";
  const auto again = cap_->window_slots(0);
  EXPECT_TRUE(std::equal(copy.begin(), copy.end(), again[0].begin())) << "and unchanged";
  cap_->unpin(0);
  EXPECT_FALSE(cap_->complete(0));
  EXPECT_EQ(cap_->windows_held(), 1u);
}

TEST(durable_writer, runs_jobs_in_order_and_drains) {
  durable_writer w;
  std::vector<int> order;
  std::atomic<int> ran{0};
  for (int i = 0; i < 50; ++i) {
    w.post([&, i] {
      order.push_back(i);
      ++ran;
    });
  }
  w.drain();
  EXPECT_EQ(ran.load(), 50);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[std::size_t(i)], i);
}

}  // namespace
}  // namespace moevement::recovery
