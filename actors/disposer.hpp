// Gives memory back off the actor thread: what a process drops in bulk (a stage's state, its
// snapshot slots: hundreds of MB at the demo's scale) is destroyed on a thread of its own, at
// low priority. Freed on the actor thread, such memory held the heartbeats past the failure
// timeout when every stage of a job was rebuilt at once (a standby head's takeover on two
// cores). Only for objects whose destruction needs no thread in particular (no transport
// handles: those belong to the link's thread).
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <asio/post.hpp>
#include <asio/thread_pool.hpp>

#include <memory>

namespace moevement::actors {

class disposer {
 public:
  disposer() {
    asio::post(pool_, [] { (void)::setpriority(PRIO_PROCESS, ::gettid(), 10); });
  }
  // Joins: everything handed over is destroyed before this returns.
  ~disposer() { pool_.join(); }
  disposer(const disposer&) = delete;
  disposer& operator=(const disposer&) = delete;

  // Destroys `object` on the disposer's thread, later.
  template <class T>
  void dispose(T object) {
    asio::post(pool_, [held = std::make_shared<T>(std::move(object))]() mutable { held.reset(); });
  }

 private:
  asio::thread_pool pool_{1};
};

}  // namespace moevement::actors
