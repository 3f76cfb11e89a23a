// Policy moevement's recovery on the head (docs/recovery.md "The recovery tree"): losses are
// placed in regions of contiguous lost stages (a loss next to a region still recovering grows
// and restarts it, a disjoint one adds a region), each region under a region supervisor
// (recovery/region_supervisor.hpp) that asks for every generation of it (region_restart: a
// spare for every role whose worker is gone, the Restores sent). A region past its restart
// intensity escalates to the job supervisor (recovery/job_supervisor.hpp), whose strategy is
// the durable tier's rollback of the whole job, one region of every role (durable_rollback.cpp,
// also what `--resume` runs), or the job stops. Runs inside the coordinator's actor, through
// engine::head_control.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/head_recovery.hpp"
#include "recovery/job_supervisor.hpp"
#include "recovery/window_book.hpp"

namespace moevement::recovery {

using engine::worker_info;

class region_recovery : public engine::head_recovery {
 public:
  explicit region_recovery(engine::head_control& job) : job_(job), windows_(job), tree_(job) {}

  engine::checkpoint_place planned(const engine::planned_iteration& it) override {
    return windows_.planned(it);
  }
  void stepped(const engine::iteration_cost& c) override { windows_.stepped(c); }
  asio::awaitable<void> window_replicated(engine::wire::WindowReplicated::Reader m) override {
    windows_.replicated(m, active() || judging_);
    co_return;
  }
  void durable_soon() override { windows_.durable_soon(); }
  asio::awaitable<void> durable_written(engine::wire::DurableWritten::Reader m) override {
    // Not while rolling back past silent corruption: a window written now is of the timeline
    // left, and must never be journaled for a resume.
    if (!clean_) windows_.durable_written(m);
    co_return;
  }
  int w_sparse() const override { return windows_.w_sparse(); }
  std::int64_t replication_lag(std::int64_t iteration) const override {
    return windows_.replication_lag(iteration);
  }
  bool active() const override { return state_.has_value(); }
  std::uint64_t generations() const override { return generations_; }
  void generations_past(std::uint64_t seen) override {
    generations_ = std::max(generations_, seen);
  }
  asio::awaitable<void> lost(worker_info w) override;
  bool involves(transport::node_id n) const override;
  asio::awaitable<void> lost_member(transport::node_id n) override;
  asio::awaitable<void> go_on() override { return recover(); }
  bool rebuilding(transport::node_id n) const override;
  bool current(transport::node_id n, std::uint64_t generation) const override;
  asio::awaitable<void> restore_failed(transport::node_id n, const std::string& message,
                                       bool snapshot_lost) override;
  asio::awaitable<void> restored(transport::node_id n, engine::wire::StageReady::Reader m) override;
  asio::awaitable<void> region_restart(engine::wire::RegionRestart::Reader m,
                                       engine::wire::RegionMembers::Builder out) override;
  actors::actor_ref tree_root() const override { return tree_.root(); }
  asio::awaitable<void> escalated(std::uint64_t region, std::string reason) override;
  asio::awaitable<void> resume(const engine::resume_point& p) override;
  bool taken_over(const engine::resume_point& p, const engine::live_takeover& t) override;
  asio::awaitable<engine::replay_judgement> judge(int stage, int replica,
                                                  std::int64_t target) override;
  asio::awaitable<engine::replay_judgement> shadow_judge(int stage, std::int64_t target) override;
  void shadow_agreed(int stage, std::int64_t iteration) override {
    windows_.shadow().agreed(stage, iteration, persisted_at());
  }
  void shadow_skipped() override { windows_.shadow().restart(); }
  std::int64_t shadow_clean_before(int stage) const override {
    return windows_.shadow().clean_before(stage);
  }
  bool corrupted(int stage, int replica, int from, std::int64_t through) override {
    if (from >= 0) untrusted_[{stage, replica}] = {from, through};
    return true;
  }
  bool can_roll_back_before(std::int64_t clean_before) const override {
    return windows_.durable() && windows_.clean_window_before(clean_before) &&
           !(state_ && state_->durable);
  }
  asio::awaitable<bool> roll_back_before(std::int64_t clean_before, std::string why) override;
  // Every live worker's durable writes in flight finished (or durable_write_wait passed).
  asio::awaitable<void> settle_durable_writes();
  asio::awaitable<void> roll_back_now() override;
  std::int64_t steps_kept_from() const override {
    const auto& steps = windows_.steps();
    return steps.empty() ? -1 : steps.begin()->first;
  }
  void stop() override {
    stop_supervisors();
    tree_.stop();
  }

