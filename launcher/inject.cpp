#include "launcher/inject.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <stdexcept>

namespace moevement::launcher {

namespace {

constexpr const char* inject_usage =
    "expected kill:stage=S,replica=D,iter=T or hang:stage=S,replica=D,iter=T (T >= 1)";

std::int64_t number(const std::string& spec, const std::string& key, const std::string& v,
                    std::int64_t lo, std::int64_t hi) {
  char* end = nullptr;
  const long long x = std::strtoll(v.c_str(), &end, 10);
  if (v.empty() || *end != '\0' || x < lo || x > hi) {
    throw std::invalid_argument(
        fmt::format("--inject {}: {} must be an integer in [{}, {}], got "
                    "'{}'",
                    spec, key, lo, hi, v));
  }
  return x;
}

}  // namespace

std::string injection::text() const {
  return fmt::format("{}:stage={},replica={},iter={}", what == kind::kill ? "kill" : "hang", stage,
                     replica, iteration);
}

injection parse_injection(const std::string& spec) {
  const auto colon = spec.find(':');
  if (colon == std::string::npos) {
    throw std::invalid_argument(fmt::format("--inject {}: {}", spec, inject_usage));
  }
  injection inj;
  const std::string head = spec.substr(0, colon);
  if (head == "kill") {
    inj.what = injection::kind::kill;
  } else if (head == "hang") {
    inj.what = injection::kind::hang;
  } else {
    throw std::invalid_argument(
        fmt::format("--inject {}: unknown failure '{}'; {}", spec, head, inject_usage));
  }
  bool have_stage = false, have_replica = false, have_iter = false;
  std::size_t pos = colon + 1;
  while (pos <= spec.size()) {
    const auto comma = spec.find(',', pos);
    const std::string item =
        spec.substr(pos, comma == std::string::npos ? std::string::npos : comma - pos);
    const auto eq = item.find('=');
    if (eq == std::string::npos) {
      throw std::invalid_argument(
          fmt::format("--inject {}: '{}' is not key=value; {}", spec, item, inject_usage));
    }
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "stage") {
      inj.stage = int(number(spec, k, v, 0, 1 << 16));
      have_stage = true;
    } else if (k == "replica") {
      inj.replica = int(number(spec, k, v, 0, 1 << 16));
      have_replica = true;
    } else if (k == "iter") {
      inj.iteration = number(spec, k, v, 1, std::int64_t(1) << 40);
      have_iter = true;
    } else {
      throw std::invalid_argument(
          fmt::format("--inject {}: unknown key '{}'; {}", spec, k, inject_usage));
    }
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  if (!have_stage || !have_replica || !have_iter) {
    throw std::invalid_argument(
        fmt::format("--inject {}: stage, replica and iter are all needed; {}", spec, inject_usage));
  }
  return inj;
}

}  // namespace moevement::launcher
