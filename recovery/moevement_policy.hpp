// Policy `moevement` on actors (paper sections 3.2-3.4), in every worker process:
//
// - checkpoint_hooks (the stage's engine::stage_hooks, compute thread): the sparse capture of
//   sparse_capture.hpp, once the coordinator chose W_sparse, with the popularity agreed
//   across the stage's replicas; every boundary tensor sent goes to the upstream log.
// - checkpoint_agent (one per stage process): ships each captured slot to the stage's r
//   replicators (StoreSlot; they pull it), tells the coordinator when a whole window is
//   replicated (WindowReplicated), drops what the job no longer needs once a newer window
//   is persisted everywhere (WindowPersisted), and serves its upstream log to a replacement
//   (FetchLog). This is the paper's log keeper: the log lives at the sender.
// - replicator (one per worker, spares included): holds peers' slots in host memory, one
//   persisted window and the ones in flight, and serves them (FetchSlot).
// - group_exchange (one per worker, group_replay.hpp): receives the gradients of the other
//   members of a recovery group replaying in parallel.
// - moevement_checkpoint (engine::worker_checkpoint): makes the above, and restores a stage
//   replica of a recovery region on this worker (region_restore.hpp).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "engine/checkpoint.hpp"
#include "recovery/durable_window.hpp"
#include "recovery/group_replay.hpp"
#include "recovery/recovery.capnp.h"
#include "recovery/slot_pool.hpp"
#include "recovery/sparse_capture.hpp"

namespace moevement::recovery {

// Limits on what peers may ask of these actors (everything from the wire is untrusted). The
// one place these defaults live.
struct policy_limits {
  std::uint64_t max_slot_bytes = std::uint64_t(4) << 30;  // one snapshot slot
  std::uint64_t max_log_bytes = std::uint64_t(8) << 30;   // one FetchLog answer
  std::size_t max_log_leases = 16;                        // FetchLog answers not yet released
  std::uint64_t bandwidth_sample_bytes = 16u << 20;       // snapshot bytes timed for Algorithm 1
  int bandwidth_samples = 5;  // copies of that sample timed; the fastest counts
  // Large pulls go in pieces of this size, one after the other, so that the processes' event
  // loops (heartbeats) are never held by one huge transfer.
  std::uint64_t pull_chunk_bytes = 8u << 20;
  // Windows a stage holds at most (the persisted one, one complete and being replicated, the
  // one being captured): a step that would start another waits (a stall) until the job
  // persisted one more, at most max_window_wait, so that host memory stays bounded when
  // replication falls behind.
  std::size_t max_windows_held = 3;
  // Windows of counts or schedules a survivor's schedule state may carry (it holds two).
  std::size_t max_schedule_windows = 8;
  std::chrono::milliseconds max_window_wait{10000};
  // How long a parallel group replay waits for a peer's gradients of one iteration. A peer
  // that died or hangs is found by the heartbeats first (the region then restarts under a
  // newer generation, whose ReplayGeneration ends this wait); this only bounds a wait nothing
  // else ends.
  std::chrono::seconds group_wait{600};
};

// Algorithm 1's FindWindowSize over every stage (the largest W any stage needs).
int choose_window(const std::vector<std::vector<engine::op_size>>& stages, double iteration_s,
                  double bandwidth);

// The capture state a stage's hooks (compute thread) and its agent (actor thread) share.
// Two locks: `mu` for the windows, schedule and step plans (the capture thread holds it while
// it copies a slot), `log_mu` for the upstream log (taken on every boundary send, so a send
// never waits for a capture). Taking both: mu first.
struct capture_shared {
  capture_shared(int stage, int replica) : capture(stage, replica) {}
  // Lends the capture link-allocated slot memory (set by make_hooks). Declared first: it
  // outlives the capture's buffers. The last owner of capture_shared must release it on the
  // actor thread (the pool's regions are the link's).
  std::unique_ptr<slot_pool> pool;
  std::mutex mu, log_mu;
  // Replicas of its slots made so far (the agent counts, the hooks report).
  std::atomic<std::uint64_t> replica_maps{0}, replica_pulls{0};
  std::condition_variable dropped;  // notified (under mu) when the agent dropped windows
  sparse_capture capture;
  std::optional<stage_schedule> schedule;
  // A replacement's: the schedule state of a surviving replica, loaded once W is known.
  std::optional<stage_schedule::state> taken_over;
};

// The durable tier of one stage replica (checkpoint.durable): the process's writer (null: off),
// the role's directory and the windows kept there.
struct durable_target {
  std::shared_ptr<durable_writer> writer;
  std::filesystem::path dir;
  std::size_t keep = 2;
};

class checkpoint_agent : public actors::actor {
 public:
  using interface = actors::interface<
      actors::tell_t<wire::SlotStored>, actors::tell_t<engine::wire::WindowPersisted>,
      actors::tell_t<engine::wire::WindowsAbandoned>, actors::ask_t<wire::FetchLog, wire::LogData>,
      actors::tell_t<wire::ReleaseLog>, actors::ask_t<wire::FetchSchedule, wire::ScheduleState>>;

  checkpoint_agent(std::shared_ptr<capture_shared> shared, engine::bulk_io& io, int stage,
                   int replica, actors::actor_ref coordinator, int copies, policy_limits limits,
                   durable_target durable = {});

  // Called on the actor thread (post_call) by the hooks.
  void ship(std::int64_t iteration);
  void set_targets(std::vector<actors::actor_ref> replicators);
  // The durable writer finished window `window` (error empty) or failed: tell the coordinator.
  void durable_done(std::uint64_t window, std::uint64_t bytes, double seconds,
                    const std::string& error);

