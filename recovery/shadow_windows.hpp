// Which window dp = 1's shadow checks (checkpoint.shadow_every, docs/recovery.md "One copy")
// replay from. A replay from a window that captured an operator after a bit of it flipped
// carries the flip and agrees with the live stage, so a check replays from a window that
// earlier checks vouched for: one persisted (so captured) before a check of every stage that
// agreed, each replaying from the window vouched for before it. The job's first checks replay
// from its initial state. Part of window_book, which keeps the base window and the candidate
// (and the logs and step plans since the base's first iteration) on every stage and replicator.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <vector>

namespace moevement::recovery {

class shadow_windows {
 public:
  struct window_at {
    std::uint64_t window = 0;
    std::int64_t first = 0;  // its first iteration
  };
  // on: checkpoint.shadow_every > 0.
  shadow_windows(int stages, bool on);

  // Where the next check replays from: a window, or none for the job's initial state.
  // `persisted`: the persisted window, taken unvouched where vouching starts again (restart).
  std::optional<window_at> base(const std::optional<window_at>& persisted);
  // Whether base() is the initial state or a window vouched for from it (else vouching
  // started again from a window taken on trust, and a flip before its capture goes unseen).
  bool vouched() const { return kind_ != kind::assumed; }
  // A check of `stage` from base() agreed after iteration `iteration`; `persisted`: the
  // persisted window now (every capture of it precedes the check).
  void agreed(int stage, std::int64_t iteration, const std::optional<window_at>& persisted);
  // A check found corruption in `stage`: every state before this iteration is clean of it
  // (the base's first iteration, or past the stage's last check that agreed).
  std::int64_t clean_before(int stage) const;
  // A check gave no verdict, or the job recovered, rolled back, resumed or was taken over:
  // the next check takes the persisted window on trust and vouching starts again from it.
  void restart();

  // What the stages and replicators keep beside the persisted window: the base and the
  // candidate, and logs and step plans from `retained_from()` (-1: none kept).
  std::vector<std::uint64_t> retained() const;
  // The first iterations of the base and the candidate (a rollback past corruption a check
  // finds goes back to before one of them).
  std::vector<std::int64_t> retained_firsts() const;
  std::int64_t retained_from() const;

 private:
  // start: no base yet, replays from the job's start; vouched / assumed: from base_ (vouched
  // for, or taken on trust after a restart); none: off, or restarted and waiting for the next
  // check to take the persisted window on trust.
  enum class kind { start, vouched, assumed, none };
  int stages_;
  kind kind_;
  window_at base_;
  std::optional<window_at> candidate_;  // vouched once every stage agreed since it persisted
  std::set<int> agreed_;                // the stages that did
  std::map<int, std::int64_t> clean_;   // stage -> its last check that agreed
};

}  // namespace moevement::recovery
