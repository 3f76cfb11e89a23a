// What a child of ours does between fork and exec.
#pragma once

#include <unistd.h>

namespace moevement::launcher {

// Closes every descriptor above stderr, in a forked child about to exec. The parent's are not
// the child's to hold: UCX opens its sockets (the link's listener, its TCP transport's
// listeners and accepted connections), epoll and event fds without close-on-exec, so a worker
// (or srun) would otherwise keep the head's listening sockets open, and its port taken and
// answering connects, for as long as it runs. Between fork and exec of a threaded process:
// close_range and close are async-signal-safe (sysconf, on old kernels only, is a getrlimit).
inline void close_inherited_fds() {
  if (::close_range(3, ~0U, 0) == 0) return;
  // Kernels before 5.9 have no close_range: close up to the descriptor limit.
  const long limit = ::sysconf(_SC_OPEN_MAX);
  for (long fd = 3; fd < (limit > 0 ? limit : 1024); ++fd) ::close(static_cast<int>(fd));
}

}  // namespace moevement::launcher
