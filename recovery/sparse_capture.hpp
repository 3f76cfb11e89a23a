// The capture half of the `moevement` policy, in process (paper sections 3.2, 3.4, 3.5):
// - stage_schedule: Algorithm 1 over one stage's operators (sizes from the operators,
//   popularity from the gates' routed-token counters), one schedule per window, shared by
//   every replica of the stage so that the whole recovery group freezes the same operators.
// - sparse_capture: the stage_hooks of one (stage, replica): after each optimizer step it
//   copies the window's current slot (full state of the slot's operators, compute weights of
//   the still-frozen ones) into a reused host buffer, logs every boundary tensor it sends and
//   every step's plan, keeps one complete window and one in flight, and drops older windows
//   and the logs no window still needs.
//
// The copy runs on the caller's thread, synchronously; the actor version calls it on a capture
// thread of its own, overlapped with the next iteration (docs/sparse-checkpointing.md). A GPU
// stage's slots are copied from device memory on a side stream (set_device).
//
// Windows: iteration i's step produces slot i % W of window i / W, holding the state at the
// start of iteration i + 1. Window k therefore replays from iteration k*W + 1 and is complete
// (here: persisted; with replicators: once every slot has its copies) after iteration
// k*W + W - 1.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "engine/hooks.hpp"
#include "recovery/log_store.hpp"
#include "recovery/snapshot.hpp"
#include "sim/sparse_schedule.hpp"

namespace moevement::recovery {

// What "popularity" orders the operators of a window (paper section 3.2 and appendix B).
enum class ordering : std::uint8_t {
  popularity,     // tokens routed to each expert in the window before (the default)
  soft_count,     // summed gate probabilities instead of routed tokens
  time_decayed,   // A(t) = alpha A(t-1) + (1 - alpha) count(t), per iteration
  capacity_aware  // tokens routed / the expert's capacity (heterogeneous experts)
};
// "popularity", "soft-count", "time-decayed", "capacity-aware"
const char* ordering_name(ordering o);
// Throws std::invalid_argument listing the names.
ordering parse_ordering(const std::string& name);

// How a stage's sparse schedule is chosen. The one place these defaults live.
struct sparse_config {
  // Iterations per window. 0: Algorithm 1's FindWindowSize from the profile below (see
  // find_w_sparse; every stage must then use the largest W any stage needs).
  int w_sparse = 0;
  double iteration_seconds = 0.0;      // profiled fault-free iteration time
  double bandwidth_bytes_per_s = 0.0;  // profiled device-to-host snapshot bandwidth
  sim::reorder_thresholds reorder{};   // section 3.5: 10% change for 25% of the experts
  ordering order_by = ordering::popularity;
  double decay_alpha = 0.9;  // time_decayed: weight of the history
  // capacity_aware: tokens each operator can take per iteration (empty: all equal, which
  // orders as popularity does: our presets' experts are homogeneous).
  std::vector<double> capacities{};
  // Whether the counts the stage reports are gate probabilities (soft_count) or tokens.
  bool soft() const { return order_by == ordering::soft_count; }
};

// Algorithm 1 sizes of one operator: compute weights, FP32 master, Adam m + v.
sim::sparse_op sparse_sizes(const models::operator_state& op);

// FindWindowSize over every stage's operators (in index order): the W_sparse all stages
// agree on, the largest any stage needs so that every stage's slot fits the iteration.
int find_w_sparse(std::span<const std::vector<models::operator_state*>> stages,
                  double iteration_seconds, double bandwidth_bytes_per_s);

class stage_schedule {
 public:
  // ops: the stage's operators in canonical order (only sizes, kinds and names are read).
  // Throws std::invalid_argument when w_sparse is 0 and the profile is missing.
  stage_schedule(const sparse_config& config, std::span<models::operator_state* const> ops);

  // The W it was made with: every window's, in process; under moevement_policy the head
  // places each step (engine::checkpoint_place) and a window's W may differ from it.
  int w_sparse() const { return w_; }
  int o_active() const { return o_active_; }
  std::size_t operators() const { return n_; }

  // Adds one replica's popularity counters after the step of `iteration` (the gates'
  // routed-token counts, attributed to each gate's experts), counted for `window` (the
  // window that step's slot belongs to; by default iteration / w_sparse()).
  void add_popularity(std::int64_t iteration, std::span<models::operator_state* const> ops,
                      std::optional<std::uint64_t> window = std::nullopt);
  // Adds per-operator counts (engine::operator_popularity, summed over replicas).
  void add_counts(std::int64_t iteration, std::span<const double> counts,
                  std::optional<std::uint64_t> window = std::nullopt);

