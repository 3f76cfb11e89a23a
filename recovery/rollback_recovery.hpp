// The global rollback on the head: how policies dense-memory, dense-disk and pec recover a
// lost worker (docs/policies.md). A spare takes the lost stage's role with a fresh stage; then
// every stage (survivors and the replacement) offers the checkpoints it can load, verified;
// the newest one every stage offers is loaded everywhere and the job recomputes from there.
// The rollback is a region spanning the pipeline under a region supervisor, under the job
// supervisor, as policy moevement's regions are: a loss during it (a survivor, or a spare
// being rebuilt) restarts the region (a spare for the lost role, then the loading over); past
// checkpoint.region_restarts it escalates, and the job stops. Runs inside the coordinator's actor,
// through engine::head_control.
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

namespace moevement::recovery {

class rollback_recovery : public engine::head_recovery {
 public:
  explicit rollback_recovery(engine::head_control& job) : job_(job), tree_(job) {}

  // The checkpoint interval k (decided after the first iteration's profile: checkpoint.interval,
  // or Young's optimum), and the loss scaler at the checkpoint points.
  engine::checkpoint_place planned(const engine::planned_iteration& it) override;
  bool active() const override { return state_.has_value(); }
  asio::awaitable<void> lost(engine::worker_info w) override;
  bool involves(transport::node_id n) const override;
  asio::awaitable<void> lost_member(transport::node_id n) override;
  asio::awaitable<void> go_on() override { return start(); }
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
  void stop() override {
    stop_supervisor();
    tree_.stop();
  }

 private:
  using sclock = std::chrono::steady_clock;
  // One stage replica of the pipeline: every one rolls back; a lost one is first rebuilt
  // afresh on a spare.
  struct role {
    engine::worker_info lost;       // the role (stage, replica); node: the worker that died
    transport::node_id worker = 0;  // where it runs now (0: lost, a spare to be given)
    std::string worker_domain{};    // a spare's failure domain (the next spare avoids it)
    bool fresh = false;             // rebuilt afresh on a spare (a Restore)
    std::uint64_t generation = 0;   // the attempt whose Restore built it
    bool ready = false;             // that stage reported
  };
  struct state {
    std::int64_t target = 0;
    bool begun = false;  // the survivors were aborted
    sclock::time_point detected;
    std::vector<engine::worker_info> pending;  // losses before the region was formed
    std::vector<role> roles;                   // the region: every role of the pipeline
    actors::actor_ref supervisor;              // its region_supervisor
    std::shared_ptr<std::vector<transport::node_id>> nodes;  // what its children read
    std::uint64_t attempt = 0;  // the region's generations: a loss during one starts it over
    bool restarting = false;    // its supervisor is about to restart it (a member lost)
    std::set<transport::node_id> replaced;  // members' workers a restart replaced
    double group_abort_s = 0.0;             // the survivors' NCCL groups' aborts, the slowest
  };
  // The survivors drop the iteration in progress (once); then one region of every role, under
  // a region_supervisor (recovery/region_supervisor.hpp) under the job supervisor: the same
  // tree as policy moevement's, one region spanning the pipeline.
  asio::awaitable<void> start();
  void stop_supervisor();
  // Each role whose worker is gone gets a spare and a fresh stage (false: none left).
  bool give_spares();
  // Once every fresh stage reported: the newest checkpoint every stage can load, loaded
  // everywhere; training goes on there.
  asio::awaitable<void> maybe_finish();
  asio::awaitable<void> finish();
  // The newest checkpoint every stage offers (verified by itself), and how many a stage
  // rejected; nullopt: none (the job failed, saying why), or a loss superseded the rollback.
  struct chosen {
    std::int64_t iteration = -1;
    std::int64_t rejected = 0;
  };
  asio::awaitable<std::optional<chosen>> choose_checkpoint(
      const std::vector<actors::actor_ref>& agents, const std::vector<actors::actor_ref>& holders,
      std::int64_t target);
  // What the stages loaded (finish()'s second step).
  struct loaded {
    std::uint64_t bytes = 0;
    std::vector<std::int64_t> lost_per_layer;  // pec: tokens routed to stale experts, by layer
    std::int64_t stale = 0;
    std::string sources;
  };
  // The run log's recovery_end and the notice of a rollback to iteration c.
  void report_end(const state& rec, std::int64_t c, std::int64_t rejected, const loaded& got,
                  sclock::time_point t_wired);

  engine::head_control& job_;
  std::optional<state> state_;
  std::uint64_t region_ids_ = 0;
  recovery_tree tree_;                  // the job supervisor, over the region's supervisor
  std::int64_t lost_tokens_total_ = 0;  // pec, over every rollback so far
  int interval_ = 0;                    // k (0: not decided yet)
  std::map<std::int64_t, models::loss_scaler> scaler_at_;  // the newest checkpoint points
};

// The head's recovery of every policy: regions (moevement), the rollback (the baselines);
// none: an empty factory.
engine::head_recovery_factory any_head_recovery(engine::policy_kind policy);

}  // namespace moevement::recovery
