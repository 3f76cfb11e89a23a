#include "recovery/window_plan.hpp"

#include <fmt/format.h>

#include <iterator>
#include <stdexcept>

namespace moevement::recovery {

void window_plan::start(std::int64_t step, int w, std::uint64_t first) {
  if (w < 1) throw std::invalid_argument(fmt::format("window plan: a window of {} steps", w));
  if (segments_.empty()) {
    segments_[step] = {step, first, w};
    return;
  }
  const engine::checkpoint_place p = at(step);
  if (p.w_sparse == 0 || p.slot != 0) {
    throw std::logic_error(fmt::format(
        "window plan: W may change only at a window's start, and step {} is slot {} of window {}",
        step, p.slot, p.window));
  }
  segments_.erase(segments_.lower_bound(step), segments_.end());
  segments_[step] = {step, p.window, w};
}

engine::checkpoint_place window_plan::at(std::int64_t step) const {
  auto it = segments_.upper_bound(step);
  if (it == segments_.begin()) return {};
  const segment& s = std::prev(it)->second;
  const auto n = std::uint64_t(step - s.step);
  return {s.w, s.window + n / std::uint64_t(s.w), std::uint32_t(n % std::uint64_t(s.w))};
}

int window_plan::w_of(std::uint64_t window) const {
  int w = 0;
  for (const auto& [step, s] : segments_) {
    if (s.window > window) break;
    w = s.w;
  }
  return w;
}

void window_plan::forget_before(std::uint64_t window) {
  // A segment is needed while the next one begins after `window`.
  while (segments_.size() > 1 && std::next(segments_.begin())->second.window <= window) {
    segments_.erase(segments_.begin());
  }
}

std::vector<window_plan::segment> window_plan::segments() const {
  std::vector<segment> out;
  for (const auto& [step, s] : segments_) out.push_back(s);
  return out;
}

}  // namespace moevement::recovery
