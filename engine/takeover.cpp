#include "engine/takeover.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <stdexcept>

namespace moevement::engine {

stage_state read_stage_state(wire::StageState::Reader m) {
  stage_state s;
  s.epoch = m.getEpoch();
  if (m.getKnown()) s.stepped = m.getStepped();
  s.dropped = m.getDropped();
  s.reduced = m.getReduced();
  s.wiring = m.getWiring();
  s.place = {m.getWSparse(), m.getWindow(), m.getSlot()};
  if (m.getHasPersisted()) s.persisted = std::pair{m.getPersistedWindow(), m.getPersistedFirst()};
  for (double x : m.getPopularity()) s.popularity.push_back(x);
  std::int64_t last = -1;
  for (auto r : m.getSteps()) {
    if (r.getIteration() <= last) {
      throw std::invalid_argument("StageState: step plans out of order or repeated");
    }
    last = r.getIteration();
    planned_step p;
    p.loss_scale = r.getLossScale();
    p.plan.apply = r.getApply();
    p.plan.grad_mul = r.getGradMul();
    p.plan.grad_norm = r.getGradNorm();
    s.steps[last] = p;
  }
  return s;
}

namespace {

bool same_place(const checkpoint_place& a, const checkpoint_place& b) {
  return a.w_sparse == b.w_sparse && a.window == b.window && a.slot == b.slot;
}

// The Step of `iteration` that the stages at `iteration - 1` lack, from those that stepped it.
result<live_takeover::unfinished_step> unfinished_step_of(const std::vector<stage_state>& states,
                                                          std::int64_t iteration, int pp) {
  live_takeover::unfinished_step u;
  u.iteration = iteration;
  const stage_state* stepped = nullptr;
  std::optional<std::uint64_t> epoch;
  for (std::size_t i = 0; i < states.size(); ++i) {
    const stage_state& s = states[i];
    if (*s.stepped == iteration) {
      if (stepped != nullptr && !same_place(stepped->place, s.place)) {
        return error{
            fmt::format("the stages that stepped iteration {} did not capture alike", iteration)};
      }
      stepped = stepped != nullptr ? stepped : &s;
      continue;
    }
    if (!s.reduced) {
      return error{
          fmt::format("stage replica {} holds nothing of iteration {}, which other stages stepped",
                      i, iteration)};
    }
    if (epoch && *epoch != s.epoch) {
      return error{
          fmt::format("the stages waiting for the Step of iteration {} are at "
                      "different epochs",
                      iteration)};
    }
    epoch = s.epoch;
    u.stages.push_back(i);
  }
  const auto plan = stepped->steps.find(iteration);
  if (plan == stepped->steps.end()) {
    return error{fmt::format("no stage keeps the step plan of iteration {}", iteration)};
  }
  u.epoch = *epoch;
  u.step = plan->second;
  u.place = stepped->place;
  for (const std::size_t i : u.stages) {
    std::vector<double> pop;
    for (std::size_t j = std::size_t(i) % std::size_t(pp); j < states.size();
         j += std::size_t(pp)) {
      if (*states[j].stepped == iteration) {
        pop = states[j].popularity;
        break;
      }
    }
    u.popularity.push_back(std::move(pop));
  }
  return u;
}

}  // namespace

result<live_takeover> plan_live_takeover(const std::vector<stage_state>& states,
                                         const resume_point& journal, int pp) {
  if (states.empty() || pp <= 0 || states.size() % std::size_t(pp) != 0) {
    return error{"not every stage answered"};
  }
  live_takeover t;
  std::int64_t lowest = 0, highest = 0;
  for (std::size_t i = 0; i < states.size(); ++i) {
    const stage_state& s = states[i];
    if (!s.stepped) {
      return error{fmt::format("stage {} replica {} was rebuilt and has not iterated since",
                               i % std::size_t(pp), i / std::size_t(pp))};
    }
    lowest = i == 0 ? *s.stepped : std::min(lowest, *s.stepped);
    highest = i == 0 ? *s.stepped : std::max(highest, *s.stepped);
    t.epoch = std::max(t.epoch, s.epoch);
    t.wiring = std::max(t.wiring, s.wiring);
    t.next_window = std::max(t.next_window, s.place.window + 1);
    t.w_sparse = std::max(t.w_sparse, s.place.w_sparse);
    t.dropped = t.dropped || s.dropped;
    if (s.persisted && (!t.persisted || s.persisted->first > t.persisted->first)) {
      t.persisted = s.persisted;
    }
  }
  if (highest - lowest > 1) {
    return error{fmt::format("the stages stepped iterations {} to {}", lowest, highest)};
  }
  if (highest == lowest) {
    // Nothing of the next iteration was stepped: reduced gradients of it go too.
    for (std::size_t i = 0; i < states.size(); ++i) {
      if (states[i].reduced) t.drop.emplace_back(i, states[i].epoch);
    }
    t.dropped = t.dropped || !t.drop.empty();
  } else {
    auto u = unfinished_step_of(states, highest, pp);
    if (!u.ok()) return u.err();
    t.unfinished = std::move(*u);
  }
  t.target = highest + 1;
  if (t.target < journal.target_iteration) {
    return error{fmt::format("the stages stepped up to iteration {}, before the journal's {}",
                             highest, journal.target_iteration)};
  }
  // The steps from the journal's, then every stage's: one plan per iteration, the same
  // wherever it is kept (every stage was sent the same Step).
  t.steps = journal.steps;
  for (const stage_state& s : states) {
    for (const auto& [it, p] : s.steps) {
      if (it >= t.target) return error{fmt::format("a stage keeps a step of iteration {}", it)};
      const auto [at, added] = t.steps.emplace(it, p);
      if (!added && !(at->second == p)) {
        return error{fmt::format("the stages keep different step plans for iteration {}", it)};
      }
    }
  }
  // A persisted window older than the journal's is not the newest: the journal's is.
  if (t.persisted && t.persisted->first < journal.window) t.persisted.reset();
  // A replay from the journal's oldest window (or the persisted one) needs every step up to
  // target - 1.
  std::int64_t from =
      journal.windows.empty() ? journal.target_iteration : journal.windows.begin()->second;
  if (t.persisted) from = std::min(from, t.persisted->second);
  for (std::int64_t it = std::max<std::int64_t>(from, 0); it < t.target; ++it) {
    if (!t.steps.contains(it)) {
      return error{fmt::format("no stage keeps the step plan of iteration {}", it)};
    }
  }
  // The loss scaler before target: the journal's, through the steps since (an applied step
  // is a finite one; loss_scaler::update is the whole of its history).
  t.scaler = journal.scaler;
  for (std::int64_t it = journal.target_iteration; it < t.target; ++it) {
    const planned_step& p = t.steps.at(it);
    if (t.scaler.enabled && p.loss_scale != t.scaler.scale) {
      return error{fmt::format("the loss scale of iteration {} does not follow the journal's", it)};
    }
    t.scaler.update(p.plan.apply);
  }
  t.next_window = std::max(t.next_window, journal.window + 1);
  if (t.w_sparse <= 0) t.w_sparse = journal.w_sparse;
  return t;
}

}  // namespace moevement::engine
