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

// A node without the transport UCX_TLS asks for fails the check (UCX itself only warns, and a
// job there could not connect); what it names but has is fine.
TEST(cli, check_fails_where_ucx_tls_names_a_transport_this_host_lacks) {
  ::setenv("UCX_TLS", "rc,self", 1);
  const auto missing = run("check");
  ::setenv("UCX_TLS", "tcp,sm,self", 1);
  const auto present = run("check");
  ::unsetenv("UCX_TLS");
  EXPECT_EQ(missing.exit_code, 1) << missing.output;
  EXPECT_NE(missing.output.find("FAIL  ucx   UCX_TLS=rc,self names rc, which UCX has no transport "
                                "for on this host (it has "),
            std::string::npos)
      << missing.output;
  EXPECT_EQ(present.exit_code, 0) << present.output;
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

// `moevement bench NAME --help` prints that benchmark's own opening text and runs nothing (no
// ratio line: it used to run `actors` with counts of 0 and `engine` in full); a bad count is
// refused; `check` takes no arguments; --version says the version.
TEST(cli, bench_help_runs_nothing_and_bad_arguments_are_refused) {
  std::istringstream lines(run("bench --help").output);
  int asked = 0;
  for (std::string l; std::getline(lines, l);) {
    if (l.rfind("  ", 0) != 0) continue;
    const std::string name = l.substr(2, l.find(' ', 2) - 2);
    const auto r = run("bench " + name + " --help");
    EXPECT_EQ(r.exit_code, 0) << name << "\n" << r.output;
    // Exactly its source's opening comment: the text, not a run's output.
    const std::string source = name == "simvalidate" ? "sim_validation"
                               : name == "recovery"  ? "policies"
                                                     : name;
    std::ifstream in(std::string(std::getenv("MOEVEMENT_SOURCE_ROOT")) + "/bench/" + source +
                     "_bench.cpp");
    std::string expected;
    for (std::string c; std::getline(in, c) && c.rfind("//", 0) == 0;) {
      expected += c.substr(c.rfind("// ", 0) == 0 ? 3 : 2) + "\n";
    }
    EXPECT_FALSE(expected.empty()) << name;
    EXPECT_EQ(r.output, expected) << name;
    ++asked;
  }
  EXPECT_GE(asked, 8);
  const auto zero = run("bench actors 0");
  EXPECT_EQ(zero.exit_code, 2) << zero.output;
  EXPECT_NE(zero.output.find("is not a positive count"), std::string::npos) << zero.output;
  const auto engine = run("bench engine --bogus");
  EXPECT_EQ(engine.exit_code, 2) << engine.output;
  EXPECT_NE(engine.output.find("unknown option --bogus"), std::string::npos) << engine.output;
  const auto check = run("check --bogus");
  EXPECT_EQ(check.exit_code, 2) << check.output;
  const auto version = run("--version");
  EXPECT_EQ(version.exit_code, 0) << version.output;
  EXPECT_EQ(version.output.rfind("moevement ", 0), 0u) << version.output;
}

}  // namespace