 private:
  using sclock = std::chrono::steady_clock;
  // One role of a region: a lost stage replica rebuilt on a spare, or (a group replaying in
  // parallel) a surviving replica replaying on its own worker.
  struct member {
    worker_info lost;              // the role (stage, replica) and the worker that had it
    transport::node_id spare = 0;  // the worker rebuilding it (0: none yet)
    std::string spare_domain{};    // its failure domain: a spare after it if it died avoids it
    bool ready = false;            // answered the region's current generation
    double pull_s = 0.0, replay_s = 0.0;
    int replay_threads = 0;
    std::int64_t replayed = 0;
    std::int64_t slots_mapped = 0, slots_pulled = 0, handles_refused = 0;  // its restore's
    std::int64_t copies_refused = 0;
    std::int64_t log_pieces = 0;  // answers its neighbours' logs came in
  };
  // A supervision subtree of the recovery: contiguous lost stages, rebuilt jointly.
  struct region {
    std::uint64_t id = 0;
    int first = 0, last = 0;  // stages first..last
    std::vector<member> members;
    actors::actor_ref supervisor;  // its region_supervisor (invalid: not started yet)
    std::size_t supervised = 0;    // members it has children for
    std::shared_ptr<std::vector<transport::node_id>> nodes;  // what its children read
    std::uint64_t generation = 0;   // of the Restores sent last (0: none yet)
    int restarts = 0;               // generations before the current one (cascading)
    bool dirty = false;             // new, grown or lost a replacement: Restores to send
    std::vector<std::string> died;  // the losses since the last Restores (for the notice)
    // Why the current generation began (the run log's `supervision`): started, restarted (a
    // member's worker was lost), grew (a loss next to it, or a merge).
    const char* cause = "started";
    // Its supervisor is about to restart it (a member's worker lost, or it grew): reports of
    // the current generation no longer count, and the recovery cannot end meanwhile.
    bool restarting = false;
    sclock::time_point started, ready_at;
  };
  struct state {
    std::int64_t target = 0;
    bool begun = false;              // the survivors were aborted
    bool resume_validation = false;  // the loss came during a validation round
    sclock::time_point detected;
    std::vector<worker_info> pending;  // losses not yet placed in a region
    std::vector<region> regions;
    // Workers of region members that a restart replaced (their loss is the supervisor's, and
    // their worker_lost may come after it).
    std::set<transport::node_id> replaced;
    // Falling back to the durable tier: every stage restores from a window every role
    // verifies on disk (chosen by each restart of its one region).
    bool durable = false;
    std::uint64_t durable_window = 0;
    std::int64_t durable_first = 0;
    std::string durable_why;  // what made every copy of a snapshot unusable
    // Roles whose own files of the durable window are missing, fail their checks or are
    // untrusted (a replica fenced for silent corruption): the replica of the same stage (and
    // EP shard, the same bits) whose files stand for theirs.
    std::map<std::pair<int, int>, int> durable_from;
    bool resume = false;               // not a loss: the job resumes from its journal (--resume)
    int window_pp = 0, window_dp = 0;  // a resume's windows are of this layout (0: the job's)
    std::uint64_t resume_window = 0;   // the journal a resume goes on from (its window)
    bool went_back = false;            // to an older journal (none of the newest's was whole)
    std::string resume_failure;        // why the newest journal could not be resumed
    // A resume's first answers (durable_offers), for the older journals it goes back to.
    std::vector<std::pair<int, int>> offered_roles;
    std::vector<std::set<std::uint64_t>> offered;
    int window_ep = 0;
    double group_abort_s = 0.0;  // the survivors' NCCL groups' aborts, the slowest
  };
  // What a generation restores from: the target iteration, the window (the persisted one, or
  // the durable tier's) and the first iteration its replay runs.
  struct restore_from {
    std::int64_t target = 0;
    bool durable = false, has_window = false;
    std::uint64_t window = 0;
    std::int64_t first = 0;
  };

  // The survivors are aborted once, then the pending losses placed in regions (contiguous
  // lost stages merge), each new or grown region supervised.
  asio::awaitable<void> recover();
  void place_losses();
  std::pair<region*, member*> member_of(transport::node_id spare);
  std::pair<const region*, const member*> member_of(transport::node_id spare) const;
  region* region_by_id(std::uint64_t id);
  // Starts r's supervisor (r new), or grows it by r's members it does not supervise yet.
  void supervise(region& r);
  // Stops every region supervisor (the recovery ended, or the job did); their exits are
  // then not escalations.
  void stop_supervisors();
  // The next generation of r; false when the job cannot go on (it failed, saying why).
  asio::awaitable<bool> restart_region(region& r);
  // With dp > 1 the recovery group replays in parallel: every surviving replica of r's
  // stages becomes a member too, restored on its own worker.
  void add_group_survivors(region& r);
  bool group_replay(const region& r) const;
  // Gives every role of r without a worker a spare (false: none left, the job failed).
  bool assign_spares(region& r);
  // Region r restarted past checkpoint.region_restarts: the durable fallback where the tier
  // is on, else the job stops.
  asio::awaitable<void> escalate(const region& r, const std::string& reason);
  // Once every member of every region reported: rewire and go on at the target.
  asio::awaitable<void> maybe_finish();