  // The schedule of window `window` (fixed once asked for): the previous window's order, or
  // a new ascending-popularity order when the popularity of the window before moved enough
  // (sim::should_reorder). Non-expert operators are treated as the most popular (they see
  // every token), so experts come first, as in the paper's Figure 6.
  // w: the window's size (0: w_sparse()).
  const std::vector<sim::schedule_slot>& window_schedule(std::uint64_t window, int w = 0);
  std::uint64_t reorders() const { return reorders_; }

  // Everything the next windows' schedules depend on (the order, the popularity it came
  // from, the counts so far, the schedules already fixed). A replacement takes it over from
  // a surviving replica of its stage, so that the recovery group keeps freezing the same
  // operators in later windows.
  struct state {
    std::vector<std::size_t> order;
    std::vector<double> order_popularity;
    std::map<std::uint64_t, std::vector<double>> counts;
    std::map<std::uint64_t, std::vector<sim::schedule_slot>> schedules;
    std::uint64_t reorders = 0;
    std::vector<double> decayed;  // time_decayed: the moving average so far
    std::vector<double> pending;  // time_decayed: counts of pending_iteration not folded yet
    std::int64_t pending_iteration = -1;
    std::uint64_t pending_window = 0;
  };
  state save() const {
    return {order_,   order_popularity_,  counts_,        schedules_, reorders_, decayed_,
            pending_, pending_iteration_, pending_window_};
  }
  // Throws std::invalid_argument when `s` does not fit this stage's operators.
  void load(state s);

