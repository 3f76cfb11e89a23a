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

#include <algorithm>
#include <map>
#include <set>

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
  // The last step too checks the whole state (taken after it, where the weights' digests are
  // taken during it): no later check would find what it left, and the final state_hash is
  // read from one replica.
  const bool last = it + 1 == job_.train.iterations;
  return it % job_.verify_every == 0 || last ? wire::Verify::STATE : wire::Verify::WEIGHTS;
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
  const std::int64_t it = iteration_ - 1;  // the iteration just stepped
  if (found.empty()) {
    // Every copy alike: a rollback past corruption found later may go back to here (only
    // where every stage replica reported its digests: none left out of the comparison).
    const bool every = std::all_of(verify_reports_.begin(), verify_reports_.end(),
                                   [](const replica_report& r) { return !r.digests.empty(); });
    if (what == wire::Verify::STATE && every) state_agreed_ = it;
    co_return false;
  }
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
  const char* how = "majority";
  auto bad = bad_replicas(found);
  if (bad.empty()) {
    // No majority (two copies, or a tie): a replay on a spare judges.
    std::string why;
    auto judged = co_await judge_by_replay(found, it, why);
    if (!judged) {
      if (!why.empty()) co_await no_verdict(it, why);
      co_return true;
    }
    bad = std::move(*judged);
    how = "replay";
  }
  co_await fence(bad, how, it);
  co_return true;
}

asio::awaitable<void> coordinator::no_verdict(std::int64_t it, const std::string& why) {
  const std::string message = fmt::format(
      "silent data corruption after iteration {}: the copies of an operator disagree with no "
      "majority among them, and {}",
      it, why);
  // Every state before the last whole-state check that agreed is clean: the job goes back to
  // a window captured before it, every replica restored from its files, and trains on.
  if (recovery_ && state_agreed_ >= 0 && recovery_->can_roll_back_before(state_agreed_)) {
    if (log_ != nullptr) {
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "sdc_judged")
                      .add("how", "none")
                      .add("iteration", it)
                      .add("clean_before", state_agreed_)
                      .add("time_s", log_->seconds()));
    }
    phase_ = phase::paused;
    // (The result bound first: g++ 12 miscompiles a co_await inside a condition.)
    const bool rolling = co_await recovery_->roll_back_before(state_agreed_, message);
    if (rolling) {
      if (!finished_) co_await recovery_->roll_back_now();
      co_return;
    }
  }
  if (finished_) co_return;
  fail(fmt::format(
      "{}; the job stops here rather than train on either copy: no durable window captured "
      "before the last whole-state check that agreed ({}) is on disk to roll back to. A whole-"
      "state check every checkpoint.verify_every = {} iterations marks how far back is clean "
      "(a smaller one finds it sooner), and with parallel.dp >= 3 a majority names the bad "
      "replica without a replay",
      message,
      state_agreed_ >= 0 ? fmt::format("after iteration {}", state_agreed_)
                         : std::string("none has run yet"),
      job_.verify_every));
}

