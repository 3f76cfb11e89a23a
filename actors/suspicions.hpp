// The head's book of suspicions: members that report they cannot hear another member, and the
// verdicts the head takes on them. Only the head declares a member lost; a member that cannot
// hear a peer reports it here (actors/system.capnp: Unreachable, then Reachable once it hears
// it again) and goes on. A report stands for a collection window before a verdict, so that
// every report of one fault is in:
//   - a reporter that cannot hear two or more members is the one cut off: it is declared lost;
//   - otherwise each suspect of a standing report is (the link's far end), in report order,
//     and a declared node's own reports fall with it (of two nodes that cannot hear each other,
//     one is replaced, not both);
//   - but a reporter whose word alone cost another member within `memory`, reporting another
//     alone, is the one cut off (it loses its peers one at a time: a flapping link of its own,
//     not theirs). A suspect reported by several members is theirs to lose.
// Pure bookkeeping: the actor system feeds it and acts on its verdicts.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "transport/link.hpp"

namespace moevement::actors {

class suspicion_book {
 public:
  using clock = std::chrono::steady_clock;
  using node_id = transport::node_id;

  struct verdict {
    node_id node = 0;
    std::string why;
  };

  // `reporter` has not heard `suspect` (`detail` says for how long). A repeated report keeps
  // its first time.
  void report(node_id reporter, node_id suspect, clock::time_point at, std::string detail);
  // `reporter` hears `suspect` again.
  void withdraw(node_id reporter, node_id suspect);
  // `n` is gone (declared lost, or left): its reports, those about it and what its word cost
  // are dropped.
  void forget(node_id n);
  bool empty() const { return reports_.empty(); }
  // When the oldest standing report's window ends; nullopt when none stands.
  std::optional<clock::time_point> next_due(clock::duration window) const;
  // The verdicts on the reports older than `window` at `now`; those decided are dropped.
  // Reports about a node the judge does not hear itself (`hears` false) wait: neither a
  // verdict on it nor a count against its reporter. `memory`: how long a verdict on one
  // reporter's word counts against that reporter.
  std::vector<verdict> decide(clock::time_point now, clock::duration window, clock::duration memory,
                              const std::function<bool(node_id)>& hears = {});

 private:
  struct report_entry {
    node_id reporter = 0;
    node_id suspect = 0;
    clock::time_point at;
    std::string detail;
  };
  std::vector<report_entry> reports_;  // in report order
  struct cost {
    node_id suspect = 0;
    clock::time_point at;
  };
  std::map<node_id, cost> cost_of_word_;  // a reporter's last verdict on its word alone
};

}  // namespace moevement::actors
