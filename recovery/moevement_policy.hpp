// Policy `moevement` on actors (paper sections 3.2-3.4), in every worker process:
//
// - checkpoint_hooks (the stage's engine::stage_hooks, compute thread): the sparse capture of
//   sparse_capture.hpp, once the coordinator chose W_sparse, with the popularity agreed
//   across the stage's replicas; every boundary tensor sent goes to the upstream log.
// - checkpoint_agent (checkpoint_agent.hpp, one per stage process): the log keeper, and the
//   shipping of captured slots to the replicators.
// - replicator (replicator.hpp, one per worker, spares included): holds peers' slots.
// - group_exchange (one per worker, group_replay.hpp): receives the gradients of the other
//   members of a recovery group replaying in parallel.
// - moevement_checkpoint (engine::worker_checkpoint): makes the above, and restores a stage
//   replica of a recovery region on this worker (region_restore.hpp).
#pragma once

#include <memory>
#include <optional>
#include <vector>

#include "engine/checkpoint.hpp"
#include "recovery/checkpoint_agent.hpp"
#include "recovery/durable_window.hpp"
#include "recovery/group_replay.hpp"
#include "recovery/policy_limits.hpp"
#include "recovery/replicator.hpp"
#include "recovery/sparse_capture.hpp"

namespace moevement::recovery {

// Algorithm 1's FindWindowSize over every stage (the largest W any stage needs).
int choose_window(const std::vector<std::vector<engine::op_size>>& stages, double iteration_s,
                  double bandwidth);

class moevement_checkpoint : public engine::worker_checkpoint {
 public:
  moevement_checkpoint(actors::actor_system& system, engine::bulk_io& io,
                       const engine::job_config& job, policy_limits limits = {});

  actors::actor_ref replicator() const override { return replicator_; }
  actors::actor_ref agent() const override { return agent_; }
  actors::actor_ref group_exchange() const override { return exchange_; }
  std::unique_ptr<engine::stage_hooks> make_hooks(const engine::stage_setup& setup,
                                                  engine::stage_model& model,
                                                  actors::actor_ref coordinator) override;
  std::vector<engine::op_size> op_sizes() const override { return sizes_; }
  double snapshot_bandwidth() const override { return bandwidth_; }
  asio::awaitable<std::unique_ptr<engine::stage_model>> restore(
      engine::wire::Restore::Reader plan, const engine::stage_factory& factory,
      engine::stage_setup setup) override;
  asio::awaitable<std::vector<std::uint64_t>> judge(engine::wire::Restore::Reader plan,
                                                    const engine::stage_factory& factory,
                                                    engine::stage_setup setup) override;
  restore_timing last_restore() const override { return timing_; }
  void set_coordinator(actors::actor_ref coordinator) override;
  std::uint64_t newest_generation() const override {
    return std::max(inbox_->generation(), boundaries_->generation());
  }
  void set_copy_flip(engine::copy_flip_hook flip) override { copy_flip_ = std::move(flip); }

 private:
  engine::copy_flip_hook copy_flip_;  // failure injection for the next stage's agent
  actors::actor_system& system_;
  engine::bulk_io& io_;
  engine::job_config job_;
  policy_limits limits_;
  std::shared_ptr<durable_writer> durable_;  // null: checkpoint.durable is off
  // The actor thread's CPU on replication: its replicator and agent add, the stage's hooks take.
  std::shared_ptr<replication_cpu> replication_cpu_ = std::make_shared<replication_cpu>();
  bool fresh_ = true;  // no restore yet: the role given at the start
  actors::actor_ref replicator_, agent_, exchange_;
  std::shared_ptr<group_inbox> inbox_;       // what exchange_ received, for a group replay here
  std::shared_ptr<group_inbox> boundaries_;  // and for a pipelined region's replay here
  std::vector<engine::op_size> sizes_;
  double bandwidth_ = 0.0;
  // What a restore replayed for this replica: it becomes the new stage's upstream log.
  std::unique_ptr<log_store> restored_log_;
  std::optional<stage_schedule::state> restored_schedule_;
  // The regions a restore pulled its own stage replica's window into: the new stage's slot
  // pool starts with them (no first touch of fresh memory in the iterations after a recovery).
  std::vector<transport::bulk_region> restored_regions_;
  std::vector<transport::shared_memory> restored_files_;  // the same, as memory files
  std::size_t restored_w_ = 0;                            // W_sparse of the window they came from
  restore_timing timing_;
};

// The worker-side factory of every policy that runs on actors (none: nullptr).
engine::checkpoint_factory policy_factory(policy_limits limits = {});

}  // namespace moevement::recovery
