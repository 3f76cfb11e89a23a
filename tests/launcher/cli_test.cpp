// Runs the real `moevement` binary as a user would.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include "tests/support/run_moevement.hpp"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

using moevement::test_support::run_result;
run_result run(const std::string& args) {
  return moevement::test_support::run_moevement(args);
}

TEST(cli, check_passes_on_this_machine) {
  const auto r = run("check");
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("all checks passed"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("ok    blis"), std::string::npos) << r.output;
}

TEST(cli, unknown_command_exits_2_with_usage) {
  const auto r = run("frobnicate");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.output.find("unknown command 'frobnicate'"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("usage: moevement"), std::string::npos);
}

}  // namespace
