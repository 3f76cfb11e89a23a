#include "recovery/log_copier.hpp"

namespace moevement::recovery {

bool log_copier::queue(const sent& s) {
  const std::lock_guard lock(mu_);
  queued_.push_back(s);
  return queued_.size() == 1;
}

void log_copier::copy_now(const sent& s) {
  const auto bytes = std::as_bytes(s.tensor);
  sink_(s, buffers_ ? buffers_->copy(bytes) : std::vector<std::byte>(bytes.begin(), bytes.end()));
}

std::size_t log_copier::copy_queued() {
  std::size_t made = 0;
  for (;;) {
    sent s;
    {
      const std::lock_guard lock(mu_);
      if (queued_.empty()) break;
      s = queued_.front();
      queued_.pop_front();
      ++copying_;
    }
    struct done {  // the count goes down also when the sink throws
      log_copier& c;
      ~done() {
        const std::lock_guard lock(c.mu_);
        if (--c.copying_ == 0) c.idle_.notify_all();
      }
    } counted{*this};
    copy_now(s);
    ++made;
  }
  return made;
}

void log_copier::settle() {
  copy_queued();
  std::unique_lock lock(mu_);
  idle_.wait(lock, [&] { return copying_ == 0; });
}

std::size_t log_copier::queued() const {
  const std::lock_guard lock(mu_);
  return queued_.size();
}

}  // namespace moevement::recovery
