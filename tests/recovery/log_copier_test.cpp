// The upstream log's copies off the compute thread: whatever is queued is in the log once
// anyone settles, a settle made on another thread waits for the copy in progress, and the
// bytes copied are those at the copy (the engine keeps them unchanged until it settles).
#include "recovery/log_copier.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <thread>

#include "recovery/log_store.hpp"

namespace moevement::recovery {
namespace {

log_key key_of(const log_copier::sent& s) {
  return {
      std::uint64_t(s.iteration), std::uint32_t(s.micro_batch),
      s.kind == engine::boundary::activation ? log_direction::activation : log_direction::gradient,
      0};
}

TEST(log_copier, queued_sends_are_in_the_log_after_a_settle) {
  log_store log;
  log_copier copier([&](const log_copier::sent& s, std::vector<std::byte> b) {
    ASSERT_TRUE(log.append(key_of(s), std::move(b)));
  });
  std::vector<float> act{1, 2, 3}, grad{4, 5};
  EXPECT_TRUE(copier.queue({7, 0, engine::boundary::activation, act}));  // the copier is told
  EXPECT_FALSE(copier.queue({7, 1, engine::boundary::gradient, grad}));  // the same drain
  EXPECT_EQ(copier.queued(), 2u);
  EXPECT_EQ(log.entries(), 0u);  // nothing copied on the sender's thread
  copier.settle();
  EXPECT_EQ(copier.queued(), 0u);
  ASSERT_EQ(log.entries(), 2u);
  const auto a = log.find({7, 0, log_direction::activation, 0});
  ASSERT_TRUE(a);
  EXPECT_EQ(std::memcmp(a->data(), act.data(), a->size()), 0);
  EXPECT_EQ(log.bytes(), 5 * sizeof(float));
  EXPECT_EQ(copier.copy_queued(), 0u);  // the capture thread's turn comes after: nothing left
  copier.copy_now({8, 0, engine::boundary::activation, act});  // a small send: copied at once
  EXPECT_TRUE(log.find({8, 0, log_direction::activation, 0}));
}

TEST(log_copier, a_settle_waits_for_the_copy_another_thread_is_making) {
  log_store log;
  std::promise<void> entered, release;
  auto released = release.get_future().share();
  log_copier copier([&](const log_copier::sent& s, std::vector<std::byte> b) {
    entered.set_value();
    released.wait();  // the capture thread, preempted mid-copy
    log.append(key_of(s), std::move(b));
  });
  std::vector<float> act(1024, 0.5f);
  copier.queue({3, 0, engine::boundary::activation, act});
  std::thread capture([&] { EXPECT_EQ(copier.copy_queued(), 1u); });
  entered.get_future().wait();
  std::atomic<bool> settled{false};
  std::thread step([&] {
    copier.settle();
    settled = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(settled.load());  // returning now would let the step overwrite the bytes
  release.set_value();
  step.join();
  capture.join();
  EXPECT_TRUE(settled.load());
  EXPECT_TRUE(log.find({3, 0, log_direction::activation, 0}));
}

TEST(log_copier, a_sink_that_throws_leaves_no_copy_counted_in_progress) {
  int calls = 0;
  log_copier copier([&](const log_copier::sent&, std::vector<std::byte>) {
    if (++calls == 1) throw std::runtime_error("out of memory");
  });
  std::vector<float> act{1};
  copier.queue({1, 0, engine::boundary::activation, act});
  copier.queue({1, 1, engine::boundary::activation, act});
  EXPECT_THROW(copier.copy_queued(), std::runtime_error);
  copier.settle();  // returns: the failed copy is not in progress any more
  EXPECT_EQ(calls, 2);
}

TEST(log_copier, a_resent_iteration_with_other_bits_is_a_conflict_as_before) {
  log_store log;
  int conflicts = 0;
  log_copier copier([&](const log_copier::sent& s, std::vector<std::byte> b) {
    if (!log.append(key_of(s), std::move(b))) ++conflicts;
  });
  std::vector<float> act{1, 2};
  copier.queue({5, 0, engine::boundary::activation, act});
  copier.settle();
  copier.queue({5, 0, engine::boundary::activation, act});  // a replay: the same bits
  copier.settle();
  EXPECT_EQ(conflicts, 0);
  act[1] = 3;
  copier.queue({5, 0, engine::boundary::activation, act});
  copier.settle();
  EXPECT_EQ(conflicts, 1);
  EXPECT_EQ(log.bytes(), 2 * sizeof(float));
}

}  // namespace
}  // namespace moevement::recovery
