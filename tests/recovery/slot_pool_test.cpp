// The slot pool: link-allocated regions lent to the capture thread, created and destroyed
// only by refill() (the actor thread), described for replicas while lent.
#include "recovery/slot_pool.hpp"

#include <gtest/gtest.h>

#include <asio/io_context.hpp>

#include <atomic>
#include <cstring>
#include <thread>
#include <vector>

namespace moevement::recovery {
namespace {

class slot_pool_test : public ::testing::Test {
 protected:
  slot_pool_test() {
    transport::ucx_link_options o;
    o.self = 0;
    o.job_token = "slot-pool-test";
    link_ = std::make_unique<transport::ucx_link>(io_, o);
    io_bulk_ = std::make_unique<engine::bulk_io>(*link_);
  }
  asio::io_context io_;
  std::unique_ptr<transport::ucx_link> link_;
  std::unique_ptr<engine::bulk_io> io_bulk_;
};

TEST_F(slot_pool_test, shared_regions_are_made_on_the_capture_thread_and_mapped_by_handle) {
  slot_pool pool(*io_bulk_, true);
  std::optional<slot_memory> taken;
  std::thread([&] { taken = pool.take(10000); }).join();  // no link call there
  ASSERT_TRUE(taken.has_value()) << "a shared pool never misses";
  EXPECT_TRUE(taken->lent);
  std::memset(taken->bytes.data(), 0x3c, taken->bytes.size());
  const auto share = pool.lent_share(taken->bytes.data(), 4000);
  ASSERT_TRUE(share.has_value());
  EXPECT_EQ(share->length, 4000u);
  auto view = transport::shared_memory::open(*share);
  ASSERT_TRUE(view.ok()) << view.err().message;
  EXPECT_EQ(view->memory()[3999], std::byte{0x3c}) << "the same pages";
  const auto* region = pool.lent_region(taken->bytes.data());  // exported now, for pullers
  ASSERT_NE(region, nullptr);
  EXPECT_EQ(region->memory().data(), taken->bytes.data());
  // Given back, it is lent again (the next window), with no new memory.
  std::thread([m = std::move(taken)]() mutable { m.reset(); }).join();
  EXPECT_FALSE(pool.lent_share(view->memory().data(), 1).has_value()) << "not lent";
  auto again = pool.take(9000);
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(pool.regions(), 1u);
  // A link-allocated region (a restore's) is lent too, but has no handle.
  pool.adopt(io_bulk_->allocate(20000));
  auto adopted = pool.take(15000);
  ASSERT_TRUE(adopted.has_value());
  EXPECT_NE(pool.lent_region(adopted->bytes.data()), nullptr);
  EXPECT_FALSE(pool.lent_share(adopted->bytes.data(), 15000).has_value());
}

// A replacement's restored memory files stay free through its first window's refills (a
// shared pool otherwise keeps nothing free), so that every slot of that window can take one.
TEST_F(slot_pool_test, adopted_memory_files_wait_for_the_first_window) {
  slot_pool pool(*io_bulk_, true);
  pool.adopt(transport::shared_memory::create(5000), 2);
  pool.adopt(transport::shared_memory::create(9000), 2);
  auto first = pool.take(4000);  // slot 0 takes the smaller file
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->bytes.size(), 5000u);
  pool.refill(0);
  pool.refill(0);
  EXPECT_EQ(pool.regions(), 2u) << "the other file was freed before its slot came";
  auto second = pool.take(8000);
  ASSERT_TRUE(second.has_value());
  EXPECT_EQ(second->bytes.size(), 9000u) << "a new file instead of the restored one";
  // Never taken: freed once its refills are spent.
  pool.adopt(transport::shared_memory::create(7000), 1);
  pool.refill(0);
  EXPECT_EQ(pool.regions(), 3u);
  pool.refill(0);
  EXPECT_EQ(pool.regions(), 2u);
  // Without refills, the old rule: a shared pool keeps nothing free.
  pool.adopt(transport::shared_memory::create(7000));
  pool.refill(0);
  EXPECT_EQ(pool.regions(), 2u);
}

TEST_F(slot_pool_test, misses_then_lends_link_memory_and_takes_it_back) {
  slot_pool pool(*io_bulk_);
  EXPECT_FALSE(pool.take(1000).has_value()) << "nothing allocated yet";
  EXPECT_FALSE(pool.take(5000).has_value());
  pool.refill(0);
  EXPECT_EQ(pool.regions(), 2u) << "one region per miss";
  EXPECT_EQ(pool.free_bytes(), 6000u);

  auto small = pool.take(800);  // the smallest that fits: the 1000-byte region
  ASSERT_TRUE(small.has_value());
  EXPECT_TRUE(small->lent);
  EXPECT_EQ(small->bytes.size(), 1000u);
  std::memset(small->bytes.data(), 0x5a, small->bytes.size());  // the memory is writable
  const auto* region = pool.lent_region(small->bytes.data());
  ASSERT_NE(region, nullptr) << "lent memory is a region replicas can be sent";
  const auto d = region->describe(0, 800);
  EXPECT_EQ(d.length, 800u);
  EXPECT_EQ(pool.lent_region(small->bytes.data() + 1), nullptr) << "only a region's base";
  EXPECT_EQ(pool.free_bytes(), 5000u);

  EXPECT_FALSE(pool.take(6000).has_value()) << "no free region is big enough";
  // The capture thread drops the memory: it goes back to the pool, not to the link.
  std::thread([m = std::move(small)]() mutable { m.reset(); }).join();
  EXPECT_EQ(pool.lent_region(region->memory().data()), nullptr);
  EXPECT_EQ(pool.regions(), 2u);
  EXPECT_EQ(pool.free_bytes(), 6000u);

  // refill: free regions beyond keep_free go (smallest first), then the miss is allocated.
  pool.refill(1);
  EXPECT_EQ(pool.regions(), 2u) << "the 5000 kept, the 1000 freed, the 6000 allocated";
  EXPECT_EQ(pool.free_bytes(), 11000u);
  auto big = pool.take(6000);
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(big->bytes.size(), 6000u);
  pool.refill(0);
  EXPECT_EQ(pool.regions(), 1u) << "lent regions are never freed";
  EXPECT_NE(pool.lent_region(big->bytes.data()), nullptr);
  big.reset();
  pool.refill(0);
  EXPECT_EQ(pool.regions(), 0u);
  EXPECT_EQ(pool.free_bytes(), 0u);
}

// A miss stands for the windows after it: refill allocates a batch of its size, so the next
// windows find memory instead of starting on the heap.
TEST_F(slot_pool_test, a_miss_allocates_a_batch_of_its_size) {
  slot_pool pool(*io_bulk_);
  EXPECT_FALSE(pool.take(100).has_value());
  for (int i = 0; i < 5; ++i) EXPECT_FALSE(pool.take(200).has_value());
  pool.refill(8, 3);
  EXPECT_EQ(pool.regions(), 6u) << "three of each size, however often it was missed";
  EXPECT_EQ(pool.free_bytes(), 3u * 100 + 3u * 200);
  std::vector<slot_memory> lent;
  for (int i = 0; i < 3; ++i) {
    auto m = pool.take(150);
    ASSERT_TRUE(m.has_value()) << i;
    EXPECT_EQ(m->bytes.size(), 200u);
    lent.push_back(std::move(*m));
  }
  EXPECT_FALSE(pool.take(150).has_value()) << "the 100-byte ones do not fit";
  pool.refill(8, 1);
  EXPECT_EQ(pool.regions(), 7u) << "one more of 150 bytes";
  lent.clear();
  pool.refill(2, 1);
  EXPECT_EQ(pool.regions(), 2u) << "free regions trimmed to two, the largest kept";
  EXPECT_EQ(pool.free_bytes(), 400u);
}

// A capture thread taking, writing and dropping lent memory while the actor thread refills
// and trims: no region is freed while lent, and every region comes back.
TEST_F(slot_pool_test, lending_and_refilling_on_two_threads) {
  slot_pool pool(*io_bulk_);
  std::atomic<bool> done{false};
  std::atomic<int> lent_writes{0}, lost{0};
  std::thread capture([&] {
    std::vector<slot_memory> held;
    for (int i = 0; i < 1000000 && lent_writes < 2000; ++i) {
      if (auto m = pool.take(std::size_t(512 + 256 * (i % 3)))) {
        std::memset(m->bytes.data(), i & 0xff, m->bytes.size());
        held.push_back(std::move(*m));
        ++lent_writes;
      }
      if (held.size() > 4) held.erase(held.begin());  // given back from this thread
      for (const auto& h : held) lost += pool.lent_region(h.bytes.data()) == nullptr;
    }
    done = true;
  });
  while (!done) pool.refill(2, 3);  // this thread plays the actor thread
  capture.join();
  pool.refill(0);
  EXPECT_GT(lent_writes.load(), 0);
  EXPECT_EQ(lost.load(), 0) << "a region was freed while lent";
  EXPECT_EQ(pool.regions(), 0u) << "everything came back and was freed";
}

// After a recovery: a replacement's pool adopts the regions its restore pulled into, and grows
// by as many again per size for the windows after it (a survivor's, by its abandoned ones).
TEST_F(slot_pool_test, adopted_regions_are_lent_and_grow_adds_regions_of_every_size) {
  slot_pool pool(*io_bulk_);
  pool.adopt(io_bulk_->allocate(3000));
  pool.adopt(io_bulk_->allocate(7000));
  EXPECT_EQ(pool.regions(), 2u);
  EXPECT_EQ(pool.free_bytes(), 10000u);
  auto a = pool.take(2500);
  ASSERT_TRUE(a.has_value()) << "an adopted region is lent like any other";
  EXPECT_EQ(a->bytes.size(), 3000u);
  EXPECT_NE(pool.lent_region(a->bytes.data()), nullptr);

  pool.grow(2);  // two more of each size: 3000 and 7000
  EXPECT_EQ(pool.regions(), 6u);
  EXPECT_EQ(pool.free_bytes(), 7000u + 2 * 3000u + 2 * 7000u);
  std::vector<slot_memory> lent;
  for (int i = 0; i < 2; ++i) {
    auto m = pool.take(3000);
    ASSERT_TRUE(m.has_value()) << "grown region " << i;
    lent.push_back(std::move(*m));
  }
  auto big = pool.take(3000);  // every 3000 is lent: the smallest free one is a 7000
  ASSERT_TRUE(big.has_value());
  EXPECT_EQ(big->bytes.size(), 7000u);
  EXPECT_EQ(pool.failed_refills(), 0u);
}

}  // namespace
}  // namespace moevement::recovery
