// The baseline policies on actors, in every worker process (docs/policies.md):
//   dense-memory (Gemini-like): every k iterations the whole stage into host memory, kept
//     locally (the newest two) and shipped to r checkpoint holders on other workers;
//   dense-disk (CheckFreq-like): every k iterations the whole stage, persisted in the
//     background to checkpoint.dir (dense_capture with a durable_store, checkpoint.keep);
//   pec (MoC-System): every k iterations the non-experts and K experts per MoE layer
//     (pec_schedule, pec_capture), kept locally and shipped to r holders like dense-memory.
// k is the job-wide interval the coordinator decides after iteration 0 (checkpoint.interval,
// or Young's optimum) and sends with every step.
//
// Recovery is a global rollback the coordinator drives (engine/coordinator_rollback.cpp):
// every stage is paused; a spare builds a fresh copy of the lost stage; every stage's agent
// offers the checkpoints it can load, verified (RollbackQuery: survivors from their own memory
// or directory, the replacement from the holders or the directory); the coordinator picks the
// newest one every stage offers and every stage loads it (RollbackLoad). The job then
// recomputes from there: bit for bit the fault-free run for the dense policies; for pec the
// experts restored from older saves are stale, and the tokens routed to them since are lost
// (PLT, reported per MoE layer).
//
// The initial state (iteration 0) is always offered: each agent keeps a copy of its fresh
// stage, so a failure before the first checkpoint restarts the job from the beginning, and a
// pec expert never saved comes back at its initial state.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "engine/checkpoint.hpp"
#include "recovery/baseline.capnp.h"
#include "recovery/dense_capture.hpp"
#include "recovery/pec_capture.hpp"
#include "recovery/policy_config.hpp"
#include "recovery/policy_limits.hpp"
#include "recovery/slot_pool.hpp"

namespace moevement::recovery {

// Limits on what peers may ask of these actors (the one place these defaults live).
struct baseline_limits {
  std::uint64_t max_checkpoint_bytes = std::uint64_t(8) << 30;  // one checkpoint
  std::size_t max_held_per_replica = 64;      // checkpoints a holder keeps of one stage replica
  std::uint64_t pull_chunk_bytes = 8u << 20;  // pulls in pieces (heartbeats go on between)
  std::chrono::seconds fetch_timeout{30};
  std::size_t max_targets = 256;  // holders one SnapshotTargets may name
};

enum class baseline_kind : std::uint8_t { dense_memory, dense_disk, pec };

// One checkpoint in host memory: snapshot bytes (snapshot_size of them) and a trailer.
struct held_checkpoint {
  std::span<std::byte> bytes;
  std::shared_ptr<void> owner;  // keeps `bytes`: the heap, or a region lent by a slot_pool
  std::size_t snapshot_size = 0;
  bool lent = false;  // `bytes` is a region a slot_pool lent
};
// A held checkpoint on the heap.
held_checkpoint held_on_heap(std::shared_ptr<std::vector<std::byte>> bytes,
                             std::size_t snapshot_size);

// What a stage's hooks (compute thread) and its agent (actor thread) share, under mu.
struct baseline_shared {
  // dense-memory: lends the captures link-allocated memory, which holders on the same host
  // read with one RMA get (as moevement's slots, recovery/slot_pool.hpp). Declared first: it
  // outlives the checkpoints' owners.
  std::unique_ptr<slot_pool> pool;
  std::mutex mu;
  std::map<std::int64_t, held_checkpoint> held;  // dense-memory, pec: [state iteration]
  std::vector<std::int64_t> to_ship;             // new checkpoints the agent has not shipped
  std::optional<dense_capture> disk;             // dense-disk (once k is known)
  std::optional<pec_schedule> pec_sched;         // pec (once k is known)
  std::optional<pec_capture> pec_cap;
  int interval = 0;  // k, from the coordinator (0: not decided yet)
};

// Per-worker checkpoint holder: keeps peers' dense-memory / pec checkpoints in host memory.
class checkpoint_holder : public actors::actor {
 public:
  using interface = actors::interface<actors::tell_t<wire::StoreCheckpoint>,
                                      actors::ask_t<wire::FetchCheckpoints, wire::CheckpointList>>;
  checkpoint_holder(engine::bulk_io& io, baseline_limits limits);

 private:
  struct entry {
    transport::bulk_region region;
    std::uint64_t snapshot_size = 0;
  };
  asio::awaitable<void> store(wire::StoreCheckpoint::Reader m);
  asio::awaitable<void> fetch(wire::FetchCheckpoints::Reader m, wire::CheckpointList::Builder out);

  engine::bulk_io& io_;
  baseline_limits limits_;
  std::map<std::tuple<std::int32_t, std::int32_t, std::int64_t>, entry> held_;
};

// The stage's agent: ships checkpoints to its holders and carries out the rollback.
class baseline_agent : public actors::actor {
 public:
  using interface =
      actors::interface<actors::ask_t<engine::wire::RollbackQuery, engine::wire::RollbackOffer>,
                        actors::ask_t<engine::wire::RollbackLoad, engine::wire::RollbackLoaded>,
                        actors::tell_t<engine::wire::SnapshotTargets>>;

