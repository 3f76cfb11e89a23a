#include "launcher/fault_hooks.hpp"

#include <fmt/format.h>

#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace moevement::launcher {

namespace {

// The flip injections aimed at (stage, replica) that `which` takes: the hook's own copies
// (each marks its `done`).
template <class Which>
std::shared_ptr<std::vector<injection>> flips_at(const std::vector<injection>& injections,
                                                 int stage, int replica, Which which) {
  auto mine = std::make_shared<std::vector<injection>>();
  for (const auto& inj : injections) {
    if (inj.what == injection::kind::flip && inj.stage == stage && inj.replica == replica &&
        which(inj)) {
      mine->push_back(inj);
    }
  }
  return mine;
}

}  // namespace

engine::fault_hook phase_fault_hook(const std::vector<injection>& injections, int stage,
                                    int replica, bool replacement, const std::string& who) {
  struct state {
    std::vector<injection> mine;
    bool replacement = false;
    std::int64_t first = -1;  // a replacement's first iteration
    std::string who;
  };
  auto s = std::make_shared<state>();
  for (const auto& inj : injections) {
    if (inj.phase && inj.stage == stage && inj.replica == replica &&
        (inj.what == injection::kind::kill || inj.what == injection::kind::hang ||
         inj.what == injection::kind::stall)) {
      s->mine.push_back(inj);
    }
  }
  if (s->mine.empty()) return {};
  s->replacement = replacement;
  s->who = who;
  return [s](std::int64_t iteration, engine::fault_point point) -> bool {
    if (s->replacement && s->first < 0) s->first = iteration;
    for (auto& inj : s->mine) {
      if (inj.done || inj.iteration != iteration || *inj.phase != point) continue;
      // Its predecessor failed there: re-running that iteration must not fail again.
      if (s->replacement && iteration <= s->first) continue;
      inj.done = true;
      const std::string line = fmt::format("inject: {} ({})\n", inj.text(), s->who);
      std::fwrite(line.data(), 1, line.size(), stdout);
      std::fflush(stdout);
      if (inj.what == injection::kind::stall) return true;  // the stage's compute thread hangs
      std::raise(inj.what == injection::kind::kill ? SIGKILL : SIGSTOP);
    }
    return false;
  };
}

engine::corruption_hook flip_hook(const std::vector<injection>& injections, int stage, int replica,
                                  bool replacement, const std::string& who) {
  auto mine = std::make_shared<std::vector<injection>>();
  for (const auto& inj : injections) {
    if (inj.what == injection::kind::flip && inj.stage == stage && inj.replica == replica) {
      mine->push_back(inj);
    }
  }
  // A replacement starts past the flip's iteration (the fenced worker's), and is not the
  // worker the flip was aimed at.
  std::erase_if(*mine, [](const injection& i) { return i.slot_copy || i.activation; });
  if (mine->empty() || replacement) return {};
  return [mine, who](std::int64_t iteration, std::span<models::operator_state* const> ops) {
    for (auto& inj : *mine) {
      if (inj.done || inj.iteration != iteration) continue;
      inj.done = true;
      models::operator_state* op = nullptr;
      for (auto* o : ops) {
        if (inj.op.empty() || o->name() == inj.op) {
          op = o;
          break;
        }
      }
      if (op == nullptr) {
        std::string names;
        for (const auto* o : ops) names += (names.empty() ? "" : ", ") + o->name();
        throw std::invalid_argument(fmt::format("{}: stage {} has no operator '{}' (it has {})",
                                                inj.text(), inj.stage, inj.op, names));
      }
      const auto master = op->master();
      if (std::uint64_t(inj.word) >= master.size()) {
        throw std::invalid_argument(
            fmt::format("{}: operator {} has {} master weights (word 0..{})", inj.text(),
                        op->name(), master.size(), master.size() - 1));
      }
      std::uint32_t bits = 0;
      std::memcpy(&bits, &master[std::size_t(inj.word)], sizeof bits);
      bits ^= std::uint32_t{1} << inj.bit;
      std::memcpy(&master[std::size_t(inj.word)], &bits, sizeof bits);
      const std::string line =
          fmt::format("inject: {} ({}, operator {})\n", inj.text(), who, op->name());
      std::fwrite(line.data(), 1, line.size(), stdout);
      std::fflush(stdout);
    }
  };
}

engine::copy_flip_hook copy_flip_hook(const std::vector<injection>& injections, int stage,
                                      int replica, bool replacement) {
  auto mine = flips_at(injections, stage, replica, [](const injection& i) { return i.slot_copy; });
  if (mine->empty() || replacement) return {};
  return [mine](std::int64_t iteration) {
    for (auto& inj : *mine) {
      if (inj.done || inj.iteration != iteration) continue;
      inj.done = true;
      return inj.bit % 8;
    }
    return -1;
  };
}

engine::send_flip_hook send_flip_hook(const std::vector<injection>& injections, int stage,
                                      int replica, bool replacement, const std::string& who) {
  auto mine = flips_at(injections, stage, replica, [](const injection& i) { return i.activation; });
  if (mine->empty() || replacement) return {};
  return [mine, who](std::int64_t iteration, int mb, std::span<float> activation) {
    for (auto& inj : *mine) {
      if (inj.done || inj.iteration != iteration || mb != 0) continue;
      if (std::uint64_t(inj.word) >= activation.size()) {
        throw std::invalid_argument(fmt::format("{}: the activation has {} words (word 0..{})",
                                                inj.text(), activation.size(),
                                                activation.size() - 1));
      }
      inj.done = true;
      std::uint32_t bits = 0;
      std::memcpy(&bits, &activation[std::size_t(inj.word)], sizeof bits);
      bits ^= std::uint32_t{1} << inj.bit;
      std::memcpy(&activation[std::size_t(inj.word)], &bits, sizeof bits);
      const std::string line = fmt::format("inject: {} ({})\n", inj.text(), who);
      std::fwrite(line.data(), 1, line.size(), stdout);
      std::fflush(stdout);
    }
  };
}

engine::fault_factory worker_fault_factory(std::vector<injection> injections, std::string who) {
  return [injections = std::move(injections), who = std::move(who)](int stage, int replica,
                                                                    bool replacement) {
    return engine::fault_hooks{phase_fault_hook(injections, stage, replica, replacement, who),
                               flip_hook(injections, stage, replica, replacement, who),
                               copy_flip_hook(injections, stage, replica, replacement),
                               send_flip_hook(injections, stage, replica, replacement, who)};
  };
}

}  // namespace moevement::launcher