 private:
  sparse_config config_;
  std::size_t n_;
  int w_ = 1, o_active_ = 1;
  std::vector<bool> is_expert_;
  std::vector<std::size_t> order_;
  std::vector<double> order_popularity_;  // expert popularity the current order came from
  std::map<std::uint64_t, std::vector<double>> counts_;  // [window][operator]
  std::map<std::uint64_t, std::vector<sim::schedule_slot>> schedules_;
  std::uint64_t reorders_ = 0;
  void fold_pending();
  std::vector<double> decayed_;  // [operator], time_decayed only
  std::vector<double> pending_;
  std::int64_t pending_iteration_ = -1;
  std::uint64_t pending_window_ = 0;  // the window pending_iteration_'s counts go to
};

// The plan a replay of one iteration must apply (it depends on every stage's gradients).
struct step_record {
  float loss_grad = 0.0f;
  models::step_plan plan;
};

// Memory for one captured slot. The capture uses the heap unless it was given a
// slot_allocator: a distributed stage lends it memory its link allocated, which replicas on
// the same host read with one RMA get instead of a copy through the TCP loopback.
struct slot_memory {
  std::span<std::byte> bytes;   // the capacity
  std::shared_ptr<void> owner;  // keeps the memory (or gives it back to its lender)
  bool lent = false;            // from a slot_allocator, not the heap
  bool fresh = true;            // never written yet (its pages are made as the capture writes)
};
// Called on the capture thread (under the capture's lock): memory of at least `bytes`, or
// nullopt (none free: the capture uses the heap this time and asks again at the next window).
using slot_allocator = std::function<std::optional<slot_memory>(std::size_t bytes)>;

// A complete window's slots, slot order (views into the capture's buffers).
struct window_view {
  std::uint64_t window = 0;
  std::int64_t first_iteration = 0;  // the first iteration a conversion replays
  std::vector<std::span<const std::byte>> slots;
};

class sparse_capture : public engine::stage_hooks {
 public:
  // schedule: the stage's (shared by its replicas, outlives this). scaler: the job's loss
  // scaler, read at each capture (nullptr: recorded as disabled with scale 1).
  sparse_capture(stage_schedule& schedule, int stage, int replica,
                 const models::loss_scaler* scaler = nullptr);
  // Distributed use (one process per replica): no schedule until the coordinator chose
  // W_sparse (set_schedule); popularity comes agreed across replicas (set_counts before each
  // after_step); windows are dropped only when the job persisted a newer one (drop_before).
  sparse_capture(int stage, int replica);
  void set_schedule(stage_schedule& schedule) { schedule_ = &schedule; }
  bool has_schedule() const { return schedule_ != nullptr; }
  void set_counts(std::span<const double> counts) { counts_.assign(counts.begin(), counts.end()); }
  // Where slot memory comes from (default: the heap).
  void set_allocator(slot_allocator allocator) { allocator_ = std::move(allocator); }
  // A stage whose state lives on a GPU (engine::device_state): slots are then copied from
  // device memory on its side stream, into page-locked slot memory (the allocator's memory is
  // page-locked when it comes; the heap's is the device's pinned memory). Set it before the
  // first capture.
  void set_device(engine::device_state* device) { device_ = device; }
  // Captures nothing of `window` (memory bounded: the job persisted no window for too long;
  // moevement_policy decides). It never completes here, so the job persists none of it; the
  // next window is captured as usual. Counted in windows_skipped().
  void skip_window(std::uint64_t window);
  std::uint64_t windows_skipped() const { return windows_skipped_; }
  // Drops windows older than `window` but those in `keep`, and logs and step plans before
  // first_iteration (before keep_from where that is >= 0 and earlier: a shadow check replays
  // from a kept window).
  void drop_before(std::uint64_t window, std::int64_t first_iteration,
                   const std::set<std::uint64_t>& keep = {}, std::int64_t keep_from = -1);
  // Marks the windows newer than the persisted one whose first slot was captured by a step
  // before `iteration` (a recovery resumed there: they can no longer be persisted): they stop
  // counting in windows_held(). Their buffers stay until the next persisted window drops
  // them, since a replicator may still be reading a slot. Returns how many were marked.
  std::size_t abandon_ended_before(std::int64_t iteration);
  // The durable tier writes a persisted window from another thread: a pinned window keeps its
  // buffers (unchanged: captures go to newer windows) through drop_before until unpinned.
  void pin(std::uint64_t window) { pinned_.insert(window); }
  void unpin(std::uint64_t window);
  // The slots of a complete window (views into its buffers, slot order); empty when the
  // window is not complete here.
  std::vector<std::span<const std::byte>> window_slots(std::uint64_t window) const;
  // The slot captured by the step of `iteration`, if it was (distributed use: to ship it).
  std::optional<std::span<const std::byte>> slot_of(std::int64_t iteration) const;
  // Where the step of `iteration` captured (its window, slot, and the window's size), if a
  // window held here has that step.
  std::optional<engine::checkpoint_place> place_of(std::int64_t iteration) const;
  // Whether every slot of `window` was captured in this process.
  bool complete(std::uint64_t window) const;
  std::int64_t first_iteration(std::uint64_t window) const;
  // The newest window the job persisted (drop_before), held here or not.
  std::optional<std::uint64_t> persisted_id() const { return persisted_; }
  // Which operators the captured slots of `window` hold, as a digest: equal on every replica
  // of a stage, or a later conversion of the recovery group fails (0: no such window).
  std::uint64_t schedule_digest(std::uint64_t window) const;
  log_store& mutable_log() { return log_; }

  void on_step(std::int64_t iteration, float loss_grad, const models::step_plan& plan) override;
  // begin_capture, write, end_capture.
  void after_step(std::int64_t iteration, std::span<models::operator_state* const> ops) override;

  // after_step in three parts, for a caller that must not hold its lock over the copy (the
  // actor version: its agent takes the same lock on the actor thread, which every actor of the
  // process shares): begin_capture (locked) chooses the slot and sizes its buffer (nullopt:
  // nothing to capture at this step); write() (unlocked) copies the state into it, from the
  // device or from the host operators; end_capture (locked) counts the slot in.
  struct slot_write {
    std::int64_t iteration = 0;
    std::span<std::byte> bytes;  // the slot's buffer
    std::shared_ptr<void> keep;  // its memory, alive whatever is dropped meanwhile
    bool lent = false;
    bool fresh = false;  // the buffer was never written before
    snapshot_tag tag;
    models::loss_scaler scaler;
    std::vector<const models::operator_state*> ops;
    std::vector<capture_kind> kinds;
    engine::device_state* device = nullptr;  // copies from the device; nullptr: from the host
    void write() const;
  };
  // place: where the head put this step (moevement_policy); by default slot
  // iteration % W of window iteration / W, W the schedule's.
  std::optional<slot_write> begin_capture(std::int64_t iteration,
                                          std::span<models::operator_state* const> ops,
                                          std::optional<engine::checkpoint_place> place = {});
  void end_capture(const slot_write& job);
  void on_boundary_send(std::int64_t iteration, int micro_batch, engine::boundary kind,
                        std::span<const float> tensor) override;
  // The same send, its bytes already copied (log_copier).
  void log_sent(std::int64_t iteration, int micro_batch, engine::boundary kind,
                std::vector<std::byte> bytes);

