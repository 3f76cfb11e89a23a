#include "base/hash.hpp"

#include <gtest/gtest.h>

#include <xxhash.h>  // the shared library's XXH3: the reference for our inlined one

#include <cmath>
#include <string_view>
#include <vector>

namespace moevement {
namespace {

std::span<const std::byte> bytes_of(std::string_view s) {
  return std::as_bytes(std::span(s.data(), s.size()));
}

TEST(hash, known_xxh64_vectors) {
  // Reference values of XXH64 with seed 0 (xxHash's own test vectors).
  EXPECT_EQ(xxhash64(bytes_of("")), 0xef46db3751d8e999ull);
  EXPECT_EQ(xxhash64(bytes_of("a")), 0xd24ec4f1a98c6e5bull);
}

TEST(hash, inlined_xxh3_equals_the_librarys_for_every_length_and_split) {
  // Lengths across XXH3's size classes (0-16, 17-128, 129-240, long: stripes and blocks).
  std::vector<std::byte> data(70000);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = std::byte((i * 2654435761u) >> 13);
  for (const std::size_t n : {0, 1, 3, 16, 17, 100, 128, 129, 240, 241, 1024, 4096, 65537}) {
    const auto bytes = std::span<const std::byte>(data).first(n);
    const std::uint64_t reference = XXH3_64bits(bytes.data(), bytes.size());
    EXPECT_EQ(xxh3_64(bytes), reference) << n;
    xxh3_hasher h;
    h.update(bytes.first(n / 3));
    h.update(bytes.subspan(n / 3));
    EXPECT_EQ(h.digest(), reference) << n;
  }
  EXPECT_EQ(xxh3_64({}), 0x2d06800538d394c2ull);  // xxHash's own vector: the empty input
}

TEST(hash, streaming_equals_one_shot) {
  const std::string_view text = "sparse checkpointing for fast and reliable MoE training";
  hasher h;
  h.update(bytes_of(text.substr(0, 10)));
  h.update(bytes_of(text.substr(10)));
  EXPECT_EQ(h.digest(), xxhash64(bytes_of(text)));
}

TEST(hash, one_bit_changes_the_hash) {
  float a = 1.0f, b = std::nextafter(1.0f, 2.0f);
  hasher ha, hb;
  ha.update_value(a);
  hb.update_value(b);
  EXPECT_NE(ha.digest(), hb.digest());
}

TEST(hash, hex16_is_sixteen_lower_hex_digits) {
  EXPECT_EQ(hex16(0xabcull), "0000000000000abc");
  EXPECT_EQ(hex16(~0ull), "ffffffffffffffff");
}

}  // namespace
}  // namespace moevement
