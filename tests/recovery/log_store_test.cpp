#include "recovery/log_store.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <memory>

namespace moevement::recovery {
namespace {

std::vector<std::byte> tensor(std::size_t n, int seed) {
  std::vector<std::byte> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = std::byte((i + seed * 7) & 0xff);
  return v;
}

TEST(log_store, keeps_entries_by_iteration_micro_batch_and_direction) {
  log_store log;
  EXPECT_TRUE(log.append({5, 1, log_direction::activation}, tensor(100, 1)));
  EXPECT_TRUE(log.append({5, 0, log_direction::activation}, tensor(100, 2)));
  EXPECT_TRUE(log.append({5, 0, log_direction::gradient}, tensor(50, 3)));
  EXPECT_TRUE(log.append({6, 0, log_direction::activation}, tensor(100, 4)));
  EXPECT_EQ(log.bytes(), 350u);
  const auto acts = log.keys_of(5, log_direction::activation);
  ASSERT_EQ(acts.size(), 2u);
  EXPECT_EQ(acts[0].micro_batch, 0u);
  EXPECT_EQ(acts[1].micro_batch, 1u);
  auto g = log.find({5, 0, log_direction::gradient});
  ASSERT_TRUE(g.has_value());
  EXPECT_TRUE(std::equal(g->begin(), g->end(), tensor(50, 3).begin()));
  EXPECT_FALSE(log.find({7, 0, log_direction::gradient}).has_value());
}

TEST(log_store, replayed_identical_bits_are_accepted_different_bits_flagged) {
  log_store log;
  ASSERT_TRUE(log.append({3, 0, log_direction::activation}, tensor(64, 1)));
  EXPECT_TRUE(log.append({3, 0, log_direction::activation}, tensor(64, 1)));
  EXPECT_FALSE(log.append({3, 0, log_direction::activation}, tensor(64, 2)));
  EXPECT_EQ(log.bytes(), 64u);
}

TEST(log_store, stale_entries_dropped_and_memory_returns) {
  log_store log;
  for (std::uint64_t it = 0; it < 100; ++it) {
    for (std::uint32_t mb = 0; mb < 4; ++mb) {
      log.append({it, mb, log_direction::activation}, tensor(1000, int(it)));
      log.append({it, mb, log_direction::gradient}, tensor(1000, int(it)));
    }
    // A window of 4 iterations persisted: keep only what the last window needs.
    if (it >= 8) log.drop_before(it - 7);
    EXPECT_LE(log.bytes(), 8u * 8 * 1000) << "log grows without bound at iteration " << it;
  }
  EXPECT_EQ(log.span_held()->first, 92u);
  EXPECT_EQ(log.drop_before(1000), 8u * 8 * 1000);
  EXPECT_EQ(log.bytes(), 0u);
  EXPECT_FALSE(log.span_held().has_value());
}

// A dropped entry's buffer holds a later send's copy (no allocation), with the later bytes;
// what is kept is bounded by what the last drop freed.
TEST(log_buffers, a_dropped_entrys_buffer_holds_a_later_copy) {
  auto buffers = std::make_shared<log_buffers>();
  log_store log;
  log.recycle_into(buffers);
  for (std::uint32_t mb = 0; mb < 4; ++mb) {
    ASSERT_TRUE(log.append({0, mb, log_direction::activation}, buffers->copy(tensor(1000, 1))));
  }
  std::vector<const std::byte*> dropped;
  for (std::uint32_t mb = 0; mb < 4; ++mb) {
    dropped.push_back(log.find({0, mb, log_direction::activation})->data());
  }
  EXPECT_EQ(log.drop_before(1), 4000u);
  EXPECT_GE(buffers->bytes(), 4000u);
  EXPECT_LE(buffers->bytes(), 4 * 2000u);
  const auto later = tensor(1000, 9);
  ASSERT_TRUE(log.append({1, 0, log_direction::activation}, buffers->copy(later)));
  const auto got = log.find({1, 0, log_direction::activation});
  ASSERT_TRUE(got.has_value());
  EXPECT_NE(std::find(dropped.begin(), dropped.end(), got->data()), dropped.end());
  EXPECT_TRUE(std::equal(got->begin(), got->end(), later.begin(), later.end()));
  // A much smaller send takes no large buffer; nor does a larger one a small buffer.
  EXPECT_EQ(std::find(dropped.begin(), dropped.end(), buffers->copy(tensor(10, 2)).data()),
            dropped.end());
  EXPECT_EQ(buffers->copy(tensor(5000, 3)).size(), 5000u);
  // A later, smaller drop bounds what is kept to what it freed.
  ASSERT_TRUE(log.append({2, 0, log_direction::gradient}, tensor(100, 4)));
  log.drop_before(3);
  EXPECT_LE(buffers->bytes(), 1100u);
}

TEST(log_fetch_pieces, whole_iterations_each_under_the_piece_size_covering_the_range) {
  using pieces = std::vector<std::pair<std::int64_t, std::int64_t>>;
  // 3 iterations of 100 bytes fit a piece of 350: [4, 6], [7, 9], [10, 10].
  EXPECT_EQ(log_fetch_pieces(4, 11, 100, 350), (pieces{{4, 6}, {7, 9}, {10, 10}}));
  // One iteration larger than a piece still goes, alone.
  EXPECT_EQ(log_fetch_pieces(0, 3, 500, 100), (pieces{{0, 0}, {1, 1}, {2, 2}}));
  // All in one where it fits; nothing for an empty range.
  EXPECT_EQ(log_fetch_pieces(2, 5, 10, 1 << 20), (pieces{{2, 4}}));
  EXPECT_TRUE(log_fetch_pieces(5, 5, 10, 100).empty());
  // Never more iterations a piece than a neighbour serves in one answer (2^20).
  const auto big = log_fetch_pieces(0, (std::int64_t(1) << 20) + 5, 1, std::uint64_t(1) << 40);
  ASSERT_EQ(big.size(), 2u);
  EXPECT_EQ(big[0], std::make_pair(std::int64_t(0), (std::int64_t(1) << 20) - 1));
}

}  // namespace
}  // namespace moevement::recovery