asio::awaitable<std::optional<std::vector<std::pair<int, int>>>> coordinator::judge_by_replay(
    const std::vector<divergence>& found, std::int64_t it, std::string& why_none) {
  auto stop = [&](const std::string& why) -> std::optional<std::vector<std::pair<int, int>>> {
    why_none = why;
    return std::nullopt;
  };
  if (!recovery_) {
    co_return stop(
        fmt::format("checkpoint.policy = {} keeps no windows to replay", policy_name(job_.policy)));
  }
  const int ep = std::max(job_.ep, 1);
  // One replay per stage and shard (an expert's copies are of one shard; a non-expert is at
  // the same place in every shard's list), of the first suspect's replica.
  std::map<std::pair<int, int>, replay_judgement> replays;
  std::map<std::pair<int, int>, std::vector<std::uint64_t>> copies;  // (stage, replica) -> now
  std::set<std::pair<int, int>> bad;
  std::set<std::pair<int, int>> lost_replicas;  // their workers died while they were judged
  for (const auto& d : found) {
    if (!d.bad.empty()) {
      for (int r : d.bad) bad.emplace(d.stage, r);
      continue;
    }
    const int role = d.replicas.front();
    const std::pair<int, int> key{d.stage, role % ep};
    if (!replays.contains(key)) {
      notice(
          fmt::format("judging stage {} by replay: a spare replays its group from the "
                      "persisted window to iteration {}",
                      d.stage, iteration_));
      replays[key] = co_await recovery_->judge(d.stage, role, iteration_);
      if (finished_) co_return std::nullopt;
    }
    const replay_judgement& j = replays[key];
    if (!j.error.empty()) co_return stop("the judge's replay gave no verdict: " + j.error);
    std::vector<int> good, lost, differ;  // this suspect's
    for (int r : d.replicas) {
      if (lost_replicas.contains({d.stage, r})) {
        lost.push_back(r);
        continue;
      }
      if (!copies.contains({d.stage, r})) {
        auto q = co_await ask<wire::DigestsQuery, wire::Digests>(
            stage_ref(d.stage, r), ask_timeout, [](wire::DigestsQuery::Builder) {});
        if (finished_) co_return std::nullopt;
        if (!q.ok()) {
          // Its worker died meanwhile (its loss follows): the others are judged without it.
          const bool loss = co_await loss_follows();
          if (finished_) co_return std::nullopt;
          const transport::node_id node = stage_ref(d.stage, r).node;
          if (loss && !system().last_heard(node).has_value()) {
            lost_replicas.emplace(d.stage, r);
            lost.push_back(r);
            continue;
          }
          co_return stop(
              fmt::format("reading stage {} replica {} failed: {}", d.stage, r, q.err().message));
        }
        auto& v = copies[{d.stage, r}];
        for (const auto x : q->get().getValues()) v.push_back(x);
      }
      const auto& v = copies[{d.stage, r}];
      if (d.op < v.size() && d.op < j.digests.size() && v[d.op] == j.digests[d.op]) {
        good.push_back(r);
      } else {
        differ.push_back(r);
      }
    }
    if (log_ != nullptr) {
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "sdc_replayed")
                      .add("iteration", it)
                      .add("stage", d.stage)
                      .add("operator", std::int64_t(d.op))
                      .add("spare", std::int64_t{j.spare})
                      .add("seconds", j.seconds)
                      .add("agrees_with", fmt::format("{}", fmt::join(good, ",")))
                      .add("time_s", log_->seconds()));
    }
    if (good.empty() && differ.empty()) {  // every replica's worker died meanwhile
      co_return stop(
          fmt::format("every replica of stage {} was lost while it was judged", d.stage));
    }
    // (With a replica lost meanwhile, those still here that differ from the replay are the bad
    // ones: the lost one's rebuild takes copies of the window, which the replay read and found
    // alike on every replica.)
    if (good.empty() && lost.empty()) {
      co_return stop(fmt::format("the replay of stage {} on worker {} agrees with none of them",
                                 d.stage, j.spare));
    }
    for (int r : differ) bad.emplace(d.stage, r);
    // Every replica still here agrees with the replay: the one that differed is among the
    // lost, whose rebuild takes a good one's copies (a window persisted since may hold its bad
    // bits).
    if (differ.empty()) {
      for (int r : lost) bad.emplace(d.stage, r);
    }
  }
  co_return std::vector<std::pair<int, int>>(bad.begin(), bad.end());
}

