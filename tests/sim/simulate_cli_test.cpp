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
  // Bounds a run needs: a seed, a trial count, one row per policy, a run of one iteration.
  for (const auto& [set, says] : std::vector<std::pair<std::string, std::string>>{
           {"failures.seed=-1", "'failures.seed': must be >= 0"},
           {"failures.trials=100000000", "'failures.trials': must be at most 1000000"},
           {"'policies.list=[\"pec\",\"pec\"]'", "'policies.list': lists pec twice"},
           {"failures.duration_hours=0.0001", "is shorter than one iteration"}}) {
    const auto r = run("simulate " + example("simulate_deepseek_moe.toml") + " --set " + set);
    EXPECT_EQ(r.exit_code, 1) << set << "\n" << r.output;
    EXPECT_NE(r.output.find(says), std::string::npos) << set << "\n" << r.output;
  }
}

// --csv naming a file the simulation reads (the config, a trace, a profile) is refused before
// it runs, as is one that cannot be written: nothing overwritten, no table thrown away.
TEST(simulate_cli, a_csv_path_that_would_overwrite_an_input_or_cannot_be_written_is_refused) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("sim_csv_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const auto config = dir / "s.toml";
  std::filesystem::copy_file(example("simulate_deepseek_moe.toml"), config,
                             std::filesystem::copy_options::overwrite_existing);
  const auto before = std::filesystem::file_size(config);
  const auto self = run("simulate " + config.string() + " --csv " + config.string());
  EXPECT_EQ(self.exit_code, 1) << self.output;
  EXPECT_NE(self.output.find("which this simulation reads: it would be overwritten"),
            std::string::npos)
      << self.output;
  EXPECT_EQ(self.output.find("ETTR"), std::string::npos) << "refused before the table";
  EXPECT_EQ(std::filesystem::file_size(config), before);
  for (const char* f : {"simulate_trace.toml", "failure_trace_synthetic.txt"}) {
    std::filesystem::copy_file(example(f), dir / f,
                               std::filesystem::copy_options::overwrite_existing);
  }
  const auto trace = run("simulate " + (dir / "simulate_trace.toml").string() + " --csv " +
                         (dir / "failure_trace_synthetic.txt").string());
  EXPECT_EQ(trace.exit_code, 1) << trace.output;
  EXPECT_NE(trace.output.find("it would be overwritten"), std::string::npos) << trace.output;
  const auto nowhere =
      run("simulate " + config.string() + " --csv " + (dir / "no" / "x.csv").string());
  EXPECT_EQ(nowhere.exit_code, 1) << nowhere.output;
  EXPECT_NE(nowhere.output.find("cannot write --csv file"), std::string::npos) << nowhere.output;
  EXPECT_EQ(nowhere.output.find("ETTR"), std::string::npos) << "refused before the table";
  const auto folder = run("simulate " + config.string() + " --csv " + dir.string());
  EXPECT_EQ(folder.exit_code, 1) << folder.output;
  EXPECT_NE(folder.output.find("is a directory"), std::string::npos) << folder.output;
  std::filesystem::remove_all(dir);
}

}  // namespace
