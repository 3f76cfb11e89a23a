#include "base/hash.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string_view>

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
