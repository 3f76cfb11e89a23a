#include "recovery/shadow_windows.hpp"

#include <algorithm>

namespace moevement::recovery {

shadow_windows::shadow_windows(int stages, bool on)
    : stages_(std::max(stages, 1)), kind_(on ? kind::start : kind::none) {}

std::optional<shadow_windows::window_at> shadow_windows::base(
    const std::optional<window_at>& persisted) {
  if (kind_ == kind::none && persisted) {  // vouching starts again: on trust
    kind_ = kind::assumed;
    base_ = *persisted;
    candidate_.reset();
    agreed_.clear();
  }
  if (kind_ == kind::start || kind_ == kind::none) return std::nullopt;
  return base_;
}

void shadow_windows::agreed(int stage, std::int64_t iteration,
                            const std::optional<window_at>& persisted) {
  if (kind_ == kind::none) return;
  // (From a window taken on trust, as clean as that window.)
  clean_[stage] = iteration;
  if (!candidate_) {
    // The persisted window is the candidate where it is newer than the base: this check,
    // after its every capture, vouches for it for this stage.
    const bool newer = persisted && (kind_ == kind::start || persisted->window > base_.window);
    if (!newer) return;
    candidate_ = *persisted;
    agreed_.clear();
  }
  agreed_.insert(stage);
  if (int(agreed_.size()) < stages_) return;
  base_ = *candidate_;
  kind_ = kind_ == kind::assumed ? kind::assumed : kind::vouched;
  candidate_.reset();
  agreed_.clear();
}

std::int64_t shadow_windows::clean_before(int stage) const {
  std::int64_t from = kind_ == kind::vouched || kind_ == kind::assumed ? base_.first : 0;
  if (const auto c = clean_.find(stage); c != clean_.end()) from = std::max(from, c->second + 1);
  return from;
}

void shadow_windows::restart() {
  if (kind_ == kind::none && !candidate_) return;
  kind_ = kind::none;
  candidate_.reset();
  agreed_.clear();
  clean_.clear();
}

std::vector<std::uint64_t> shadow_windows::retained() const {
  std::vector<std::uint64_t> out;
  if (kind_ == kind::vouched || kind_ == kind::assumed) out.push_back(base_.window);
  if (candidate_ && (out.empty() || candidate_->window != out.front())) {
    out.push_back(candidate_->window);
  }
  return out;
}

std::vector<std::int64_t> shadow_windows::retained_firsts() const {
  std::vector<std::int64_t> out;
  if (kind_ == kind::vouched || kind_ == kind::assumed) out.push_back(base_.first);
  if (candidate_) out.push_back(candidate_->first);
  return out;
}

std::int64_t shadow_windows::retained_from() const {
  switch (kind_) {
    case kind::start:
      return 0;
    case kind::vouched:
    case kind::assumed:
      return base_.first;
    default:
      return -1;
  }
}

}  // namespace moevement::recovery