 private:
  // Writes a persisted window to the durable tier in the background (slots: the capture's
  // pinned buffers; empty when this stage does not hold the whole window).
  void write_durable(std::uint64_t window, std::int64_t first,
                     std::vector<std::span<const std::byte>> slots);
  struct pending_slot {
    transport::bulk_descriptor slot;  // where replicas pull it from
    transport::bulk_region region;    // heap memory exported for it (none: lent memory)
    std::optional<transport::share_handle> share;  // lent memory a replica on this host maps
    std::size_t copies = 0;                        // replicators that answered stored
    std::vector<actors::actor_ref> asked;          // targets sent a StoreSlot
  };
  asio::awaitable<void> stored(wire::SlotStored::Reader m);
  asio::awaitable<void> persisted(engine::wire::WindowPersisted::Reader m);
  asio::awaitable<void> abandoned(engine::wire::WindowsAbandoned::Reader m);
  asio::awaitable<void> fetch_log(wire::FetchLog::Reader m, wire::LogData::Builder out);
  asio::awaitable<void> release(wire::ReleaseLog::Reader m);
  asio::awaitable<void> schedule(wire::FetchSchedule::Reader m, wire::ScheduleState::Builder out);
  void send(std::uint64_t window, std::uint32_t slot, pending_slot& p);
  void check_window(std::uint64_t window);

  std::shared_ptr<capture_shared> shared_;
  engine::bulk_io& io_;
  int stage_, replica_;
  actors::actor_ref coordinator_;
  int copies_;
  policy_limits limits_;
  durable_target durable_;
  std::vector<actors::actor_ref> targets_;
  std::map<std::pair<std::uint64_t, std::uint32_t>, pending_slot> pending_;
  std::map<std::uint64_t, std::vector<bool>> replicated_;  // window -> [slot]
  std::map<std::uint64_t, transport::bulk_region> leases_;
  std::uint64_t next_lease_ = 1;
};

class replicator : public actors::actor {
 public:
  using interface =
      actors::interface<actors::tell_t<wire::StoreSlot>,
                        actors::ask_t<wire::FetchSlot, wire::SlotData>,
                        actors::tell_t<engine::wire::WindowPersisted>,
                        actors::ask_t<engine::wire::DurableQuery, engine::wire::DurableOffer>>;

  // durable: the process's durable writer (null: the tier is off), root: checkpoint.dir.
  // share: map a slot offered by an agent on this host instead of pulling a copy.
  replicator(engine::bulk_io& io, policy_limits limits,
             std::shared_ptr<durable_writer> durable = nullptr, std::filesystem::path root = {},
             bool share = false);
  std::size_t bytes_held() const;
  using key = std::tuple<std::int32_t, std::int32_t, std::uint64_t, std::uint32_t>;
  // A slot_puller's result: keep the slot (unless the window went meanwhile) and answer.
  void finish_store(const key& id, const actors::actor_ref& from,
                    const std::shared_ptr<transport::bulk_region>& holder, std::uint64_t length,
                    const std::string& error);

 private:
  asio::awaitable<void> store(wire::StoreSlot::Reader m);
  asio::awaitable<void> fetch(wire::FetchSlot::Reader m, wire::SlotData::Builder out);
  asio::awaitable<void> persisted(engine::wire::WindowPersisted::Reader m);
  // Which durable windows of a stage replica verify (the writer drained first).
  asio::awaitable<void> durable_query(engine::wire::DurableQuery::Reader m,
                                      engine::wire::DurableOffer::Builder out);

  engine::bulk_io& io_;
  policy_limits limits_;
  std::shared_ptr<durable_writer> durable_;
  std::filesystem::path root_;
  bool share_ = false;
  struct stored_slot {
    transport::bulk_region region;  // a spare region may be larger than the slot
    std::uint64_t length = 0;
    // Or the owner's memory, mapped (checkpoint.share_memory): [offset, offset + length).
    std::shared_ptr<transport::shared_memory> mapped;
    std::uint64_t offset = 0;
    transport::bulk_region exported;  // of the mapped bytes, made for the first pull of them
  };
  // Maps a slot an agent on this host offers; false: pull it instead.
  bool store_mapped(const key& id, const actors::actor_ref& from, wire::StoreSlot::Reader m,
                    std::uint64_t length);
  std::map<key, stored_slot> slots_;
  // The regions of the last dropped window, by length: the next window's slots have the same
  // sizes (the schedule repeats), and a fresh region costs a page fault per page on the actor
  // thread, which the stage's own messages wait behind.
  std::multimap<std::uint64_t, transport::bulk_region> spare_;
  std::uint64_t persisted_ = 0;
};

// Pulls one slot for a replicator and hands it over, then stops (one per StoreSlot).
class slot_puller : public actors::actor {
 public:
  using interface = actors::interface<>;
  slot_puller(engine::bulk_io& io, transport::bulk_descriptor desc,
              std::shared_ptr<transport::bulk_region> holder, std::uint64_t chunk,
              actors::actor_ref replicator, replicator::key id, actors::actor_ref from);

 protected:
  asio::awaitable<void> on_start() override;

 private:
  engine::bulk_io& io_;
  transport::bulk_descriptor desc_;
  std::shared_ptr<transport::bulk_region> holder_;
  std::uint64_t chunk_;
  actors::actor_ref replicator_;
  replicator::key id_;
  actors::actor_ref from_;
};

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
  restore_timing last_restore() const override { return timing_; }

 private:
  actors::actor_system& system_;
  engine::bulk_io& io_;
  engine::job_config job_;
  policy_limits limits_;
  std::shared_ptr<durable_writer> durable_;  // null: checkpoint.durable is off
  bool fresh_ = true;                        // no restore yet: the role given at the start
  actors::actor_ref replicator_, agent_, exchange_;
  std::shared_ptr<group_inbox> inbox_;  // what exchange_ received, for a group replay here
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
