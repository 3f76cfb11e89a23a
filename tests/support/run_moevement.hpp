// Runs the real `moevement` binary as a user would (tests of the CLI). meson test sets
// MOEVEMENT_BIN and MOEVEMENT_SOURCE_ROOT.
#pragma once

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace moevement::test_support {

struct run_result {
  int exit_code;       // -1 when killed by a signal
  std::string output;  // stdout and stderr together
};

inline run_result run_moevement(const std::string& args) {
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

// A file of the source tree, e.g. source_path("examples/configs/tiny.toml").
inline std::string source_path(const std::string& relative) {
  const char* root = std::getenv("MOEVEMENT_SOURCE_ROOT");
  if (root == nullptr) throw std::runtime_error("MOEVEMENT_SOURCE_ROOT is not set");
  return std::string(root) + "/" + relative;
}

}  // namespace moevement::test_support
