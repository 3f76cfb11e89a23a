// Runs the real `moevement` binary as a user would.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace {

struct run_result {
  int exit_code;
  std::string output;
};

run_result run(const std::string& args) {
  const char* bin = std::getenv("MOEVEMENT_BIN");
  if (bin == nullptr) throw std::runtime_error("MOEVEMENT_BIN is not set (run through meson test)");
  const std::string cmd = std::string(bin) + " " + args + " 2>&1";
  std::FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) throw std::runtime_error("popen failed");
  std::string out;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
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
