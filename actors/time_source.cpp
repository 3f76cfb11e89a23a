#include "actors/time_source.hpp"

#include <asio/post.hpp>

namespace moevement::actors {

steady_time::~steady_time() {
  *alive_ = false;
  for (auto& [id, t] : timers_) t->cancel();
}

time_source::timer_id steady_time::call_at(clock::time_point at, unique_function<void()> fn) {
  const timer_id id = next_++;
  auto t = std::make_shared<asio::steady_timer>(io_, at);
  timers_.emplace(id, t);
  // The timer is owned by the map until it fires or is cancelled; the handler keeps it alive
  // while the wait is in flight. A timer that expired before cancel() still completes without
  // an error (Asio cannot take back a queued handler): the map says whether it was cancelled.
  t->async_wait(
      [this, alive = alive_, id, t, fn = std::move(fn)](const asio::error_code& ec) mutable {
        if (ec || !*alive) return;           // cancelled, or the source is gone
        if (timers_.erase(id) == 0) return;  // cancelled after it expired
        fn();
      });
  return id;
}

void steady_time::cancel(timer_id id) {
  auto it = timers_.find(id);
  if (it == timers_.end()) return;
  it->second->cancel();
  timers_.erase(it);
}

time_source::timer_id manual_time::call_at(clock::time_point at, unique_function<void()> fn) {
  const timer_id id = next_++;
  timers_.emplace(std::pair{at, id}, std::move(fn));
  when_.emplace(id, at);
  return id;
}

void manual_time::cancel(timer_id id) {
  auto it = when_.find(id);
  if (it == when_.end()) return;
  timers_.erase({it->second, id});
  when_.erase(it);
}

std::optional<clock::time_point> manual_time::next_due() const {
  if (timers_.empty()) return std::nullopt;
  return timers_.begin()->first.first;
}

bool manual_time::advance_to(clock::time_point at) {
  if (!timers_.empty() && timers_.begin()->first.first <= at) {
    auto node = timers_.extract(timers_.begin());
    when_.erase(node.key().second);
    if (node.key().first > now_) now_ = node.key().first;
    asio::post(io_, std::move(node.mapped()));
    return true;
  }
  if (at > now_) now_ = at;
  return false;
}

}  // namespace moevement::actors
