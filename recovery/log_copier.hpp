// The upstream log's copies, off the compute thread (issue: nothing on the compute thread's
// critical path that need not be). A boundary send queues its copy; the capture thread makes
// it where the pipeline leaves a core idle (its bubbles; on a GPU, while the device computes);
// whoever needs it done first makes what is still queued itself, on its own thread, and waits
// out the one copy in progress: the step (the sent bytes are written again next iteration), the
// stage before it writes a send buffer again or frees it, and a log read. So a queued copy
// never waits on the lowest-priority capture thread, and the log holds every send by the time
// anyone reads it.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <vector>

#include "engine/hooks.hpp"
#include "recovery/log_store.hpp"

namespace moevement::recovery {

class log_copier {
 public:
  // One boundary send: its bytes stay unchanged until the copy is made (the engine settles
  // before it writes them again).
  struct sent {
    std::int64_t iteration = 0;
    int micro_batch = 0;
    engine::boundary kind = engine::boundary::activation;
    std::span<const float> tensor;
  };
  // Takes one copy into the log (called with none of the copier's locks held).
  using sink = std::function<void(const sent&, std::vector<std::byte>)>;

  // buffers: where the copies are made (recycled buffers of the log's dropped entries; null:
  // allocated each).
  explicit log_copier(sink s, std::shared_ptr<log_buffers> buffers = nullptr)
      : sink_(std::move(s)), buffers_(std::move(buffers)) {}

  // Compute thread. True when nothing else was queued: whoever copies must be told (one drain
  // makes every copy queued before it ends, so later sends need no wake-up of their own).
  bool queue(const sent& s);
  // Copies s into the log now, on the calling thread.
  void copy_now(const sent& s);
  // Makes every queued copy on the calling thread; returns how many it made.
  std::size_t copy_queued();
  // copy_queued(), then waits until no other thread is making one.
  void settle();
  std::size_t queued() const;

 private:
  sink sink_;
  std::shared_ptr<log_buffers> buffers_;
  mutable std::mutex mu_;
  std::condition_variable idle_;
  std::deque<sent> queued_;
  int copying_ = 0;  // copies taken from the queue and not yet in the log
};

}  // namespace moevement::recovery
