// Policy moevement's checkpoint agent (one per stage process): ships each captured slot to the
// stage's r replicators (StoreSlot; they pull it), tells the coordinator when a whole window is
// replicated (WindowReplicated), drops what the job no longer needs once a newer window is
// persisted everywhere (WindowPersisted), writes persisted windows to the durable tier, and
// serves its upstream log to a replacement (FetchLog). This is the paper's log keeper: the log
// lives at the sender.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "engine/checkpoint.hpp"
#include "recovery/durable_window.hpp"
#include "recovery/log_copier.hpp"
#include "recovery/policy_limits.hpp"
#include "recovery/recovery.capnp.h"
#include "recovery/replication_cpu.hpp"
#include "recovery/slot_pool.hpp"
#include "recovery/sparse_capture.hpp"

namespace moevement::recovery {

// The capture state a stage's hooks (compute thread) and its agent (actor thread) share.
// Two locks: `mu` for the windows, schedule and step plans (the capture thread holds it while
// it copies a slot), `log_mu` for the upstream log (taken on every boundary send, so a send
// never waits for a capture). Taking both: mu first.
struct capture_shared {
  capture_shared(int stage, int replica)
      : capture(stage, replica),
        copier(
            [this](const log_copier::sent& s, std::vector<std::byte> bytes) {
              const std::lock_guard lock(log_mu);
              capture.log_sent(s.iteration, s.micro_batch, s.kind, std::move(bytes));
              // With the buffers kept for the next copies: what the log holds in memory.
              log_bytes = capture.log().bytes() + log_recycled->bytes();
            },
            log_recycled) {
    capture.mutable_log().recycle_into(log_recycled);
  }
  // Lends the capture link-allocated slot memory (set by make_hooks). Declared first: it
  // outlives the capture's buffers. The last owner of capture_shared must release it on the
  // actor thread (the pool's regions are the link's).
  std::unique_ptr<slot_pool> pool;
  std::mutex mu, log_mu;
  // The log's dropped entries' buffers, which its next copies reuse. Before `capture`, whose
  // log gives to it, and `copier`, which takes from it.
  std::shared_ptr<log_buffers> log_recycled = std::make_shared<log_buffers>();
  // Replicas of its slots made so far (the agent counts, the hooks report).
  std::atomic<std::uint64_t> replica_maps{0}, replica_pulls{0};
  // The process's actor-thread CPU on replication (the agent adds, the hooks take; null: not
  // measured).
  std::shared_ptr<replication_cpu> replication;
  std::condition_variable dropped;  // notified (under mu) when the agent dropped windows
  sparse_capture capture;
  // The upstream log's copies, made off the compute thread into `capture` (under log_mu). A
  // reader of the log settles it first (outside log_mu).
  log_copier copier;
  std::atomic<std::size_t> log_bytes{0};  // the log's entries and its kept buffers
  std::optional<stage_schedule> schedule;
  // A replacement's: the schedule state of a surviving replica, loaded once W is known.
  std::optional<stage_schedule::state> taken_over;
};

// Drops one owner's hold on a capture (any thread: off the actor thread it is posted there).
// The last owner first hands the slot pool's memory files to the process's disposer
// (actors/disposer.hpp), so that unmapping a stage's snapshot memory never holds the actor
// thread (nor its heartbeats).
void release_capture(std::shared_ptr<capture_shared>& shared, actors::actor_system& system);

// The durable tier of one stage replica (checkpoint.durable): the process's writer (null: off),
// the role's directory and the windows kept there.
struct durable_target {
  std::shared_ptr<durable_writer> writer;
  std::filesystem::path dir;
  std::size_t keep = 2;
  std::chrono::milliseconds delay{0};  // engine.durable_write_delay_ms (tests)
  std::int64_t fail_from = -1;         // engine.durable_fail_from, on its role only (tests)
};

class checkpoint_agent : public actors::actor {
 public:
  using interface = actors::interface<
      actors::tell_t<wire::SlotStored>, actors::tell_t<wire::SlotsStored>,
      actors::tell_t<engine::wire::WindowPersisted>, actors::tell_t<engine::wire::WindowsAbandoned>,
      actors::tell_t<engine::wire::SnapshotTargets>, actors::ask_t<wire::FetchLog, wire::LogData>,
      actors::tell_t<wire::ReleaseLog>, actors::ask_t<wire::FetchSchedule, wire::ScheduleState>>;

