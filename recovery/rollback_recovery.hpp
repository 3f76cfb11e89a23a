// The global rollback on the head: how policies dense-memory, dense-disk and pec recover a
// lost worker (docs/policies.md). A spare takes the lost stage's role with a fresh stage; then
// every stage (survivors and the replacement) offers the checkpoints it can load, verified;
// the newest one every stage offers is loaded everywhere and the job recomputes from there.
// A loss during it (a survivor, or a spare being rebuilt) adds a rebuild and starts the
// loading over. Runs inside the coordinator's actor, through engine::head_control.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/head_recovery.hpp"

namespace moevement::recovery {

class rollback_recovery : public engine::head_recovery {
 public:
  explicit rollback_recovery(engine::head_control& job) : job_(job) {}

  // The checkpoint interval k (decided after the first iteration's profile: checkpoint.interval,
  // or Young's optimum), and the loss scaler at the checkpoint points.
  int planned(const engine::planned_iteration& it) override;
  bool active() const override { return state_.has_value(); }
  asio::awaitable<void> lost(engine::worker_info w) override;
  bool involves(transport::node_id) const override { return false; }
  asio::awaitable<void> lost_member(transport::node_id) override { co_return; }
  asio::awaitable<void> go_on() override { return start(); }
  bool rebuilding(transport::node_id n) const override;
  bool current(transport::node_id n, std::uint64_t) const override { return rebuilding(n); }
  asio::awaitable<void> restore_failed(const std::string& message, bool snapshot_lost) override;
  asio::awaitable<void> restored(transport::node_id n, engine::wire::StageReady::Reader m) override;
  asio::awaitable<void> resume(const engine::resume_point& p) override;

 private:
  using sclock = std::chrono::steady_clock;
  struct rebuild {
    engine::worker_info lost;
    transport::node_id spare = 0;
    bool ready = false;
  };
  struct state {
    std::int64_t target = 0;
    bool begun = false;  // the survivors were aborted
    sclock::time_point detected;
    std::vector<engine::worker_info> pending;  // losses not yet given a spare
    std::vector<rebuild> rebuilds;
    std::uint64_t attempt = 0;   // rollbacks started over by a loss during one
    double group_abort_s = 0.0;  // the survivors' NCCL groups' aborts, the slowest
  };
  // The survivors drop the iteration in progress (once), every pending loss gets a spare.
  asio::awaitable<void> start();
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
  // Once every rebuild is ready: the newest checkpoint every stage can load, loaded
  // everywhere (false from a step: a loss superseded it, or the job ended).
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

  engine::head_control& job_;
  std::optional<state> state_;
  std::int64_t lost_tokens_total_ = 0;                     // pec, over every rollback so far
  int interval_ = 0;                                       // k (0: not decided yet)
  std::map<std::int64_t, models::loss_scaler> scaler_at_;  // the newest checkpoint points
};

// The head's recovery of every policy: regions (moevement), the rollback (the baselines);
// none: an empty factory.
engine::head_recovery_factory any_head_recovery(engine::policy_kind policy);

}  // namespace moevement::recovery
