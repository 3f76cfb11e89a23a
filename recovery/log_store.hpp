// The upstream log of one stage (paper section 3.4): every activation it sent downstream
// and every gradient it sent upstream, kept at the sender in host memory, tagged
// (iteration, micro-batch, direction), so a failed neighbour can replay alone. Entries older
// than the persisted window are dropped (stale log cleanup). The log keeper actor owns one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <tuple>
#include <vector>

namespace moevement::recovery {

enum class log_direction : std::uint8_t {
  activation = 0,  // forward output sent to the next stage
  gradient = 1,    // input gradient sent to the previous stage
};

struct log_key {
  std::uint64_t iteration = 0;
  std::uint32_t micro_batch = 0;
  log_direction direction = log_direction::activation;
  // The replica whose boundary this is (a stage sends to one replica of its neighbour).
  std::uint32_t replica = 0;

  auto operator<=>(const log_key&) const = default;
};

// Buffers of a log's entries, recycled (thread-safe): what a drop frees holds the next sends'
// copies, so that once the log is as large as it stays a send's copy allocates nothing (a
// malloc and a free of a tensor's bytes per send, and the heap's consolidation of them, were
// the largest part of the log's cost at 9 ms iterations).
class log_buffers {
 public:
  // A copy of `bytes`, in a kept buffer where one is large enough.
  std::vector<std::byte> copy(std::span<const std::byte> bytes);
  // What a drop freed, kept for the next sends: at most as many bytes as this drop freed (the
  // next window's sends need about as many), the oldest let go first.
  void keep(std::vector<std::vector<std::byte>> freed);
  std::size_t bytes() const;

 private:
  mutable std::mutex mu_;
  std::deque<std::vector<std::byte>> free_;
  std::size_t bytes_ = 0;
};

class log_store {
 public:
  // Dropped entries' buffers go to `buffers` (null: freed).
  void recycle_into(std::shared_ptr<log_buffers> buffers) { recycled_ = std::move(buffers); }
  // Keeps a copy of the tensor bytes. Appending the same key twice replaces the entry only
  // if the bytes are identical (a replayed iteration resends the same bits); different
  // bytes mean determinism was broken, which is reported as false.
  bool append(const log_key& key, std::span<const std::byte> bytes);
  // The same, keeping `bytes` itself (a copy already made off the lock: log_copier).
  bool append(const log_key& key, std::vector<std::byte>&& bytes);

  // The bytes of one entry, or nothing if absent.
  std::optional<std::span<const std::byte>> find(const log_key& key) const;

  // Every entry of one iteration and direction, in micro-batch order (for a replay).
  std::vector<log_key> keys_of(std::uint64_t iteration, log_direction direction) const;

  // Drops every entry with iteration < first_kept. Returns the bytes freed.
  std::size_t drop_before(std::uint64_t first_kept);

  std::size_t bytes() const { return bytes_; }
  std::size_t entries() const { return entries_.size(); }
  // Oldest and newest iteration held, if any.
  std::optional<std::pair<std::uint64_t, std::uint64_t>> span_held() const;

 private:
  std::map<log_key, std::vector<std::byte>> entries_;
  std::size_t bytes_ = 0;
  std::shared_ptr<log_buffers> recycled_;
};

// A recovery fetches a neighbour's log of iterations [first, end) in pieces of whole
// iterations, each at most `piece_bytes` (at least one iteration each): every answer is a
// region the neighbour allocates and registers, and the whole log of a large model's 2 x W
// iterations may not fit one. Each piece is [first, last] (inclusive, as FetchLog asks).
std::vector<std::pair<std::int64_t, std::int64_t>> log_fetch_pieces(std::int64_t first,
                                                                    std::int64_t end,
                                                                    std::uint64_t iteration_bytes,
                                                                    std::uint64_t piece_bytes);

}  // namespace moevement::recovery
