#include "engine/run_log.hpp"

#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include <cmath>
#include <fstream>
#include <vector>

namespace moevement::engine {
namespace {

TEST(run_log, escapes_strings) {
  EXPECT_EQ(json_quote("a\"b\\c\nd\x01"), "\"a\\\"b\\\\c\\nd\\u0001\"");
}

TEST(run_log, one_object_per_line_in_field_order) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("run_log_test_" + std::to_string(::getpid()) + ".jsonl");
  {
    run_log log(path);
    log.write(json_record().add("kind", "iteration").add("iter", 3).add("loss", 2.5));
    log.write(json_record().add("kind", "failure").add("ok", false).add("loss", std::nan("")));
  }
  std::ifstream in(path);
  std::string l1, l2, l3;
  std::getline(in, l1);
  std::getline(in, l2);
  EXPECT_FALSE(std::getline(in, l3));
  EXPECT_EQ(l1, R"({"kind":"iteration","iter":3,"loss":2.5})");
  EXPECT_EQ(l2, R"({"kind":"failure","ok":false,"loss":null})");
  std::filesystem::remove(path);
}

TEST(run_log, unwritable_path_throws_naming_it) {
  try {
    run_log log("/nonexistent-dir/run.jsonl");
    FAIL() << "expected a throw";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent-dir/run.jsonl"), std::string::npos);
  }
}

TEST(run_log, the_file_is_private_whatever_the_umask) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("run_log_mode_" + std::to_string(::getpid()) + ".jsonl");
  const mode_t old = ::umask(0);
  { run_log log(path); }
  ::umask(old);
  struct stat st {};
  ASSERT_EQ(::stat(path.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 07777, 0600u);
  std::filesystem::remove(path);
}

// A head writes the log, its standby takes over and appends, and the head, once the standby
// ended, writes its last word: each record lands at the end. (The head's writes went to its
// own stale offset, over the standby's records.)
TEST(run_log, writers_taking_turns_append_and_overwrite_nothing) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("run_log_turns_" + std::to_string(::getpid()) + ".jsonl");
  run_log head(path);
  head.write(json_record().add("by", "head"));
  {
    run_log standby(path, /*append=*/true);
    standby.write(json_record().add("by", "standby"));
    standby.write(json_record().add("by", "standby, again"));
  }
  head.write(json_record().add("by", "head, last"));
  std::ifstream in(path);
  std::vector<std::string> lines;
  for (std::string l; std::getline(in, l);) lines.push_back(l);
  EXPECT_EQ(lines,
            (std::vector<std::string>{R"({"by":"head"})", R"({"by":"standby"})",
                                      R"({"by":"standby, again"})", R"({"by":"head, last"})"}));
  std::filesystem::remove(path);
}

// Two processes appending long records (far past stdio's buffer) at once: each record lands
// whole on a line of its own. (Through stdio, one record was several write() calls, and the
// other process's record could fall between them.)
TEST(run_log, long_records_of_processes_appending_at_once_never_interleave) {
  const auto path = std::filesystem::temp_directory_path() /
                    ("run_log_at_once_" + std::to_string(::getpid()) + ".jsonl");
  run_log(path).write(json_record().add("kind", "job_start"));
  constexpr int records = 40;
  const auto record_of = [](char by) {
    return json_record().add("by", std::string(1, by)).add("pad", std::string(96 * 1024, by));
  };
  std::vector<pid_t> children;
  for (const char by : {'a', 'b'}) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      run_log log(path, /*append=*/true);
      for (int i = 0; i < records; ++i) log.write(record_of(by));
      ::_exit(0);
    }
    children.push_back(pid);
  }
  for (const pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::ifstream in(path);
  std::string line;
  ASSERT_TRUE(std::getline(in, line));
  const std::string a = record_of('a').str(), b = record_of('b').str();
  int as = 0, bs = 0;
  while (std::getline(in, line)) {
    ASSERT_TRUE(line == a || line == b) << "a torn record of " << line.size() << " bytes";
    ++(line == a ? as : bs);
  }
  EXPECT_EQ(as, records);
  EXPECT_EQ(bs, records);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace moevement::engine