asio::awaitable<void> coordinator::fence(const std::vector<std::pair<int, int>>& bad,
                                         const char* how, std::int64_t it, bool rolling_back) {
  // The replicas to fence, and for each one that agreed (same stage and shard) whose copies
  // its rebuild takes.
  const int ep = std::max(job_.ep, 1);
  std::vector<worker_info> fenced;
  for (const auto& [s, d] : bad) {
    int from = -1;
    for (int o = 0; o < job_.dp && from < 0; ++o) {
      const bool also_bad = std::find(bad.begin(), bad.end(), std::pair{s, o}) != bad.end();
      if (o != d && !also_bad && o % ep == d % ep) from = o;
    }
    if (rolling_back) from = -1;  // the rollback's windows precede the corruption
    const transport::node_id n = stage_ref(s, d).node;
    const auto w = workers_.find(n);
    if (w == workers_.end()) continue;
    if (log_ != nullptr) {
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "sdc_judged")
                      .add("how", how)
                      .add("iteration", it)
                      .add("stage", s)
                      .add("replica", d)
                      .add("node", std::int64_t{n})
                      .add("pid", w->second.pid)
                      .add("copies_from", from)
                      .add("time_s", log_->seconds()));
    }
    if (!recovery_ || (!rolling_back && !recovery_->corrupted(s, d, from, it))) {
      fail(fmt::format(
          "silent data corruption after iteration {}: stage {} replica {} (worker {}, pid {}) "
          "differs from the majority of its replicas; checkpoint.policy = {} cannot rebuild it, "
          "so the job stops (policy moevement replaces it)",
          it, s, d, n, w->second.pid, policy_name(job_.policy)));
      co_return;
    }
    notice(fmt::format(
        "stage {} replica {} (worker {}, pid {}) holds corrupted state after iteration {} "
        "(judged by {}): its worker is fenced and the stage rebuilt on a spare{}",
        s, d, n, w->second.pid, it, how,
        from >= 0 ? fmt::format(" from replica {}'s snapshot copies", from) : ""));
    fenced.push_back(w->second);
  }
  sdc_found_ += std::int64_t(fenced.size());
  if (fenced.empty()) {  // none of them is a worker the job still counts (lost meanwhile)
    co_await after_iteration();
    co_return;
  }
  // Declared lost here, with the verdict to every member: nothing from it is read again, and
  // the worker stops on hearing it (the launcher ends the process).
  for (const auto& w : fenced) {
    system().lose_member(w.node, "fenced it: its state was corrupted (silent data corruption)");
  }
  phase_ = phase::paused;
  for (const auto& w : fenced) {
    co_await worker_lost(w.node, "was fenced for silent data corruption");
    if (finished_) break;
  }
}

namespace {

// The operators whose digests differ from a replay's (empty: it agrees).
std::vector<std::string> differing(const capnp::List<std::uint64_t>::Reader& live,
                                   const capnp::List<capnp::Text>::Reader& names,
                                   const std::vector<std::uint64_t>& replayed) {
  std::vector<std::string> differ;
  for (unsigned k = 0; k < live.size(); ++k) {
    if (k >= replayed.size() || live[k] != replayed[k]) {
      differ.push_back(k < names.size() ? std::string(names[k].cStr()) : std::to_string(k));
    }
  }
  if (live.size() != replayed.size() && differ.empty()) differ.push_back("(their number)");
  return differ;
}

}  // namespace

asio::awaitable<bool> coordinator::shadow_check() {
  const int every = job_.shadow_every;
  if (every <= 0 || !recovery_ || finished_ || iteration_ % every != 0) co_return false;
  const std::int64_t it = iteration_ - 1;  // the iteration just stepped
  const int s = int((iteration_ / every - 1) % std::int64_t(job_.pp));  // each stage in turn
  const replay_judgement j = co_await recovery_->shadow_judge(s, iteration_);
  if (finished_) co_return true;
  // `skipped`: no verdict this time (no idle spare, a stage that did not answer); `agrees` is
  // then false without any difference found. `from`: the replay's first iteration, `vouched`
  // false where it began from a window taken on trust (after a recovery).
  auto record = [&](bool agrees, const std::string& error) {
    if (log_ == nullptr) return;
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "shadow_checked")
                    .add("iteration", it)
                    .add("stage", s)
                    .add("spare", std::int64_t{j.spare})
                    .add("seconds", j.seconds)
                    .add("from", j.first_iteration)
                    .add("vouched", j.vouched)
                    .add("agrees", agrees)
                    .add("skipped", !error.empty())
                    .add("error", error)
                    .add("time_s", log_->seconds()));
  };
  if (!j.error.empty()) {  // no verdict this time (no idle spare, ...): training goes on
    recovery_->shadow_skipped();
    record(false, j.error);
    notice(fmt::format("shadow replay of stage {} after iteration {}: no verdict ({})", s, it,
                       j.error));
    co_return false;
  }
  auto q = co_await ask<wire::DigestsQuery, wire::Digests>(stage_ref(s, 0), ask_timeout,
                                                           [](wire::DigestsQuery::Builder) {});
  if (finished_) co_return true;
  if (!q.ok()) {
    recovery_->shadow_skipped();
    record(false, q.err().message);
    co_return false;  // a stage that does not answer is the failure detector's to find
  }
  const auto differ = differing(q->get().getValues(), q->get().getNames(), j.digests);
  record(differ.empty(), "");
  if (differ.empty()) {
    recovery_->shadow_agreed(s, it);
    co_return false;
  }
  // The corruption came after the replayed window's capture of the operator (one before it
  // would be in the replay too): every state before that window's first iteration is clean,
  // and with full coverage every state up to the stage's last check that agreed. There, a
  // replay from the persisted window that differs too narrows it the same way.
  std::int64_t clean_before = std::max(j.first_iteration, recovery_->shadow_clean_before(s));
  if (job_.shadow_full) {
    const replay_judgement newest = co_await recovery_->judge(s, 0, iteration_);
    if (finished_) co_return true;
    if (newest.error.empty() && newest.first_iteration > clean_before &&
        !differing(q->get().getValues(), q->get().getNames(), newest.digests).empty()) {
      clean_before = newest.first_iteration;
    }
  }
  co_return co_await shadow_found(s, it, j.spare, differ, clean_before);
}

