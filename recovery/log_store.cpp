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
  for (auto it = entries_.begin(); it != end; ++it) freed += it->second.size();
  entries_.erase(entries_.begin(), end);
  bytes_ -= freed;
  return freed;
}

std::optional<std::pair<std::uint64_t, std::uint64_t>> log_store::span_held() const {
  if (entries_.empty()) return std::nullopt;
  return std::make_pair(entries_.begin()->first.iteration, entries_.rbegin()->first.iteration);
}

}  // namespace moevement::recovery
