// What a child of ours does between fork and exec.
#pragma once

#include <unistd.h>

#include <cstring>
#include <string>
#include <vector>

extern char** environ;

namespace moevement::launcher {

// The environment a child execs with: ours, with `name` set to `value`. Made before the fork:
// between fork and exec of a threaded process only async-signal-safe calls are safe, and
// setenv takes a lock and allocates (another thread may have held either at the fork).
class child_environment {
 public:
  child_environment(const std::string& name, const std::string& value) {
    const std::string prefix = name + "=";
    for (char** e = environ; e != nullptr && *e != nullptr; ++e) {
      if (std::strncmp(*e, prefix.c_str(), prefix.size()) != 0) strings_.emplace_back(*e);
    }
    strings_.push_back(prefix + value);
    for (auto& s : strings_) pointers_.push_back(s.data());
    pointers_.push_back(nullptr);
  }
  char** get() { return pointers_.data(); }

 private:
  std::vector<std::string> strings_;
  std::vector<char*> pointers_;
};

// Closes every descriptor above stderr, in a forked child about to exec. The parent's are not
// the child's to hold: UCX opens its sockets (the link's listener, its TCP transport's
// listeners and accepted connections), epoll and event fds without close-on-exec, so a worker
// (or srun) would otherwise keep the head's listening sockets open, and its port taken and
// answering connects, for as long as it runs. Between fork and exec of a threaded process:
// close_range and close are async-signal-safe (sysconf, on old kernels only, is a getrlimit).
inline void close_inherited_fds(int first = 3) {
  if (::close_range(unsigned(first), ~0U, 0) == 0) return;
  // Kernels before 5.9 have no close_range: close up to the descriptor limit.
  const long limit = ::sysconf(_SC_OPEN_MAX);
  for (long fd = first; fd < (limit > 0 ? limit : 1024); ++fd) ::close(static_cast<int>(fd));
}

}  // namespace moevement::launcher
