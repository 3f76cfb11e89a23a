#include "engine/snapshot_placement.hpp"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <set>

namespace moevement::engine {

bool run_safe(int owner_stage, int holder_stage, int pp) {
  if (holder_stage < 0) return true;
  const int run = pp / 2;
  return std::abs(holder_stage - owner_stage) >= run;
}

std::map<transport::node_id, std::vector<transport::node_id>> place_snapshot_copies(
    const std::vector<placement_candidate>& workers, int pp, int copies) {
  std::vector<placement_candidate> all = workers;
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.node < b.node; });
  const std::size_t n = all.size();
  std::map<int, std::set<std::string>> stage_domains;  // stage -> domains running it
  for (const auto& w : all) {
    if (w.stage >= 0) stage_domains[w.stage].insert(w.domain);
  }
  std::vector<int> load(n, 0);
  std::map<transport::node_id, std::vector<transport::node_id>> out;
  for (std::size_t o = 0; o < n; ++o) {
    const placement_candidate& owner = all[o];
    if (owner.stage < 0) continue;
    // Domains that run another replica of the owner's stage (not the owner's own domain).
    std::set<std::string> stage_elsewhere;
    for (const auto& w : all) {
      if (w.stage == owner.stage && w.node != owner.node) stage_elsewhere.insert(w.domain);
    }
    std::vector<bool> chosen(n, false);
    chosen[o] = true;
    std::set<std::string> domains_taken;
    bool have_other_domain = false, have_run_safe = false;
    auto& holders = out[owner.node];
    for (int copy = 0; copy < copies; ++copy) {
      std::size_t best = n;
      std::array<int, 8> best_key{};
      for (std::size_t step = 1; step < n; ++step) {
        const std::size_t c = (o + step) % n;
        if (chosen[c]) continue;
        const placement_candidate& h = all[c];
        const bool other_domain = h.domain != owner.domain;
        const bool safe = run_safe(owner.stage, h.stage, pp);
        const int covers =
            (other_domain && !have_other_domain ? 1 : 0) + (safe && !have_run_safe ? 1 : 0);
        const std::array<int, 8> key{-covers,
                                     other_domain ? 0 : 1,
                                     stage_elsewhere.contains(h.domain) ? 1 : 0,
                                     domains_taken.contains(h.domain) ? 1 : 0,
                                     safe ? 0 : 1,
                                     load[c],
                                     h.stage == owner.stage ? 1 : 0,
                                     int(step)};
        if (best == n || key < best_key) {
          best = c;
          best_key = key;
        }
      }
      if (best == n) break;  // no other worker left
      chosen[best] = true;
      ++load[best];
      const placement_candidate& h = all[best];
      have_other_domain = have_other_domain || h.domain != owner.domain;
      have_run_safe = have_run_safe || run_safe(owner.stage, h.stage, pp);
      domains_taken.insert(h.domain);
      holders.push_back(h.node);
    }
  }
  return out;
}

}  // namespace moevement::engine
