#include "recovery/window_tracker.hpp"

#include <fmt/format.h>

#include <stdexcept>

namespace moevement::recovery {

window_tracker::window_tracker(std::uint32_t copies) : copies_(copies) {
  if (copies == 0) {
    throw std::invalid_argument("checkpoint replication needs at least one copy (r >= 1)");
  }
}

void window_tracker::open_window(std::uint64_t window, std::uint64_t first_iteration,
                                 std::uint32_t slots, const std::vector<std::uint32_t>& owners) {
  if (!windows_.empty() && window <= windows_.rbegin()->first) {
    throw std::invalid_argument(
        fmt::format("window {} opened after window {}", window, windows_.rbegin()->first));
  }
  if (slots == 0 || owners.empty()) {
    throw std::invalid_argument("a window needs at least one slot and one owner");
  }
  window_state w;
  w.first_iteration = first_iteration;
  for (std::uint32_t s = 0; s < slots; ++s) {
    for (std::uint32_t o : owners) w.copies[{window, s, o}];
  }
  windows_.emplace(window, std::move(w));
}

bool window_tracker::complete(const window_state& w) const {
  for (const auto& [slot, holders] : w.copies) {
    if (holders.size() < copies_) return false;
  }
  return true;
}

std::optional<window_tracker::persisted_event> window_tracker::record_copy(const slot_key& slot,
                                                                           std::uint32_t holder) {
  auto wit = windows_.find(slot.window);
  if (wit == windows_.end() || holder == slot.owner) return std::nullopt;
  auto sit = wit->second.copies.find(slot);
  if (sit == wit->second.copies.end()) return std::nullopt;
  sit->second.insert(holder);
  if (wit->second.persisted || !complete(wit->second)) return std::nullopt;

  // Newly persisted. Windows persist in order of completion; an older window that completes
  // after a newer one is simply garbage.
  if (persisted_ && *persisted_ > slot.window) return std::nullopt;
  wit->second.persisted = true;
  persisted_event ev;
  ev.window = slot.window;
  ev.log_cutoff = wit->second.first_iteration;
  persisted_ = slot.window;
  for (auto it = windows_.begin(); it != windows_.end() && it->first < slot.window;) {
    ev.collectable.push_back(it->first);
    it = windows_.erase(it);
  }
  return ev;
}

std::vector<slot_key> window_tracker::holder_lost(std::uint32_t holder) {
  std::vector<slot_key> lost;
  for (auto& [id, w] : windows_) {
    for (auto& [slot, holders] : w.copies) {
      const bool had = holders.erase(holder) > 0;
      if (had && holders.empty() && w.persisted) lost.push_back(slot);
    }
  }
  return lost;
}

std::vector<std::uint32_t> window_tracker::holders(const slot_key& slot) const {
  auto wit = windows_.find(slot.window);
  if (wit == windows_.end()) return {};
  auto sit = wit->second.copies.find(slot);
  if (sit == wit->second.copies.end()) return {};
  return {sit->second.begin(), sit->second.end()};
}

std::optional<std::uint64_t> window_tracker::first_iteration(std::uint64_t window) const {
  auto it = windows_.find(window);
  if (it == windows_.end()) return std::nullopt;
  return it->second.first_iteration;
}

}  // namespace moevement::recovery
