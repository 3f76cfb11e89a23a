// The coordinator's silent-corruption checks (docs/recovery.md "Silent data corruption"). Every
// replica of a stage holds the same bits after every step. With dp > 1 each stage replica
// digests its compute weights after every step (what the next forward reads: a corrupted bit
// is caught before it leaves the replica in a boundary tensor or a gradient) and its whole
// state every checkpoint.verify_every-th step (a bit the compute weights round away). Once
// every stage stepped, and before the next iteration starts, the head compares each stage's
// replicas (engine/replica_check.hpp). A replica outside a strict majority is fenced (its
// worker declared lost and ended) and rebuilt through the recovery tree like any lost worker,
// from the copies of a replica that agreed; nothing it computed reached another replica, so
// training goes on with no lost work and the same bits.
#include <fmt/format.h>
#include <fmt/ranges.h>

#include "engine/coordinator.hpp"

namespace moevement::engine {

namespace {

const char* verify_name(wire::Verify v) {
  switch (v) {
    case wire::Verify::WEIGHTS:
      return "weights";
    case wire::Verify::STATE:
      return "state";
    default:
      return "none";
  }
}

}  // namespace

wire::Verify coordinator::verify_for(std::int64_t it) const {
  if (job_.verify_every <= 0 || job_.dp < 2) return wire::Verify::NONE;
  return it % job_.verify_every == 0 ? wire::Verify::STATE : wire::Verify::WEIGHTS;
}

asio::awaitable<std::vector<std::string>> coordinator::operator_names(int s, int d) {
  std::vector<std::string> names;
  auto r = co_await ask<wire::DigestsQuery, wire::Digests>(stage_ref(s, d), ask_timeout,
                                                           [](wire::DigestsQuery::Builder) {});
  if (r.ok()) {
    for (auto n : r->get().getNames()) names.emplace_back(n.cStr());
  }
  co_return names;
}

asio::awaitable<bool> coordinator::verify_replicas() {
  const wire::Verify what = std::exchange(verify_, wire::Verify::NONE);
  if (what == wire::Verify::NONE || finished_) co_return false;
  const auto found = compare_replicas(job_.pp, job_.dp, job_.ep, verify_reports_);
  if (found.empty()) co_return false;
  const std::int64_t it = iteration_ - 1;  // the iteration just stepped
  const auto bad = bad_replicas(found);
  std::vector<std::string> lines;
  for (const auto& d : found) {
    const auto names = co_await operator_names(d.stage, d.replicas.front());
    if (finished_) co_return true;
    lines.push_back(describe(d, names));
    if (log_ != nullptr) {
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "sdc_suspected")
                      .add("iteration", it)
                      .add("digest", verify_name(what))
                      .add("stage", d.stage)
                      .add("operator", std::int64_t(d.op))
                      .add("operator_name", d.op < names.size() ? names[d.op] : "")
                      .add("replicas", fmt::format("{}", fmt::join(d.replicas, ",")))
                      .add("outside_majority", fmt::format("{}", fmt::join(d.bad, ",")))
                      .add("time_s", log_->seconds()));
    }
  }
  notice(
      fmt::format("silent data corruption suspected after iteration {} (the {} digests of "
                  "a stage's replicas differ): {}",
                  it, verify_name(what), fmt::join(lines, "; ")));
  if (bad.empty()) {
    fail(fmt::format(
        "silent data corruption after iteration {}: the copies of an operator disagree with no "
        "majority among them ({}); telling the bad copy from the good one takes a replay, "
        "which this version does not run, so the job stops here rather than train on either "
        "(with parallel.dp >= 3 the majority names the bad replica and it is replaced)",
        it, fmt::join(lines, "; ")));
    co_return true;
  }
  // The replicas to fence, and for each one that agreed (same stage and shard) whose copies
  // its rebuild takes.
  std::vector<worker_info> fenced;
  for (const auto& [s, d] : bad) {
    int from = -1;
    for (int o = 0; o < job_.dp && from < 0; ++o) {
      const bool also_bad = std::find(bad.begin(), bad.end(), std::pair{s, o}) != bad.end();
      if (o != d && !also_bad && o % std::max(job_.ep, 1) == d % std::max(job_.ep, 1)) from = o;
    }
    const transport::node_id n = stage_ref(s, d).node;
    const auto w = workers_.find(n);
    if (w == workers_.end()) continue;
    if (log_ != nullptr) {
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "sdc_judged")
                      .add("how", "majority")
                      .add("iteration", it)
                      .add("stage", s)
                      .add("replica", d)
                      .add("node", std::int64_t{n})
                      .add("pid", w->second.pid)
                      .add("copies_from", from)
                      .add("time_s", log_->seconds()));
    }
    if (!recovery_ || !recovery_->corrupted(s, d, from, it)) {
      fail(fmt::format(
          "silent data corruption after iteration {}: stage {} replica {} (worker {}, pid {}) "
          "differs from the majority of its replicas; checkpoint.policy = {} cannot rebuild it, "
          "so the job stops (policy moevement replaces it)",
          it, s, d, n, w->second.pid, policy_name(job_.policy)));
      co_return true;
    }
    notice(fmt::format(
        "stage {} replica {} (worker {}, pid {}) holds corrupted state after iteration {}: its "
        "worker is fenced and the stage rebuilt on a spare{}",
        s, d, n, w->second.pid, it,
        from >= 0 ? fmt::format(" from replica {}'s snapshot copies", from) : ""));
    fenced.push_back(w->second);
  }
  sdc_found_ += std::int64_t(fenced.size());
  // Declared lost here, with the verdict to every member: nothing from it is read again, and
  // the worker stops on hearing it (the launcher ends the process).
  for (const auto& w : fenced)
    system().lose_member(w.node, "fenced it: its state was corrupted (silent data corruption)");
  phase_ = phase::paused;
  for (const auto& w : fenced) {
    co_await worker_lost(w.node, "was fenced for silent data corruption");
    if (finished_) break;
  }
  co_return true;
}

}  // namespace moevement::engine
