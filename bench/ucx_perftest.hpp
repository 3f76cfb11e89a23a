// Runs ucx_perftest, the competitor of our transport and actor benchmarks, as a client/server
// pair of processes on 127.0.0.1, and returns its CSV result line.
#pragma once

#include <fmt/format.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern char** environ;

namespace moevement::bench {

// One ucx_perftest client/server pair; the CSV line's fields (iterations, p50 latency, avg
// latency, overall latency, avg bw MB/s, overall bw MB/s, avg msg rate, overall msg rate).
// `extra`: more client options (e.g. "-E sleep": wait for events instead of busy-polling).
inline std::vector<double> perftest(const std::string& test, std::size_t size, long iters, int port,
                                    const std::string& extra = {}) {
  const std::string server_cmd = fmt::format("ucx_perftest -p {} >/dev/null 2>&1", port);
  pid_t server = -1;
  const char* sh_args[] = {"/bin/sh", "-c", server_cmd.c_str(), nullptr};
  if (::posix_spawn(&server, "/bin/sh", nullptr, nullptr, const_cast<char**>(sh_args), environ) !=
      0) {
    throw std::runtime_error("cannot start ucx_perftest (install ucx-utils)");
  }
  std::vector<double> fields;
  for (int attempt = 0; attempt < 50 && fields.empty(); ++attempt) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const std::string cmd =
        fmt::format("ucx_perftest 127.0.0.1 -p {} -t {} -s {} -n {} -w {} {} -v 2>/dev/null", port,
                    test, size, iters, std::max(1L, iters / 10), extra);
    FILE* f = ::popen(cmd.c_str(), "r");
    if (f == nullptr) continue;
    char line[512];
    std::string last;
    while (std::fgets(line, sizeof line, f) != nullptr) {
      const char* p = line;
      while (*p == ' ') ++p;
      if (std::strchr(p, ',') != nullptr && *p >= '0' && *p <= '9') last = p;
    }
    ::pclose(f);
    std::stringstream ss(last);
    std::string cell;
    while (std::getline(ss, cell, ',')) fields.push_back(std::stod(cell));
    if (fields.size() < 8) fields.clear();
  }
  ::kill(server, SIGTERM);
  ::waitpid(server, nullptr, 0);
  if (fields.empty()) throw std::runtime_error("ucx_perftest " + test + " gave no result");
  return fields;
}

}  // namespace moevement::bench
