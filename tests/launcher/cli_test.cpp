// Runs the real `moevement` binary as a user would.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include "tests/support/run_moevement.hpp"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <sstream>
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

// `moevement bench` without a name, or with --help, lists every benchmark with what it runs
// against; the list names exactly the bench_NAME executables bench/meson.build makes.
TEST(cli, bench_lists_every_benchmark_and_its_competitor) {
  const auto help = run("bench --help");
  EXPECT_EQ(help.exit_code, 0) << help.output;
  const auto bare = run("bench");
  EXPECT_EQ(bare.exit_code, 2) << bare.output;
  EXPECT_EQ(bare.output, help.output);
  std::ifstream in(std::string(std::getenv("MOEVEMENT_SOURCE_ROOT")) + "/bench/meson.build");
  const std::string build((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::set<std::string> built;
  const std::regex names(R"((?:bench_names \+= \['|executable\('bench_)([a-z_]+)')");
  for (auto it = std::sregex_iterator(build.begin(), build.end(), names);
       it != std::sregex_iterator(); ++it) {
    built.insert((*it)[1]);
  }
  ASSERT_GE(built.size(), 8u) << build;
  std::set<std::string> listed;
  std::istringstream lines(help.output);
  for (std::string l; std::getline(lines, l);) {
    if (l.rfind("  ", 0) == 0) listed.insert(l.substr(2, l.find(' ', 2) - 2));
  }
  EXPECT_EQ(listed, built) << help.output;
}

}  // namespace
