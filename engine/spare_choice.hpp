// Which spare takes a lost worker's role (the head's recoveries, and a loss before training
// starts).
#pragma once

#include <functional>
#include <map>
#include <string>

#include "engine/head_recovery.hpp"

namespace moevement::engine {

// The spare (stage < 0) that takes the role of a worker lost in failure domain `lost_domain`:
// the lowest-numbered usable one in another domain, else the lowest-numbered usable one; 0 if
// none is. Another domain first: a host that lost one worker often loses the next, and a
// flapping link between the reporter's host and the lost one would otherwise cost its
// replacement too (and then the reporter its place, actors/suspicions.hpp).
transport::node_id choose_spare(const std::map<transport::node_id, worker_info>& workers,
                                const std::string& lost_domain,
                                const std::function<bool(transport::node_id)>& usable);

}  // namespace moevement::engine