  checkpoint_agent(std::shared_ptr<capture_shared> shared, engine::bulk_io& io, int stage,
                   int replica, actors::actor_ref coordinator, int copies, policy_limits limits,
                   durable_target durable = {});
  ~checkpoint_agent() override;

  // Called on the actor thread (post_call) by the hooks.
  void ship(std::int64_t iteration);
  // A standby head took over: window reports go to its coordinator (on the actor thread).
  void set_coordinator(actors::actor_ref coordinator) { coordinator_ = coordinator; }
  // Failure injection (engine::fault_hooks::copy_flip): slots whose first holder is asked to
  // corrupt its copy.
  void set_copy_flip(engine::copy_flip_hook flip) { copy_flip_ = std::move(flip); }
  // Its capture (and upstream log), for a survivor's replay that checks its sends against it.
  std::shared_ptr<capture_shared> shared() const { return shared_; }
  int stage() const { return stage_; }
  int replica() const { return replica_; }
  void set_targets(std::vector<actors::actor_ref> replicators);
  // What writing one window to the durable tier took: its bytes, wall seconds, the writer
  // thread's CPU seconds (what the head paces the writes by), or why it failed.
  struct durable_result {
    std::uint64_t bytes = 0;
    double seconds = 0.0, cpu_s = 0.0;
    std::string error;
  };
  // The durable writer finished window `window` (error empty) or failed: tell the coordinator.
  void durable_done(std::uint64_t window, const durable_result& r);

 private:
  void refill_pool(std::size_t w_sparse);
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
    std::int64_t flip_bit = -1;  // failure injection: the bit its first holder flips
  };
  asio::awaitable<void> stored(wire::SlotStored::Reader m);
  asio::awaitable<void> stored_all(wire::SlotsStored::Reader m);
  void note_stored(wire::SlotStored::Reader m);
  asio::awaitable<void> persisted(engine::wire::WindowPersisted::Reader m);
  asio::awaitable<void> abandoned(engine::wire::WindowsAbandoned::Reader m);
  asio::awaitable<void> retarget(engine::wire::SnapshotTargets::Reader m);
  asio::awaitable<void> fetch_log(wire::FetchLog::Reader m, wire::LogData::Builder out);
  asio::awaitable<void> release(wire::ReleaseLog::Reader m);
  asio::awaitable<void> schedule(wire::FetchSchedule::Reader m, wire::ScheduleState::Builder out);
  void send(std::uint64_t window, std::uint32_t slot, pending_slot& p);
  // Offers the slots shipped since the last flush to every replicator, one StoreSlots each.
  void flush();
  void write_offer(wire::StoreSlot::Builder b, std::uint64_t window, std::uint32_t slot,
                   pending_slot& p, const actors::actor_ref& to, const actors::actor_ref& flip_at);
  actors::actor_ref flip_holder() const;  // the first holder: where an injected flip goes
  void check_window(std::uint64_t window);
  // A slot whose copies are all made (or that has no holder to make one): its window may be
  // whole.
  void slot_replicated(std::uint64_t window, std::uint32_t slot);

  std::shared_ptr<capture_shared> shared_;
  engine::bulk_io& io_;
  int stage_, replica_;
  actors::actor_ref coordinator_;
  int copies_;
  policy_limits limits_;
  durable_target durable_;
  std::size_t last_w_ = 1;  // the W of the newest slot shipped (the pool's regions per window)
  // Durable windows kept beside checkpoint.keep's (WindowPersisted.durableKept).
  std::set<std::uint64_t> durable_kept_;
  std::vector<actors::actor_ref> targets_;
  // The head placed this stage's copies (set_targets called): an empty targets_ then means no
  // other worker can hold one (a job of one worker and no spare), not "not yet placed". Its
  // windows are whole with its own copy alone: the durable tier writes them, and a loss of
  // this worker goes back to disk.
  bool placed_ = false;
  engine::copy_flip_hook copy_flip_;
  std::map<std::pair<std::uint64_t, std::uint32_t>, pending_slot> pending_;
  // Shipped, not offered yet (small slots wait for their window's last one: flush()).
  std::vector<std::pair<std::uint64_t, std::uint32_t>> unsent_;
  std::uint64_t unsent_bytes_ = 0;
  std::map<std::uint64_t, std::vector<bool>> replicated_;  // window -> [slot]
  std::map<std::uint64_t, transport::bulk_region> leases_;
  std::uint64_t next_lease_ = 1;
};

}  // namespace moevement::recovery
