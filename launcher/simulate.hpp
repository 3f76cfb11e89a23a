// `moevement simulate CONFIG [--set key=value ...] [--csv FILE] [--sweep]`: the ETTR simulator.
#pragma once

#include <ostream>

namespace moevement::launcher {

// argv as given to main (argv[1] == "simulate"). Returns the exit code: 0 ok, 2 usage error,
// 1 bad config (the message names the key).
int run_simulate(int argc, char** argv, std::ostream& out, std::ostream& err);

}  // namespace moevement::launcher
