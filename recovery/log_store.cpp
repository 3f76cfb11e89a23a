#include "recovery/log_store.hpp"

#include <algorithm>

namespace moevement::recovery {

bool log_store::append(const log_key& key, std::span<const std::byte> bytes) {
  auto it = entries_.find(key);
  if (it != entries_.end()) {
    return it->second.size() == bytes.size() &&
           std::equal(bytes.begin(), bytes.end(), it->second.begin());
  }
  entries_.emplace(key, std::vector<std::byte>(bytes.begin(), bytes.end()));
  bytes_ += bytes.size();
  return true;
}

bool log_store::append(const log_key& key, std::vector<std::byte>&& bytes) {
  auto it = entries_.find(key);
  if (it != entries_.end()) return it->second == bytes;
  bytes_ += bytes.size();
  entries_.emplace(key, std::move(bytes));
  return true;
}

std::optional<std::span<const std::byte>> log_store::find(const log_key& key) const {
  auto it = entries_.find(key);
  if (it == entries_.end()) return std::nullopt;
  return std::span<const std::byte>(it->second);
}

std::vector<log_key> log_store::keys_of(std::uint64_t iteration, log_direction direction) const {
  std::vector<log_key> out;
  // Keys sort by iteration first, so the iteration's entries are one contiguous range.
  for (auto it = entries_.lower_bound(log_key{iteration, 0, log_direction::activation, 0});
       it != entries_.end() && it->first.iteration == iteration; ++it) {
    if (it->first.direction == direction) out.push_back(it->first);
  }
  std::stable_sort(out.begin(), out.end(), [](const log_key& a, const log_key& b) {
    return std::tie(a.micro_batch, a.replica) < std::tie(b.micro_batch, b.replica);
  });
  return out;
}

std::size_t log_store::drop_before(std::uint64_t first_kept) {
  std::size_t freed = 0;
  auto end = entries_.lower_bound(log_key{first_kept, 0, log_direction::activation, 0});
  std::vector<std::vector<std::byte>> buffers;
  for (auto it = entries_.begin(); it != end; ++it) {
    freed += it->second.size();
    if (recycled_) buffers.push_back(std::move(it->second));
  }
  entries_.erase(entries_.begin(), end);
  bytes_ -= freed;
  if (recycled_ && !buffers.empty()) recycled_->keep(std::move(buffers));
  return freed;
}

std::vector<std::byte> log_buffers::copy(std::span<const std::byte> bytes) {
  std::vector<std::byte> out;
  {
    const std::lock_guard lock(mu_);
    // The sends of a stage come in a few sizes: the newest kept buffers are tried, not all.
    const std::size_t tries = std::min<std::size_t>(free_.size(), 4);
    for (std::size_t k = 0; k < tries; ++k) {
      auto& b = free_[free_.size() - 1 - k];
      if (b.capacity() < bytes.size() || b.capacity() > 2 * bytes.size()) continue;
      out = std::move(b);
      bytes_ -= out.capacity();
      free_.erase(free_.end() - 1 - std::ptrdiff_t(k));
      break;
    }
  }
  out.assign(bytes.begin(), bytes.end());  // no allocation where the buffer is large enough
  return out;
}

void log_buffers::keep(std::vector<std::vector<std::byte>> freed) {
  std::size_t limit = 0;
  for (const auto& b : freed) limit += b.capacity();
  std::vector<std::vector<std::byte>> let_go;  // freed outside the lock
  {
    const std::lock_guard lock(mu_);
    for (auto& b : freed) {
      bytes_ += b.capacity();
      free_.push_back(std::move(b));
    }
    while (bytes_ > limit && !free_.empty()) {
      bytes_ -= free_.front().capacity();
      let_go.push_back(std::move(free_.front()));
      free_.pop_front();
    }
  }
}

std::size_t log_buffers::bytes() const {
  const std::lock_guard lock(mu_);
  return bytes_;
}

std::optional<std::pair<std::uint64_t, std::uint64_t>> log_store::span_held() const {
  if (entries_.empty()) return std::nullopt;
  return std::make_pair(entries_.begin()->first.iteration, entries_.rbegin()->first.iteration);
}

std::vector<std::pair<std::int64_t, std::int64_t>> log_fetch_pieces(std::int64_t first,
                                                                    std::int64_t end,
                                                                    std::uint64_t iteration_bytes,
                                                                    std::uint64_t piece_bytes) {
  // At most 2^20 iterations a piece: what a neighbour serves in one answer.
  constexpr std::uint64_t most = std::uint64_t(1) << 20;
  const auto per = std::int64_t(
      iteration_bytes == 0 ? most
                           : std::clamp<std::uint64_t>(piece_bytes / iteration_bytes, 1, most));
  std::vector<std::pair<std::int64_t, std::int64_t>> out;
  for (std::int64_t it = first; it < end; it += per) {
    out.emplace_back(it, std::min(it + per, end) - 1);
  }
  return out;
}

}  // namespace moevement::recovery
