// Worker side of `--inject`: the hooks through which a worker carries out the injections
// aimed at its stage (launcher/inject.hpp parses and checks them on the head). Each prints
// `inject: SPEC (who)` when it strikes.
#pragma once

#include <string>
#include <vector>

#include "engine/hooks.hpp"
#include "launcher/inject.hpp"

namespace moevement::launcher {

// Worker side: the fault hook of the stage (stage, replica) for the phase injections among
// `injections`. It prints `inject: SPEC (who)` and raises SIGKILL or SIGSTOP in this process at
// the point. A replacement (rebuilt on a spare) skips every injection of an iteration up to the
// first one it runs, which its predecessor already failed in. Empty when none applies.
engine::fault_hook phase_fault_hook(const std::vector<injection>& injections, int stage,
                                    int replica, bool replacement, const std::string& who);

// Worker side: the corruption hook of stage (stage, replica) for the flip injections among
// `injections` (empty when none applies, or for a replacement). It prints `inject: SPEC (who)`
// when it flips; an operator or word the stage does not have throws std::invalid_argument.
engine::corruption_hook flip_hook(const std::vector<injection>& injections, int stage, int replica,
                                  bool replacement, const std::string& who);
// The same for flip ...,target=slot: the bit to flip in the first holder's copy of the slot
// of an iteration (engine::fault_hooks::copy_flip).
engine::copy_flip_hook copy_flip_hook(const std::vector<injection>& injections, int stage,
                                      int replica, bool replacement);
// And for flip ...,target=activation (engine::fault_hooks::send_flip).
engine::send_flip_hook send_flip_hook(const std::vector<injection>& injections, int stage,
                                      int replica, bool replacement, const std::string& who);

// All four for whichever stage a worker is given (engine::worker_agent's fault factory);
// `who` names the worker in the lines they print.
engine::fault_factory worker_fault_factory(std::vector<injection> injections, std::string who);

}  // namespace moevement::launcher
