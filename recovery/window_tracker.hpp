// Which sparse-checkpoint windows are persisted (paper section 3.2, "Persisting Snapshots").
// Each iteration of a window produces one snapshot slot per stage worker; each slot must
// reach `copies` replicators on other nodes. A window is persisted once every one of its
// slots has all its copies. One persisted window and one in flight are kept; when a newer
// window persists, the older persisted one becomes garbage, and so do the upstream logs
// older than the new window's first iteration.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

namespace moevement::recovery {

struct slot_key {
  std::uint64_t window = 0;
  std::uint32_t slot = 0;   // 0 .. W_sparse-1: the iteration within the window
  std::uint32_t owner = 0;  // the stage worker whose state the slot holds
  auto operator<=>(const slot_key&) const = default;
};

class window_tracker {
 public:
  explicit window_tracker(std::uint32_t copies);

  // Starts tracking a window of `slots` slots for each owner, beginning at first_iteration.
  // Throws std::invalid_argument if the window id does not grow or the shape is empty.
  void open_window(std::uint64_t window, std::uint64_t first_iteration, std::uint32_t slots,
                   const std::vector<std::uint32_t>& owners);

  struct persisted_event {
    std::uint64_t window = 0;
    std::vector<std::uint64_t> collectable;  // older windows whose copies can be dropped
    std::uint64_t log_cutoff = 0;            // logs with iteration < this can be dropped
  };
  // A replicator (holder) acknowledged a copy. Returns the event when this completed a window.
  // Copies on the owner itself do not count; unknown windows or slots are ignored (false).
  std::optional<persisted_event> record_copy(const slot_key& slot, std::uint32_t holder);

  // A replicator is gone: its copies no longer count. Returns the slots of the persisted
  // window that now have no copy left anywhere (a non-empty result means the persisted
  // window cannot be recovered from memory: fall back to the durable tier).
  std::vector<slot_key> holder_lost(std::uint32_t holder);

  std::optional<std::uint64_t> persisted() const { return persisted_; }
  std::vector<std::uint32_t> holders(const slot_key& slot) const;
  std::optional<std::uint64_t> first_iteration(std::uint64_t window) const;
  std::size_t windows_tracked() const { return windows_.size(); }

 private:
  struct window_state {
    std::uint64_t first_iteration = 0;
    std::map<slot_key, std::set<std::uint32_t>> copies;  // every slot of the window
    bool persisted = false;
  };
  bool complete(const window_state& w) const;

  std::uint32_t copies_;
  std::map<std::uint64_t, window_state> windows_;
  std::optional<std::uint64_t> persisted_;
};

}  // namespace moevement::recovery