  // model: the stage's (outlives the agent; touched only while the stage is paused).
  // replacement: this stage was rebuilt on a spare (its checkpoints are on the holders).
  baseline_agent(std::shared_ptr<baseline_shared> shared, engine::bulk_io& io, baseline_kind kind,
                 policy_config config, engine::stage_setup setup, engine::stage_model& model,
                 std::shared_ptr<const std::vector<std::byte>> initial, bool replacement,
                 baseline_limits limits);

  void ship();  // on the actor thread (posted by the hooks)
  // The stage's holders (at a wiring, or after one was lost): the new ones get what is kept.
  void set_targets(std::vector<actors::actor_ref> holders);

 private:
  asio::awaitable<void> query(engine::wire::RollbackQuery::Reader m,
                              engine::wire::RollbackOffer::Builder out);
  asio::awaitable<void> load(engine::wire::RollbackLoad::Reader m,
                             engine::wire::RollbackLoaded::Builder out);
  // The holders after a spare holding copies was lost (the head's placement).
  asio::awaitable<void> retarget(engine::wire::SnapshotTargets::Reader m);
  // Keeps checkpoint `it` offerable (exported_): heap memory exported, lent memory as it is.
  const std::pair<transport::bulk_region, held_checkpoint>& export_checkpoint(
      std::int64_t it, const held_checkpoint& c);
  // Offers checkpoint `it` (exported as `region`, or lent memory) to the holders `to`.
  void offer(const std::vector<actors::actor_ref>& to, std::int64_t it,
             const transport::bulk_region& region, const held_checkpoint& c,
             const std::vector<std::int64_t>& keep);
  // Why `c` cannot restore this stage ("" when it can): a verified full snapshot (dense) or
  // a pec checkpoint whose every save is at hand.
  std::string unfit(std::int64_t iteration, const held_checkpoint& c) const;
  void restart_after(std::int64_t iteration);
  // A checkpoint a query found, and where (for the run log and the reasons it was refused).
  struct found_checkpoint {
    std::string origin;
    std::int64_t iteration = 0;
    held_checkpoint c;
  };
  void found_on_disk(std::vector<found_checkpoint>& found, std::vector<std::string>& rejected);
  asio::awaitable<void> found_on_holders(engine::wire::RollbackQuery::Reader m,
                                         std::vector<found_checkpoint>& found,
                                         std::vector<std::string>& rejected);
  // Verified pec checkpoints whose operators' saves are not all at hand.
  std::set<std::int64_t> not_rollback_points() const;
  // Loads pec checkpoint c's operators, each from its own save: adds the bytes read, the
  // tokens the stale experts lost (per MoE layer) and their count.
  pec_meta load_pec(std::int64_t c, std::uint64_t& bytes, std::vector<std::int64_t>& lost,
                    std::uint32_t& stale);
  void restart_captures(std::int64_t c, int k, const pec_meta& meta);

  std::shared_ptr<baseline_shared> shared_;
  engine::bulk_io& io_;
  baseline_kind kind_;
  policy_config config_;
  engine::stage_setup setup_;
  engine::stage_model& model_;
  std::shared_ptr<const std::vector<std::byte>> initial_;
  bool replacement_;
  baseline_limits limits_;
  std::vector<actors::actor_ref> targets_;
  // shipped and still held: the exported region and the memory it exports
  std::map<std::int64_t, std::pair<transport::bulk_region, held_checkpoint>> exported_;
  // What the last query verified and may load: [state iteration] (origin, checkpoint).
  std::map<std::int64_t, std::pair<std::string, held_checkpoint>> candidates_;
};

class baseline_checkpoint : public engine::worker_checkpoint {
 public:
  baseline_checkpoint(actors::actor_system& system, engine::bulk_io& io,
                      const engine::job_config& job, baseline_limits limits = {});

  actors::actor_ref replicator() const override { return holder_; }
  actors::actor_ref agent() const override { return agent_; }
  std::unique_ptr<engine::stage_hooks> make_hooks(const engine::stage_setup& setup,
                                                  engine::stage_model& model,
                                                  actors::actor_ref coordinator) override;
  // The stage's initial state as a full snapshot (every rollback to iteration 0 and every pec
  // expert never saved comes back to it), timed: Young's snapshot cost C.
  void prepare(const engine::stage_setup& setup, engine::stage_model& model) override;
  std::vector<engine::op_size> op_sizes() const override { return sizes_; }
  double snapshot_bandwidth() const override { return bandwidth_; }
  // A fresh stage: the rollback that follows loads it (RollbackLoad).
  asio::awaitable<std::unique_ptr<engine::stage_model>> restore(
      engine::wire::Restore::Reader plan, const engine::stage_factory& factory,
      engine::stage_setup setup) override;

 private:
  actors::actor_system& system_;
  engine::bulk_io& io_;
  engine::job_config job_;
  baseline_kind kind_;
  policy_config config_;
  baseline_limits limits_;
  actors::actor_ref holder_, agent_;
  std::vector<engine::op_size> sizes_;
  double bandwidth_ = 0.0;
  std::shared_ptr<std::vector<std::byte>> initial_;  // prepare()'s, taken by make_hooks()
  bool replacement_ = false;
};

// The worker-side factory of every policy on actors: moevement (moevement_policy.hpp), the
// baselines (this file); none: nullptr.
engine::checkpoint_factory any_policy_factory(policy_limits limits = {});

}  // namespace moevement::recovery
