#include "actors/suspicions.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

namespace moevement::actors {

void suspicion_book::report(node_id reporter, node_id suspect, clock::time_point at,
                            std::string detail) {
  if (reporter == suspect) return;
  for (const auto& r : reports_) {
    if (r.reporter == reporter && r.suspect == suspect) return;
  }
  reports_.push_back({reporter, suspect, at, std::move(detail)});
}

void suspicion_book::withdraw(node_id reporter, node_id suspect) {
  std::erase_if(reports_, [&](const report_entry& r) {
    return r.reporter == reporter && r.suspect == suspect;
  });
}

void suspicion_book::forget(node_id n) {
  std::erase_if(reports_, [n](const report_entry& r) { return r.reporter == n || r.suspect == n; });
  cost_of_word_.erase(n);
}

std::optional<suspicion_book::clock::time_point> suspicion_book::next_due(
    clock::duration window) const {
  if (reports_.empty()) return std::nullopt;
  auto oldest = reports_.front().at;
  for (const auto& r : reports_) oldest = std::min(oldest, r.at);
  return oldest + window;
}

std::vector<suspicion_book::verdict> suspicion_book::decide(
    clock::time_point now, clock::duration window, clock::duration memory,
    const std::function<bool(node_id)>& hears) {
  std::vector<verdict> out;
  auto heard = [&](node_id n) { return !hears || hears(n); };
  auto ripe = [&](const report_entry& r) { return r.at + window <= now && heard(r.suspect); };
  if (std::none_of(reports_.begin(), reports_.end(), ripe)) return out;
  // A reporter that cannot hear two or more members (that the judge hears) is the one cut off.
  std::map<node_id, std::set<node_id>> heard_of;
  for (const auto& r : reports_) {
    if (heard(r.suspect)) heard_of[r.reporter].insert(r.suspect);
  }
  for (const auto& r : reports_) {
    if (!ripe(r) || heard_of[r.reporter].size() < 2) continue;
    if (std::any_of(out.begin(), out.end(), [&](const verdict& v) { return v.node == r.reporter; }))
      continue;
    std::string names;
    for (node_id s : heard_of[r.reporter])
      names += fmt::format("{}{}", names.empty() ? "" : ", ", s);
    out.push_back(
        {r.reporter, fmt::format("it cannot reach nodes {} (the head hears them)", names)});
  }
  for (const auto& v : out) forget(v.node);
  // Otherwise the link's far end, in report order; a declared node's own reports fall with it.
  while (true) {
    auto it = std::find_if(reports_.begin(), reports_.end(), ripe);
    if (it == reports_.end()) break;
    const node_id reporter = it->reporter;
    const node_id suspect = it->suspect;
    // On one member's word alone? (Others that cannot hear the suspect either back it up: no
    // mark against any of them.)
    const bool alone = std::count_if(reports_.begin(), reports_.end(), [&](const report_entry& r) {
                         return r.suspect == suspect;
                       }) == 1;
    if (auto c = cost_of_word_.find(reporter);
        alone && c != cost_of_word_.end() && now - c->second.at <= memory) {
      out.push_back(
          {reporter, fmt::format("it cannot reach node {}, after node {} {:.1f} s ago "
                                 "(the head hears both): it loses its peers one by one",
                                 suspect, c->second.suspect,
                                 std::chrono::duration<double>(now - c->second.at).count())});
      forget(reporter);
      continue;
    }
    out.push_back({suspect, fmt::format("unreachable from node {} ({})", reporter, it->detail)});
    forget(suspect);
    if (alone) cost_of_word_[reporter] = {suspect, now};
  }
  return out;
}

}  // namespace moevement::actors
