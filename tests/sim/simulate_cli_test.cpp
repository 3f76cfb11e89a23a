// Runs `moevement simulate` as a user would.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>
#include "tests/support/run_moevement.hpp"

#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {

using moevement::test_support::run_result;
run_result run(const std::string& args) {
  return moevement::test_support::run_moevement(args);
}

std::string example(const char* name) {
  return std::string(std::getenv("MOEVEMENT_SOURCE_ROOT")) + "/examples/configs/" + name;
}

TEST(simulate_cli, prints_a_table_and_writes_csv) {
  const auto csv =
      std::filesystem::temp_directory_path() / ("sim_cli_" + std::to_string(::getpid()) + ".csv");
  const auto r =
      run("simulate " + example("simulate_deepseek_moe.toml") +
          " --set failures.trials=5 --set failures.mtbf_minutes=[60,10] --csv " + csv.string());
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s :
       {"deepseek-moe", "dense-disk", "dense-memory", "pec", "moevement", "1H", "10M", "ETTR"}) {
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  }
  std::ifstream in(csv);
  std::string line;
  int lines = 0;
  while (std::getline(in, line)) ++lines;
  EXPECT_EQ(lines, 1 + 2 * 4);  // header + MTBFs x policies
  std::filesystem::remove(csv);
}

TEST(simulate_cli, sweep_covers_figure_eleven) {
  const auto r = run("simulate " + example("simulate_deepseek_moe.toml") +
                     " --sweep --set failures.trials=2 --set sweep.mtbf_minutes=[10]");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* s : {"deepseek-32b", "deepseek-671b", "16384", "dense-memory", "moevement"}) {
    EXPECT_NE(r.output.find(s), std::string::npos) << s << "\n" << r.output;
  }
}

TEST(simulate_cli, errors_name_the_key_and_usage_errors_exit_2) {
  const auto bad = run("simulate " + example("simulate_deepseek_moe.toml") + " --set plan.ep=7");
  EXPECT_EQ(bad.exit_code, 1);
  EXPECT_NE(bad.output.find("'plan.ep'"), std::string::npos) << bad.output;
  const auto typo = run("simulate " + example("simulate_deepseek_moe.toml") + " --set plan.dpp=2");
  EXPECT_EQ(typo.exit_code, 1);
  EXPECT_NE(typo.output.find("'plan.dpp'"), std::string::npos) << typo.output;
  EXPECT_EQ(run("simulate").exit_code, 2);
  EXPECT_EQ(run("simulate a.toml b.toml").exit_code, 2);
  const auto missing = run("simulate /nonexistent/x.toml");
  EXPECT_EQ(missing.exit_code, 1);
  EXPECT_NE(missing.output.find("cannot read config"), std::string::npos) << missing.output;
}

}  // namespace
