#include "engine/spare_choice.hpp"

namespace moevement::engine {

transport::node_id choose_spare(const std::map<transport::node_id, worker_info>& workers,
                                const std::string& lost_domain,
                                const std::function<bool(transport::node_id)>& usable) {
  transport::node_id same_domain = 0;
  for (const auto& [n, w] : workers) {
    if (w.stage >= 0 || !usable(n)) continue;
    if (lost_domain.empty() || w.domain != lost_domain) return n;
    if (same_domain == 0) same_domain = n;
  }
  return same_domain;
}

}  // namespace moevement::engine
