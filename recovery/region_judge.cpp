// Policy moevement's judge for silent corruption with no majority (docs/recovery.md "Silent
// data corruption"): an idle spare replays the suspect stage's whole group from the persisted
// window, with the logs of the healthy neighbours, up to the iteration the replicas disagreed
// after, and answers the replayed replica's operator digests. Nothing the bad replica computed
// left it (the checks run before the next forward), so the replay gives the state every copy
// should hold; the head keeps the copy that equals it. dp = 1's shadow checks replay the same
// way from the window shadow_windows names.
#include <fmt/format.h>

#include "recovery/region_recovery.hpp"

namespace moevement::recovery {

namespace {

using actors::actor_ref;
using asio::awaitable;

// A replay of a stage's group may take minutes at a large model's scale; the spare's loss
// ends the ask at once.
constexpr auto judge_timeout = std::chrono::minutes(30);

}  // namespace

std::optional<shadow_windows::window_at> region_recovery::persisted_at() const {
  if (!windows_.persisted()) return std::nullopt;
  return shadow_windows::window_at{*windows_.persisted(), windows_.persisted_first()};
}

awaitable<engine::replay_judgement> region_recovery::judge(int stage, int replica,
                                                           std::int64_t target) {
  co_return co_await replay_on_spare(stage, replica, target, persisted_at());
}

awaitable<engine::replay_judgement> region_recovery::shadow_judge(int stage, std::int64_t target) {
  if (!job_.job().shadow_full) {  // checkpoint.shadow_coverage "recent"
    auto out = co_await judge(stage, 0, target);
    out.vouched = false;
    co_return out;
  }
  auto& shadow = windows_.shadow();
  const auto from = shadow.base(persisted_at());
  auto out = co_await replay_on_spare(stage, 0, target, from);
  out.vouched = shadow.vouched();
  co_return out;
}

awaitable<engine::replay_judgement> region_recovery::replay_on_spare(
    int stage, int replica, std::int64_t target, std::optional<shadow_windows::window_at> from) {
  engine::replay_judgement out;
  const auto& workers = job_.workers();
  actor_ref agent;
  for (const auto& [n, w] : workers) {
    if (w.stage < 0 && w.agent.valid() && !involves(n)) {
      agent = w.agent;
      out.spare = n;
      break;
    }
  }
  if (!agent.valid()) {
    out.error = "no idle spare worker to replay it on (raise cluster.spares)";
    co_return out;
  }
  std::vector<actor_ref> holders;
  for (const auto& [n, w] : workers) {
    if (w.replicator.valid()) holders.push_back(w.replicator);
  }
  const bool has_window = from.has_value();
  const std::uint64_t window = has_window ? from->window : 0;
  const std::int64_t first = has_window ? from->first : 0;
  out.first_iteration = first;
  region r;
  r.first = r.last = stage;
  const actor_ref me = job_.actor().self();
  auto fill = [&](engine::wire::Judge::Builder j) {
    auto b = j.initRestore();
    b.setStage(stage);
    b.setReplica(replica);
    b.setFirstStage(stage);
    b.setLastStage(stage);
    b.setTargetIteration(target);
    b.setHasWindow(has_window);
    b.setWindow(window);
    b.setFirstIteration(first);
    b.setWSparse(has_window ? windows_.w_of(window) : windows_.w_sparse());
    b.setHostShare(1);
    b.setJudge(true);
    write_sources(b, r, holders, true, first);
    write_steps(b, first, target);
    actors::write_ref(b.initCoordinator(), me);
  };
  // The persisted window stays while the spare pulls it: a newer one persisting meanwhile
  // would have its holders drop this one's copies.
  judging_ = true;
  const auto t0 = std::chrono::steady_clock::now();
  auto res = co_await job_.actor().ask<engine::wire::Judge, engine::wire::Judged>(
      agent, judge_timeout, fill);
  judging_ = false;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!job_.finished()) windows_.persist_held();
  if (!res.ok()) {
    out.error =
        fmt::format("the spare (worker {}) did not answer: {}", out.spare, res.err().message);
    co_return out;
  }
  if (const std::string e = res->get().getError(); !e.empty()) {
    out.error = fmt::format("the spare (worker {}) could not replay it: {}", out.spare, e);
    co_return out;
  }
  for (const auto d : res->get().getDigests()) out.digests.push_back(d);
  co_return out;
}

}  // namespace moevement::recovery