  // region_judge.cpp: the persisted window, if any; an idle spare's replay of replica
  // `replica` of stage `stage` from window `from` (none: the job's start) to `target`.
  std::optional<shadow_windows::window_at> persisted_at() const;
  asio::awaitable<engine::replay_judgement> replay_on_spare(
      int stage, int replica, std::int64_t target, std::optional<shadow_windows::window_at> from);
  // region_restores.cpp: the Restores of a generation, and what the run log says of it.
  restore_from restore_point() const;
  std::map<std::string, int> restores_per_host() const;
  void announce_restart(const region& r);
  void send_restores(const region& r);
  // A Restore's sources (per region stage and replica): the slot holders, and where `peers`
  // (not the durable tier) the logs of the healthy stages just outside the region and the
  // survivor whose schedule a replacement takes over.
  void write_sources(engine::wire::Restore::Builder b, const region& r,
                     const std::vector<actors::actor_ref>& holders, bool peers,
                     std::int64_t first) const;
  // The step plans of iterations first .. target - 1, as the head keeps them.
  void write_steps(engine::wire::Restore::Builder b, std::int64_t first, std::int64_t target) const;
  // The checkpoint agent of stage replica (s, d) when it is outside every region (else none).
  actors::actor_ref outside_agent(int s, int d) const;
  // Whether r's members replay as a group (each its own replica of the region) and as a
  // pipeline (each its own stage of a joint region).
  bool replays_as_group(const region& r) const;
  bool replays_as_pipeline(const region& r) const;
  void report_end(const state& rec) const;

  // durable_rollback.cpp: every copy of a needed snapshot is gone (or a region escalated)
  // and the durable tier is on: the whole pipeline becomes one region, every stage worker
  // (survivors too) restores it from the newest window all of them have on disk, verified,
  // and replays up to the target (docs/recovery.md "Fallback to the durable tier").
  asio::awaitable<void> start_durable_rollback(std::string why);
  // A failed restore of region `region`'s generation `generation`, once the losses queued
  // before this turn were placed: the job stops (or falls back to the durable tier) unless one
  // of them restarted, grew or merged that region.
  asio::awaitable<void> restore_failed_after_losses(std::uint64_t region, std::uint64_t generation,
                                                    std::string message, bool snapshot_lost);
  // Posts self->restore_failed_after_losses as a turn of the coordinator.
  static void look_again_at_failed_restore(actors::actor_system& sys, actors::actor_ref coordinator,
                                           region_recovery* self, std::uint64_t region,
                                           std::uint64_t generation, std::string message,
                                           bool snapshot_lost);
  // Asks every role of r for its verified durable windows and takes the newest common one;
  // false when none (the job failed, saying why). A role whose worker was lost meanwhile gets
  // a spare and everyone is asked again.
  asio::awaitable<bool> choose_durable_window(region& r);
  // Whether durable window `window` (replaying from `first`) serves every role, each by its
  // own files (offers[i]: the windows role i's files hold, verified) or another replica's of
  // the same stage and EP shard; then the roles served by another, with whose. A fenced
  // replica's files of windows begun before its detection serve nobody.
  std::optional<std::map<std::pair<int, int>, int>> serving_files(
      const std::vector<std::pair<int, int>>& roles,
      const std::vector<std::set<std::uint64_t>>& offers, std::uint64_t window,
      std::int64_t first) const;
  // Each role's verified durable windows (and the reasons for those rejected), asked of the
  // region members' replicators: ok, `again` (a worker was lost: its loss follows), or
  // `failed` (the job ended, or was failed saying why).
  enum class offers_asked { ok, again, failed };
  asio::awaitable<offers_asked> durable_offers(const std::vector<member>& members,
                                               const std::vector<std::pair<int, int>>& roles,
                                               std::vector<std::set<std::uint64_t>>& offers,
                                               std::vector<std::string>& rejected);
  // The run log's durable_rollback event for the window chosen.
  void note_durable_window(std::size_t rejected) const;
  // One region of every stage worker's role (a resume, or the durable rollback's).
  region whole_pipeline();
  // A resume's windows, target and layout as journal point p says.
  void resume_at(const engine::resume_point& p);

  engine::head_control& job_;
  window_book windows_;
  std::optional<state> state_;
  std::uint64_t generations_ = 0;
  std::uint64_t region_ids_ = 0;
  recovery_tree tree_;  // the job supervisor, over the regions' supervisors
  // Replicas fenced for silent corruption (corrupted()): (stage, replica) -> the replica whose
  // copies a restore takes instead, for windows whose first iteration is at most `through`.
  struct untrusted {
    int from = 0;
    std::int64_t through = 0;
  };
  std::map<std::pair<int, int>, untrusted> untrusted_;
  bool judging_ = false;  // a judge replays the persisted window: none persists meanwhile
  // A rollback past silent corruption (roll_back_before): the durable window it restores must
  // have been captured before step `before`, and the job goes on at `before`.
  struct clean_rollback {
    std::int64_t before = 0;
    std::string why;
  };
  std::optional<clean_rollback> clean_;
};

}  // namespace moevement::recovery
