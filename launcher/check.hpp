// `moevement check`: what this machine gives the runtime, each item verified for real.
#pragma once

#include <ostream>

namespace moevement::launcher {

// Prints one line per check; returns 0 when all passed.
int run_check(std::ostream& out);

}  // namespace moevement::launcher
