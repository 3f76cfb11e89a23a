// Where policy moevement's steps put their slots (docs/sparse-checkpointing.md "Windows").
// Windows are numbered from 0 and follow each other with no gap: from a segment's first step
// on, every W_sparse steps make one window, the step of a window's slot j being its first step
// plus j. W_sparse may change at a window's start (recovery/window_tuner.hpp), which begins a
// new segment. The head keeps the plan and puts each step's window and slot in its Step, so
// that every stage replica, a replacement included, captures alike whatever W was when; a
// step planned again (after a recovery) is placed as it was the first time.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "engine/hooks.hpp"

namespace moevement::recovery {

class window_plan {
 public:
  struct segment {
    std::int64_t step = 0;     // its first step (slot 0 of `window`)
    std::uint64_t window = 0;  // the window that step begins
    int w = 1;                 // steps per window from there on
  };

  bool empty() const { return segments_.empty(); }
  // From `step` on, windows of `w` steps. The plan's first segment begins window `first`
  // (0, or where a resumed job's windows go on); later ones must begin at a window's start
  // (std::logic_error otherwise) and replace what the plan said from there on.
  void start(std::int64_t step, int w, std::uint64_t first = 0);
  // Where `step` captures; w_sparse 0 before the plan's first step.
  engine::checkpoint_place at(std::int64_t step) const;
  // The size of `window` (0: none the plan still knows).
  int w_of(std::uint64_t window) const;
  // The segments no window from `window` on lies in are dropped (the plan stays small).
  void forget_before(std::uint64_t window);
  std::vector<segment> segments() const;

 private:
  std::map<std::int64_t, segment> segments_;  // by first step
};

}  // namespace moevement::recovery
