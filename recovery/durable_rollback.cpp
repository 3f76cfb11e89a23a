// The durable tier on the head (docs/recovery.md "Fallback to the durable tier", "Resuming a
// killed job"): the whole-job rollback when every copy of a needed slot is gone or a region
// escalated (one region of every role, under a supervisor of its own, restored from the
// newest window every role verifies on disk), and `moevement launch --resume`, which is that
// rollback with no loss behind it: every stage restores from the newest durable window the
// journal knows, replays to where training was, and the job goes on.
#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <set>
#include <utility>

#include "actors/gather.hpp"
#include "recovery/region_recovery.hpp"
#include "recovery/resume_journal.hpp"

namespace moevement::recovery {

using actors::actor_ref;
using asio::awaitable;

namespace {

// How long a rollback waits for a durable write in flight that it would roll back to.
constexpr auto durable_write_wait = std::chrono::seconds(120);

// Which roles lack the newest window the journal knows (for a resume that found none whole):
// "; window W is missing at stage S replica D, ..." (their files offer no such verified
// window), or nothing.
std::string lacking_newest(const std::vector<std::pair<int, int>>& roles,
                           const std::vector<std::set<std::uint64_t>>& offers,
                           const std::map<std::uint64_t, std::int64_t>& journal) {
  if (journal.empty()) return "";
  const std::uint64_t newest = journal.rbegin()->first;
  std::string missing;
  for (std::size_t i = 0; i < roles.size() && i < offers.size(); ++i) {
    if (offers[i].contains(newest)) continue;
    missing += fmt::format("{}stage {} replica {}", missing.empty() ? "" : ", ", roles[i].first,
                           roles[i].second);
  }
  if (missing.empty()) return "";
  return fmt::format(
      "; the newest, window {}, is missing or unverified at {} (checkpoint.dir's "
      "stage-S-replica-D directories)",
      newest, missing);
}

// The roles whose durable windows a rollback asks for, each of a member's replicator: every
// member's own, or, for a resume at another layout (pp, dp of the windows), the windows'
// roles spread over the members (the directory is shared).
template <class Member>
std::vector<std::pair<int, int>> durable_roles(const std::vector<Member>& members, int pp, int dp) {
  std::vector<std::pair<int, int>> roles;
  if (pp == 0) {
    for (const Member& m : members) roles.emplace_back(m.lost.stage, m.lost.replica);
    return roles;
  }
  for (int d = 0; d < dp; ++d) {
    for (int s = 0; s < pp; ++s) roles.emplace_back(s, d);
  }
  return roles;
}

}  // namespace

region_recovery::region region_recovery::whole_pipeline() {
  region all;
  all.id = ++region_ids_;
  all.first = 0;
  all.last = job_.job().pp - 1;
  for (const auto& [n, w] : job_.workers()) {
    if (w.stage < 0) continue;
    member m;
    m.lost = w;
    m.spare = n;
    all.members.push_back(m);
  }
  return all;
}

awaitable<void> region_recovery::resume(const engine::resume_point& p) {
  if (!windows_.durable() || !p.windows.contains(p.window)) {
    job_.fail("--resume needs checkpoint.policy = \"moevement\" with checkpoint.durable = true");
    co_return;
  }
  state_.emplace();
  state_->begun = true;
  state_->detected = sclock::now();
  state_->resume = true;
  resume_at(p);
  job_.enter_recovery();
  // One region, the whole pipeline; every role is restored by the worker given it.
  state_->regions.push_back(whole_pipeline());
  state_->durable = true;
  state_->durable_why = "resuming the job";
  // Its supervisor asks for the region's first generation (region_restart: the durable
  // window chosen, the Restores sent).
  supervise(state_->regions.front());
  co_return;
}

void region_recovery::resume_at(const engine::resume_point& p) {
  const auto& job = job_.job();
  // The windows as they were at the journal's point: the window size, the steps a replay
  // applies and the windows on disk.
  windows_.resume_from(p);
  state_->target = p.target_iteration;
  state_->resume_window = p.window;
  state_->window_pp = state_->window_dp = state_->window_ep = 0;
  const int ep = std::max(job.ep, 1);
  if (p.pp != job.pp || p.dp != job.dp || p.ep != ep) {
    state_->window_pp = p.pp;
    state_->window_dp = p.dp;
    state_->window_ep = p.ep;
    const auto layout = [](int pp, int dp, int ep) {
      return ep > 1 ? fmt::format("pp={} dp={} ep={}", pp, dp, ep)
                    : fmt::format("pp={} dp={}", pp, dp);
    };
    job_.notice(fmt::format(
        "resuming at another layout: the windows are of {}, this job runs {}{}",
        layout(p.pp, p.dp, p.ep), layout(job.pp, job.dp, ep),
        p.dp == job.dp ? std::string(" (the pipeline depth and the EP degree change no bit)")
                       : fmt::format("; the global batch changes from {} to {} micro-batches per "
                                     "iteration from iteration {} on",
                                     p.dp * job.train.micro_batches,
                                     job.dp * job.train.micro_batches, p.target_iteration)));
  }
}

bool region_recovery::taken_over(const engine::resume_point& p, const engine::live_takeover& t) {
  if (!windows_.durable() || !p.windows.contains(p.window)) return false;
  windows_.take_over(p, t);
  return true;
}

awaitable<void> region_recovery::settle_durable_writes() {
  if (!windows_.durable() || !windows_.durable_in_flight()) co_return;
  // A DurableQuery drains its worker's writes in flight first (replicator::durable_query).
  std::vector<actor_ref> holders;
  std::vector<std::pair<int, int>> roles;
  for (const auto& [n, w] : job_.workers()) {
    if (w.stage < 0 || !w.replicator.valid()) continue;
    holders.push_back(w.replicator);
    roles.emplace_back(w.stage, w.replica);
  }
  auto fill = [&](std::size_t i, engine::wire::DurableQuery::Builder b) {
    b.setStage(roles[i].first);
    b.setReplica(roles[i].second);
  };
  (void)co_await actors::ask_all<engine::wire::DurableQuery, engine::wire::DurableOffer>(
      job_.actor(), holders, durable_write_wait, fill);
}

awaitable<bool> region_recovery::roll_back_before(std::int64_t clean_before, std::string why) {
  if (!can_roll_back_before(clean_before)) co_return false;
  // The window this goes back to may still be being written, by the worker about to be fenced
  // among others (a loaded host starves the writers): every live worker finishes its writes
  // first, or a fenced one's would die with it.
  co_await settle_durable_writes();
  if (job_.finished()) co_return false;
  clean_ = clean_rollback{clean_before, why};
  // Found by a recovery's replay: that recovery becomes the rollback. Otherwise the next one
  // (the fence's loss, or roll_back_now) starts it (recover()).
  if (state_ && state_->begun) co_await start_durable_rollback(std::move(why));
  co_return true;
}

awaitable<void> region_recovery::roll_back_now() {
  if (!state_) {
    state_.emplace();
    state_->detected = sclock::now();
  }
  co_await recover();
}

awaitable<void> region_recovery::start_durable_rollback(std::string why) {
  if (!state_ || state_->durable || job_.finished()) co_return;
  if (clean_) {
    // Past silent corruption: back to before it, training goes on from there.
    state_->target = std::min(state_->target, clean_->before);
    job_.notice(
        fmt::format("{}: the whole job rolls back to the newest durable window captured before "
                    "iteration {}, replays to it and trains on from there",
                    why, clean_->before));
  } else {
    job_.notice(fmt::format("{}: falling back to the durable tier, the whole job rolls back", why));
  }
  // One region: the whole pipeline, every role, under a supervisor of its own (the regions'
  // go). Lost roles keep the spare they have; every other role is restored by the worker that
  // holds it (survivors, and spares that rebuilt another region).
  stop_supervisors();
  region all;
  all.id = ++region_ids_;
  all.first = 0;
  all.last = job_.job().pp - 1;
  std::map<std::pair<int, int>, member> roles;
  for (region& r : state_->regions) {
    for (member& m : r.members) roles[{m.lost.stage, m.lost.replica}] = m;
    all.restarts = std::max(all.restarts, r.restarts + (r.generation != 0 ? 1 : 0));
    all.started = r.started;
  }
  for (const worker_info& w : state_->pending) {  // losses not placed yet: a spare each
    if (w.stage >= 0) roles[{w.stage, w.replica}] = member{w};
  }
  state_->pending.clear();
  for (const auto& [n, w] : job_.workers()) {
    if (w.stage < 0 || roles.contains({w.stage, w.replica})) continue;
    member m;
    m.lost = w;
    m.spare = n;
    roles[{w.stage, w.replica}] = m;
  }
  for (auto& [role, m] : roles) all.members.push_back(m);
  state_->regions.clear();
  state_->regions.push_back(std::move(all));
  state_->durable = true;
  state_->durable_why = std::move(why);
  supervise(state_->regions.front());
}

awaitable<bool> region_recovery::choose_durable_window(region& r) {
  const std::int64_t target = state_->target;
  const std::string why = state_->durable_why;
  const auto& workers = job_.worker_roles();
  const std::uint64_t id = r.id;
  // The newest window every role has complete and verified on disk. A role whose worker is
  // lost meanwhile gets a spare, and everyone is asked again.
  std::uint64_t window = 0;
  bool found = false;
  std::vector<std::string> rejected;
  std::vector<std::set<std::uint64_t>> offers;  // each role's verified windows
  std::vector<std::pair<int, int>> roles;
  // A window that would do whose write is still in flight (a loaded host starves the writers):
  // asked again until it is whole on every stage, up to durable_write_wait.
  const auto wait_until = std::chrono::steady_clock::now() + durable_write_wait;
  bool waiting = false;
  for (bool ask_again = true; ask_again;) {
    ask_again = false;
    region* reg = region_by_id(id);
    if (reg == nullptr) co_return false;
    for (member& m : reg->members) {
      if (m.spare != 0 && !workers.contains(m.spare)) m.spare = 0;
    }
    if (!assign_spares(*reg)) co_return false;
    const std::vector<member> members = reg->members;
    roles = durable_roles(members, state_->window_pp, state_->window_dp);
    const offers_asked asked = co_await durable_offers(members, roles, offers, rejected);
    if (asked == offers_asked::failed) co_return false;
    ask_again = asked == offers_asked::again;
    if (ask_again) continue;
    std::optional<std::uint64_t> unwritten;  // a window that would do, its write in flight
    for (const auto& [w, first] : windows_.durable_windows()) {  // ascending: the newest wins
      if (first > target || !windows_.persisted() || w > *windows_.persisted()) continue;
      if (clean_ && !windows_.clean(w, first, clean_->before)) continue;
      if (auto from = serving_files(roles, offers, w, first)) {
        window = w;
        found = true;
        state_->durable_from = std::move(*from);
      } else if (windows_.durable_in_flight() == w) {
        unwritten = w;
      }
    }
    // (Only while every role's own worker lives: a lost one's write never ends.)
    const bool writers_live = std::all_of(members.begin(), members.end(),
                                          [](const member& m) { return m.spare == m.lost.node; });
    if (unwritten && writers_live && (!found || *unwritten > window) &&
        std::chrono::steady_clock::now() < wait_until) {
      if (!std::exchange(waiting, true)) {
        job_.notice(
            fmt::format("durable window {} is still being written: the rollback waits "
                        "for it",
                        *unwritten));
      }
      co_await job_.actor().system().sleep_for(std::chrono::milliseconds(250));
      if (job_.finished() || !state_) co_return false;
      found = false;
      ask_again = true;
    }
  }
  job_.report_rejected("durable_rejected", "durable window", rejected);
  if (!found && state_->resume) {
    // What the newest journal lacks is what the job says if no journal before it serves.
    if (state_->resume_failure.empty()) {
      state_->resume_failure = fmt::format(
          "nothing to resume: no durable window the journal knows is complete and verified on "
          "every stage ({} rejected{}){}",
          rejected.size(), rejected.empty() ? "" : ", above",
          lacking_newest(roles, offers, windows_.durable_windows()));
    }
    // The journal before it has windows of its own (after a resume at another layout the
    // newest lists only the windows written at the new one).
    std::vector<std::string> skipped;  // older journals that do not verify
    auto older = resume_journal(job_.job()).load(&skipped, state_->resume_window);
    for (const auto& why : skipped) job_.notice("--resume: " + why);
    if (older.ok() && older->target_iteration <= job_.job().train.iterations) {
      job_.notice(fmt::format(
          "no window journal {} lists is complete and verified on every stage: going back to "
          "the journal before it, window {} (training goes on at iteration {})",
          state_->resume_window, older->window, older->target_iteration));
      state_->went_back = true;
      resume_at(*older);
      job_.resume_instead(*older);
      co_return co_await choose_durable_window(r);
    }
    job_.fail(state_->resume_failure);
    co_return false;
  }
  if (state_->went_back) {
    // The windows from here on are numbered after this journal's again: the newer journals
    // would name windows of the timeline left (the stages drop their files of those as they
    // restore). Deleted only now: a resume that found nothing leaves every journal as it was.
    try {
      resume_journal(job_.job()).drop_after(state_->resume_window);
    } catch (const std::exception& e) {
      job_.fail(fmt::format("{}: the journals after window {} cannot be removed ({})",
                            state_->durable_why, state_->resume_window, e.what()));
      co_return false;
    }
  }
  if (!found && clean_) {
    job_.fail(fmt::format(
        "{}; no durable window captured before iteration {} is complete and verified on every "
        "stage ({} rejected), so the job stops rather than train on (checkpoint.keep windows "
        "are kept on disk: more reach further back)",
        why, clean_->before, rejected.size()));
    co_return false;
  }
  if (!found) {
    job_.fail(fmt::format(
        "{}; every copy of a needed snapshot is gone and no durable window is complete and "
        "verified on every stage ({} rejected); the job stops",
        why, rejected.size()));
    co_return false;
  }
  if (clean_) {
    // Past silent corruption: the journals after this window name the timeline left, whose
    // step plans came of corrupted gradients. Gone before any stage restores (at the recovery's
    // end was too late: a job killed during the rollback's replay resumed on that timeline).
    try {
      resume_journal(job_.job()).drop_after(window);
    } catch (const std::exception& e) {
      job_.fail(fmt::format("{}: the journals after window {} cannot be removed ({})", why, window,
                            e.what()));
      co_return false;
    }
  }
  state_->durable_window = window;
  state_->durable_first = windows_.durable_windows().at(window);
  for (const auto& [role, from] : state_->durable_from) {
    job_.notice(fmt::format(
        "stage {} replica {} restores from replica {}'s files of durable window {} (its own "
        "are missing, fail their checks, or are not trusted)",
        role.first, role.second, from, window));
  }
  note_durable_window(rejected.size());
  co_return true;
}

awaitable<region_recovery::offers_asked> region_recovery::durable_offers(
    const std::vector<member>& members, const std::vector<std::pair<int, int>>& roles,
    std::vector<std::set<std::uint64_t>>& offers, std::vector<std::string>& rejected) {
  // A resume going back to an older journal of the same roles asks nobody again: every
  // window on disk was offered or rejected the first time, and the disk has not changed.
  if (state_->resume && !state_->offered.empty() && state_->offered_roles == roles) {
    offers = state_->offered;
    rejected.clear();  // (reported the first time)
    co_return offers_asked::ok;
  }
  offers.clear();
  rejected.clear();
  const auto& workers = job_.worker_roles();
  std::vector<actor_ref> holders;
  for (std::size_t i = 0; i < roles.size(); ++i) {
    const auto it = workers.find(members[i % members.size()].spare);
    holders.push_back(it == workers.end() ? actor_ref{} : it->second.replicator);
  }
  auto fill = [&](std::size_t i, engine::wire::DurableQuery::Builder b) {
    b.setStage(roles[i].first);
    b.setReplica(roles[i].second);
  };
  auto replies = co_await actors::ask_all<engine::wire::DurableQuery, engine::wire::DurableOffer>(
      job_.actor(), holders, std::chrono::seconds(300), fill);
  if (job_.finished() || !state_) co_return offers_asked::failed;
  for (std::size_t i = 0; i < replies.size(); ++i) {
    const auto& res = replies[i];
    if (!res.ok()) {
      // Usually its worker died: its loss comes within the failure timeout.
      if (co_await job_.loss_follows()) co_return offers_asked::again;
      if (job_.finished() || !state_) co_return offers_asked::failed;
      job_.fail(fmt::format("asking for the durable windows of stage {} replica {} failed: {}",
                            roles[i].first, roles[i].second, res.err().message));
      co_return offers_asked::failed;
    }
    auto& mine = offers.emplace_back();
    for (auto w : res->get().getWindows()) mine.insert(w);
    for (auto t : res->get().getRejected()) rejected.push_back(std::string(t).substr(0, 1024));
  }
  if (state_->resume) {
    state_->offered_roles = roles;
    state_->offered = offers;
  }
  co_return offers_asked::ok;
}

std::optional<std::map<std::pair<int, int>, int>> region_recovery::serving_files(
    const std::vector<std::pair<int, int>>& roles,
    const std::vector<std::set<std::uint64_t>>& offers, std::uint64_t window,
    std::int64_t first) const {
  const int ep = std::max(state_->window_pp != 0 ? state_->window_ep : job_.job().ep, 1);
  auto usable = [&](std::size_t k, int stage, int replica) {
    const auto u = untrusted_.find({stage, replica});
    return offers[k].contains(window) && (u == untrusted_.end() || first > u->second.through);
  };
  std::map<std::pair<int, int>, int> from;
  for (std::size_t i = 0; i < roles.size(); ++i) {
    const auto [s, d] = roles[i];
    if (usable(i, s, d)) continue;
    bool served = false;
    for (std::size_t k = 0; k < roles.size() && !served; ++k) {
      const auto [s2, o] = roles[k];
      if (s2 != s || o == d || o % ep != d % ep || !usable(k, s2, o)) continue;
      from[{s, d}] = o;
      served = true;
    }
    if (!served) return std::nullopt;
  }
  return from;
}

void region_recovery::note_durable_window(std::size_t rejected) const {
  const std::uint64_t window = state_->durable_window;
  const std::int64_t target = state_->target;
  const std::string& why = state_->durable_why;
  if (auto* log = job_.log()) {
    log->write(engine::json_record{}
                   .add("kind", "event")
                   .add("event", "durable_rollback")
                   .add("window", std::int64_t(window))
                   .add("first_iteration", state_->durable_first)
                   .add("target_iteration", target)
                   .add("rejected", std::int64_t(rejected))
                   .add("reason", why.substr(0, 1024))
                   .add("clean_before", clean_ ? clean_->before : std::int64_t{-1})
                   .add("time_s", log->seconds()));
  }
}

}  // namespace moevement::recovery
