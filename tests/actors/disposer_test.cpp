// The disposer: what it is handed is destroyed on its own thread, never the caller's, and its
// destructor waits until everything handed over is gone (built into the system test program).
#include "actors/disposer.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <memory>
#include <thread>
#include <vector>

namespace moevement::actors {
namespace {

struct probe {
  std::thread::id* died_on;
  std::atomic<int>* alive;
  explicit probe(std::thread::id* where, std::atomic<int>* count) : died_on(where), alive(count) {
    ++*alive;
  }
  probe(probe&& o) noexcept : died_on(std::exchange(o.died_on, nullptr)), alive(o.alive) {}
  ~probe() {
    if (died_on == nullptr) return;  // moved from
    *died_on = std::this_thread::get_id();
    --*alive;
  }
};

TEST(disposer, destroys_off_the_callers_thread_and_joins) {
  std::thread::id where;
  std::atomic<int> alive{0};
  {
    disposer d;
    d.dispose(probe(&where, &alive));
    auto big = std::make_unique<std::vector<float>>(1 << 20);  // what it is for: memory
    d.dispose(std::move(big));
    EXPECT_EQ(big, nullptr);
  }  // joined: both are gone
  EXPECT_EQ(alive.load(), 0);
  EXPECT_NE(where, std::thread::id{});
  EXPECT_NE(where, std::this_thread::get_id());
}

}  // namespace
}  // namespace moevement::actors
