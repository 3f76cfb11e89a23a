#include "actors/deterministic.hpp"

namespace moevement::actors {

deterministic::~deterministic() {
  for (auto& [n, s] : systems_) s->shutdown();
  run();
  systems_.clear();
  links_.clear();
}

actor_system& deterministic::add(node_id n, system_config cfg) {
  cfg.time = &time_;
  links_[n] = hub_.attach(n);
  systems_[n] = std::make_unique<actor_system>(io_, *links_[n], cfg);
  return *systems_[n];
}

bool deterministic::step() {
  if (io_.stopped()) io_.restart();
  return io_.poll_one() != 0;
}

std::size_t deterministic::run() {
  std::size_t n = 0;
  while (step()) ++n;
  return n;
}

void deterministic::advance(clock::duration d) {
  const auto until = time_.now() + d;
  run();
  while (time_.advance_to(until)) run();
}

bool deterministic::run_until(const std::function<bool()>& done, clock::duration limit) {
  const auto until = time_.now() + limit;
  for (;;) {
    while (!done() && step()) {
    }
    if (done()) return true;
    const auto next = time_.next_due();
    if (!next || *next > until) return false;
    time_.advance_to(*next);
  }
}

}  // namespace moevement::actors