  // The newest complete window, if any.
  std::optional<window_view> persisted() const;
  // The boundary tensors this replica sent (tagged with its replica), from the persisted
  // window's first iteration on.
  const log_store& log() const { return log_; }
  const std::map<std::int64_t, step_record>& steps() const { return steps_; }

  // Windows held for the capture's own bounds: a pinned window older than the persisted one is
  // only waiting for the durable writer and does not count (at most one extra window), nor
  // does a kept one (drop_before's `keep`, at most two).
  std::size_t windows_held() const;
  std::size_t snapshot_bytes_held() const;
  std::size_t last_slot_bytes() const { return last_slot_bytes_; }
  // Whether that slot lies in lent memory (set_allocator), not on the heap.
  bool last_slot_lent() const { return last_slot_lent_; }
  // Whether it was written into memory no capture had written before.
  bool last_slot_fresh() const { return last_slot_fresh_; }
  // Boundary sends whose bytes differed from an earlier entry of the same key.
  std::uint64_t log_conflicts() const { return log_conflicts_; }

 private:
  // One slot: `size` bytes used of `memory` (kept across windows while it fits).
  struct slot_buffer {
    slot_memory memory;
    std::size_t size = 0;
    std::span<std::byte> bytes() const { return memory.bytes.first(size); }
  };
  struct window_buffers {
    std::int64_t first_iteration = 0;
    std::vector<slot_buffer> slots;  // [slot]
    int captured = 0;
    std::uint64_t schedule_digest = 1469598103934665603ull;  // FNV-1a of the slots' schedules
  };
  void persist(std::uint64_t window);
  void trim_spares();
  // A window held only because drop_before's `keep` named it (older than the persisted one).
  bool kept_before_persisted(std::uint64_t id) const {
    return persisted_ && id < *persisted_ && kept_.contains(id);
  }
  // Drops the windows before `window` (not the pinned ones), recycling their buffers.
  void recycle_before(std::uint64_t window);
  // A dropped window's buffers: to a newer window's slots that have none yet, else a spare.
  void recycle(std::vector<slot_buffer> slots);
  // Makes `buf` hold n bytes: lent memory when the allocator has some (replacing heap memory
  // too), else the heap, reusing what fits.
  void fit(slot_buffer& buf, std::size_t n);
  // With a device: page-locks memory from the allocator for the device's copies.
  void page_lock(slot_memory& m);
  void unpinned(const char* why);  // counts it; says so on stderr the first time

  stage_schedule* schedule_ = nullptr;
  int stage_, replica_;
  bool distributed_ = false;
  std::vector<double> counts_;
  const models::loss_scaler* scaler_;
  std::map<std::uint64_t, window_buffers> windows_;
  std::set<std::uint64_t> pinned_;
  std::set<std::uint64_t> kept_;          // drop_before's `keep`: held past the persisted window
  std::set<std::uint64_t> abandoned_;     // abandon_ended_before: held, not counted
  std::optional<std::uint64_t> skipped_;  // skip_window: the newest window not captured
  std::uint64_t windows_skipped_ = 0;
  std::optional<std::uint64_t> persisted_;
  std::vector<std::vector<slot_buffer>> spare_;  // buffers of dropped windows
  // Windows held as each of the last few windows began (itself included; trim_spares).
  std::array<std::size_t, 4> held_at_starts_{};
  std::size_t starts_ = 0;
  slot_allocator allocator_;
  engine::device_state* device_ = nullptr;
  std::int64_t writing_ = -1;         // the iteration whose slot is between begin and end_capture
  std::uint64_t unpinned_slots_ = 0;  // slot memory the driver would not page-lock
  log_store log_;
  std::map<std::int64_t, step_record> steps_;
  std::size_t last_slot_bytes_ = 0;
  bool last_slot_lent_ = false;
  bool last_slot_fresh_ = false;
  std::uint64_t log_conflicts_ = 0;
};

}  // namespace moevement::recovery
