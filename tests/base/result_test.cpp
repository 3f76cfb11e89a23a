#include "base/result.hpp"

#include <gtest/gtest.h>

#include <memory>

namespace moevement {
namespace {

result<int> parse_digit(char c) {
  if (c < '0' || c > '9') return error{"not a digit"};
  return c - '0';
}

TEST(result, holds_value_or_error) {
  auto ok = parse_digit('7');
  ASSERT_TRUE(ok.ok());
  EXPECT_EQ(*ok, 7);
  auto bad = parse_digit('x');
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.err().message, "not a digit");
}

TEST(result, reading_an_error_as_value_throws_with_its_message) {
  auto bad = parse_digit('x');
  try {
    (void)bad.value();
    FAIL() << "expected a throw";
  } catch (const bad_result_access& e) {
    EXPECT_STREQ(e.what(), "not a digit");
  }
}

TEST(result, move_only_values) {
  result<std::unique_ptr<int>> r(std::make_unique<int>(3));
  std::unique_ptr<int> p = std::move(r).value();
  EXPECT_EQ(*p, 3);
}

TEST(result, void_result) {
  result<void> ok;
  EXPECT_TRUE(ok.ok());
  EXPECT_NO_THROW(ok.value());
  result<void> bad = error{"disk full"};
  EXPECT_FALSE(bad.ok());
  EXPECT_THROW(bad.value(), bad_result_access);
}

}  // namespace
}  // namespace moevement
