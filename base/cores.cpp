#include "base/cores.hpp"

#include <sched.h>

#include <algorithm>
#include <thread>

namespace moevement::base {

int usable_cores() {
  cpu_set_t mask;
  CPU_ZERO(&mask);
  if (::sched_getaffinity(0, sizeof mask, &mask) == 0) return std::max(1, CPU_COUNT(&mask));
  // (A mask larger than cpu_set_t's 1024 CPUs: the machine's count.)
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace moevement::base
