#include "base/copy.hpp"

#include <gtest/gtest.h>

#include <cstring>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace moevement {
namespace {

// Every destination and source alignment, with sizes around the streamed part's edges: the
// bytes equal std::memcpy's (the reference), and nothing outside the destination is written.
TEST(copy_streaming, equals_memcpy_for_every_alignment_and_size) {
  std::vector<std::byte> source(4096 + 64);
  for (std::size_t i = 0; i < source.size(); ++i) source[i] = std::byte(i * 131 + 7);
  for (std::size_t to_at = 0; to_at < 32; ++to_at) {
    for (std::size_t from_at = 0; from_at < 32; from_at += 3) {
      for (std::size_t n : {0, 1, 15, 16, 63, 255, 256, 257, 300, 1023, 4000}) {
        std::vector<std::byte> got(4096 + 128, std::byte{0xee}), want = got;
        std::memcpy(want.data() + to_at, source.data() + from_at, n);
        copy_streaming({got.data() + to_at, n}, {source.data() + from_at, n});
        ASSERT_EQ(got, want) << "to +" << to_at << " from +" << from_at << " size " << n;
      }
    }
  }
}

TEST(copy_streaming, a_large_copy_is_whole) {
  std::vector<std::uint32_t> source(3 << 20);  // 12 MB: larger than the caches' share
  std::iota(source.begin(), source.end(), 0u);
  std::vector<std::uint32_t> got(source.size());
  copy_streaming(std::as_writable_bytes(std::span(got)), std::as_bytes(std::span(source)));
  EXPECT_EQ(got, source);
}

TEST(copy_streaming, sizes_must_match) {
  std::vector<std::byte> a(8), b(9);
  EXPECT_THROW(copy_streaming(a, b), std::invalid_argument);
}

}  // namespace
}  // namespace moevement
