#include "engine/replica_check.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <map>
#include <set>
#include <utility>

namespace moevement::engine {

namespace {

// One operator's copies: its key (expert, shard, index among its kind) -> (replica, digest,
// index in that replica's list).
struct copy {
  int replica = 0;
  std::uint64_t digest = 0;
  std::size_t op = 0;
};
using op_key = std::tuple<bool, int, std::size_t>;

void compare_copies(int stage, const op_key& key, const std::vector<copy>& copies,
                    std::vector<divergence>& out) {
  if (copies.size() < 2) return;
  std::map<std::uint64_t, int> votes;
  for (const auto& c : copies) ++votes[c.digest];
  if (votes.size() == 1) return;
  divergence d;
  d.stage = stage;
  d.op = copies.front().op;
  d.expert = std::get<0>(key);
  for (const auto& c : copies) d.replicas.push_back(c.replica);
  const auto top = std::max_element(
      votes.begin(), votes.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  if (std::size_t(top->second) * 2 > copies.size()) {
    for (const auto& c : copies) {
      if (c.digest != top->first) d.bad.push_back(c.replica);
    }
  }
  out.push_back(std::move(d));
}

}  // namespace

std::vector<divergence> compare_replicas(int pp, int dp, int ep,
                                         std::span<const replica_report> reports) {
  std::vector<divergence> out;
  if (pp < 1 || dp < 1 || reports.size() != std::size_t(pp) * std::size_t(dp)) return out;
  ep = std::max(ep, 1);
  for (int s = 0; s < pp; ++s) {
    // Replicas whose list fits: the first report of each shard sets its layout.
    std::map<int, std::size_t> shard_length;
    std::map<op_key, std::vector<copy>> copies;
    for (int d = 0; d < dp; ++d) {
      const auto& r = reports[std::size_t(d * pp + s)];
      if (r.digests.empty()) continue;
      const bool sharded = ep > 1 && r.experts.size() == r.digests.size();
      const int shard = sharded ? d % ep : 0;
      const auto [it, first] = shard_length.emplace(shard, r.digests.size());
      if (!first && it->second != r.digests.size()) continue;
      std::size_t dense = 0, experts = 0;
      for (std::size_t i = 0; i < r.digests.size(); ++i) {
        const bool expert = sharded && r.experts[i];
        const op_key key = expert ? op_key{true, shard, experts++} : op_key{false, 0, dense++};
        copies[key].push_back({d, r.digests[i], i});
      }
    }
    std::vector<divergence> stage_out;
    for (const auto& [key, c] : copies) compare_copies(s, key, c, stage_out);
    std::sort(stage_out.begin(), stage_out.end(),
              [](const divergence& a, const divergence& b) { return a.op < b.op; });
    out.insert(out.end(), stage_out.begin(), stage_out.end());
  }
  return out;
}

std::vector<std::pair<int, int>> bad_replicas(std::span<const divergence> found) {
  std::set<std::pair<int, int>> bad;
  for (const auto& d : found) {
    if (d.bad.empty()) return {};
    for (int r : d.bad) bad.emplace(d.stage, r);
  }
  return {bad.begin(), bad.end()};
}

std::string describe(const divergence& d, std::span<const std::string> names) {
  const std::string name = d.op < names.size() ? fmt::format(" ({})", names[d.op]) : "";
  std::string verdict =
      d.bad.empty() ? std::string("no majority")
                    : fmt::format("replica {} differs from the majority", fmt::join(d.bad, ", "));
  if (d.bad.size() > 1) {
    verdict = fmt::format("replicas {} differ from the majority", fmt::join(d.bad, ", "));
  }
  return fmt::format("stage {} operator {}{}: copies on replicas {}; {}", d.stage, d.op, name,
                     fmt::join(d.replicas, ", "), verdict);
}

}  // namespace moevement::engine