asio::awaitable<bool> coordinator::shadow_found(int s, std::int64_t it, transport::node_id spare,
                                                const std::vector<std::string>& differ,
                                                std::int64_t clean_before) {
  const transport::node_id n = stage_ref(s, 0).node;
  const auto w = workers_.find(n);
  const int pid = w == workers_.end() ? 0 : w->second.pid;
  if (log_ != nullptr) {
    log_->write(json_record{}
                    .add("kind", "event")
                    .add("event", "sdc_suspected")
                    .add("iteration", it)
                    .add("digest", "shadow")
                    .add("stage", s)
                    .add("operator_name", fmt::format("{}", fmt::join(differ, ",")))
                    .add("replicas", "0")
                    .add("spare", std::int64_t{spare})
                    .add("clean_before", clean_before)
                    .add("time_s", log_->seconds()));
  }
  const std::string found = fmt::format(
      "silent data corruption found by a shadow replay after iteration {}: stage {} replica 0 "
      "(worker {}, pid {}) differs from its replay on spare worker {} in {}; with one copy "
      "(parallel.dp = 1) what it sent since may have spread to every stage",
      it, s, n, pid, spare, fmt::join(differ, ", "));
  // The stage's worker is fenced and the whole job goes back to before the corruption.
  const std::string why = fmt::format(
      "silent data corruption of stage {} (found by a shadow replay after iteration {})", s, it);
  const bool rolling = co_await recovery_->roll_back_before(clean_before, why);
  if (rolling) {
    notice(found);
    const std::vector<std::pair<int, int>> bad{{s, 0}};
    if (!finished_) co_await fence(bad, "shadow", it, true);
    // Its worker was gone already (its loss is queued): the rollback starts with no fence.
    if (!finished_ && !recovery_->active()) co_await recovery_->roll_back_now();
    co_return true;
  }
  if (finished_) co_return true;
  fail(fmt::format(
      "{}, so the job stops here rather than train on: no durable window captured before "
      "iteration {} is known to roll back to (the durable tier keeps checkpoint.keep windows; "
      "with parallel.dp >= 2 the replicas check each other every step)",
      found, clean_before));
  co_return true;
}

asio::awaitable<void> coordinator::replay_mismatch_found(worker_info w, int stage, int replica,
                                                         std::int64_t at,
                                                         const std::string& message) {
  // What that replica sent in iteration `at` reached every stage since: every state before
  // that iteration's step is clean. Its worker computed it: fenced, the job rolled back.
  bool rolling = false;
  // (`at` is the wire's: a recovery replays iterations before the one training stopped at.)
  if (recovery_ && at >= 0 && at < iteration_) {
    rolling = co_await recovery_->roll_back_before(at, message);
  }
  if (rolling) {
    if (finished_) co_return;
    if (log_ != nullptr) {
      log_->write(json_record{}
                      .add("kind", "event")
                      .add("event", "sdc_judged")
                      .add("how", "replay_log")
                      .add("iteration", at)
                      .add("stage", stage)
                      .add("replica", replica)
                      .add("node", std::int64_t{w.node})
                      .add("pid", w.pid)
                      .add("copies_from", -1)
                      .add("time_s", log_->seconds()));
    }
    notice(fmt::format(
        "stage {} replica {} (worker {}, pid {}) sent corrupted bits in iteration {}: its worker "
        "is fenced",
        stage, replica, w.node, w.pid, at));
    ++sdc_found_;
    system().lose_member(w.node, "fenced it: it sent corrupted bits (silent data corruption)");
    co_await worker_lost(w.node, "was fenced for silent data corruption");
    co_return;
  }
  if (finished_) co_return;
  fail(message +
       "; the job stops rather than train on from it (no durable window captured before it is "
       "known to roll back to)");
}

}  // namespace moevement::engine
