// Where checkpoint policies (recovery/) attach to the engine. The engine calls these at fixed
// points; the default does nothing (policy `none`). All calls run on the stage's compute
// thread, in iteration order, so an implementation sees a consistent stage.
#pragma once

#include <cstdint>
#include <ctime>
#include <functional>
#include <optional>
#include <span>
#include <utility>

#include "actors/actor_ref.hpp"
#include "models/model.hpp"
#include "models/operator_state.hpp"

namespace moevement::engine {

enum class boundary : std::uint8_t { activation, gradient };

// Failure injection (`moevement launch --inject kill:...,phase=P`): the points of an iteration
// at which a stage actor calls its fault hook, on the actor thread. The hook may end the
// process there (raise(SIGKILL)) or stop it (SIGSTOP), or return true: the stage's compute
// thread then blocks for ever, its process and heartbeats going on (a hung kernel). forward /
// backward: as the stage starts its first forward / backward micro-batch of the iteration (its
// input is there); step: on the coordinator's Step, before applying it; snapshot: after the step
// was applied and reported (Stepped), with the slot's capture just handed to the policy (in flight,
// no copy made).
enum class fault_point : std::uint8_t { forward, backward, step, snapshot };
using fault_hook = std::function<bool(std::int64_t iteration, fault_point point)>;
// Silent corruption (`--inject flip:...`): on the compute thread, right after the step of
// `iteration` was applied (the compute weights derived from the master), with the stage's
// operators in its own order; it may change their bytes.
using corruption_hook =
    std::function<void(std::int64_t iteration, std::span<models::operator_state* const> ops)>;
// Silent corruption of a snapshot copy (`--inject flip:...,target=slot`): for the slot the
// step of `iteration` captures, the bit (0..7) to flip in the middle byte of the copy its
// first holder (the lowest node) stores, or -1.
using copy_flip_hook = std::function<int(std::int64_t iteration)>;
// Silent corruption of a boundary tensor as it is computed (`--inject flip:...,target=
// activation`): on the compute thread, the activation of micro-batch `mb` of `iteration`
// before it is logged and sent; it may change its bytes.
using send_flip_hook =
    std::function<void(std::int64_t iteration, int mb, std::span<float> activation)>;
struct fault_hooks {
  fault_hook at;               // empty: no kill, hang or stall of this stage
  corruption_hook after_step;  // empty: no flip of its weights
  copy_flip_hook copy_flip;    // empty: no flip of a snapshot copy
  send_flip_hook send_flip;    // empty: no flip of an activation
};
// The worker agent asks for the hooks of the stage it starts: replacement is true for a stage
// rebuilt on a spare (Restore), false for one given its role at the start (Assign).
using fault_factory = std::function<fault_hooks(int stage, int replica, bool replacement)>;

// Where a step's checkpoint goes, as the head planned it. Under moevement the head places
// every step's slot: windows of W_sparse steps back to back, W re-chosen at a window's start
// (recovery/window_plan.hpp), so the stages never compute it from the iteration.
struct checkpoint_place {
  int w_sparse = 0;          // its window's size (the baselines: the interval k); 0: none yet
  std::uint64_t window = 0;  // moevement: the window this step's slot belongs to
  std::uint32_t slot = 0;    // and its slot (0: the step that begins the window)
};

// What the coordinator decided for checkpointing at this step (policy moevement).
struct checkpoint_step {
  checkpoint_place place;  // w_sparse 0: not chosen yet (nothing to capture)
  // Per operator: tokens routed to it in this iteration, summed over the stage's replicas in
  // replica order (so every replica computes the same sparse schedule). Empty: no counts.
  std::span<const double> popularity;
};

// What a policy reports after each step (the run log's per-iteration checkpoint columns).
struct checkpoint_stats {
  std::uint64_t snapshot_bytes = 0;       // bytes of the slot the last step captured
  double stall_s = 0.0;                   // how long this step waited for the previous capture
  std::uint64_t snapshot_host_bytes = 0;  // host memory of this stage's snapshot buffers
  std::uint64_t log_host_bytes = 0;       // host memory of its upstream log
  // Of snapshot_bytes, those in memory the link allocated (replicas on the same host read it
  // with one RMA get; the rest is heap memory, read by rendezvous).
  std::uint64_t snapshot_lent_bytes = 0;
  // Replicas of this stage replica's slots so far: mapped by a replicator on its host
  // (checkpoint.share_memory), or pulled as a copy.
  std::uint64_t replica_maps = 0, replica_pulls = 0;
  // CPU time (of the thread that made it) of the last capture: what checkpointing costs the
  // host's cores, whatever the wall clock shows on a busy host.
  double capture_cpu_s = 0.0;
  // CPU time the process's actor thread spent replicating snapshots (offers, answers, maps)
  // between the last two steps: it shares the cores as the capture does, per offer, not per byte.
  double replication_cpu_s = 0.0;
  // Of the last capture's bytes, those written into memory no capture had written before
  // (first touches: the kernel makes each page then, and that, not the copy, is most of a
  // fresh slot's CPU time; a one-off the window tuner does not count as the steady cost).
  std::uint64_t fresh_bytes = 0;
  // Windows this stage replica captured nothing of (so far): it held as many windows as it may
  // and the job persisted none within the wait; its memory stays bounded meanwhile.
  std::uint64_t windows_skipped = 0;
};

// CPU seconds the calling thread has used so far.
inline double thread_cpu_seconds() {
  timespec t{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return double(t.tv_sec) + double(t.tv_nsec) * 1e-9;
}

class stage_hooks {
 public:
  virtual ~stage_hooks() = default;
  // Whether these hooks may be destroyed on any thread (after the stage's compute thread
  // ended): the stage actor then drops them, and its model after them, off the actor thread
  // (actor_system::dispose), where waiting out a capture in flight or freeing the state
  // holds no heartbeat. Hooks that hold transport handles say no.
  virtual bool disposable() const { return false; }
  // Before on_step of `iteration` (compute thread).
  virtual void before_step(std::int64_t /*iteration*/, const checkpoint_step& /*decided*/) {}
  // The step of `iteration`, just before it is applied: the loss gradient its backwards used
  // and the plan of its optimizer step (job-wide), which a replay of this iteration must reuse.
  virtual void on_step(std::int64_t /*iteration*/, float /*loss_grad*/,
                       const models::step_plan& /*plan*/) {}
  // After the optimizer step of `iteration` (applied or skipped): the snapshot point. ops are
  // the stage's operators in canonical order, as they are after the step.
  virtual void after_step(std::int64_t /*iteration*/,
                          std::span<models::operator_state* const> /*ops*/) {}
  // Every tensor this stage sends across a stage boundary: activations downstream, gradients
  // upstream (the upstream log). `tensor` stays unchanged until the next settle_sends() or
  // before_step() returns: the engine settles before it writes or frees those bytes, so the
  // hooks may copy them later, off the compute thread.
  virtual void on_boundary_send(std::int64_t /*iteration*/, int /*micro_batch*/, boundary /*kind*/,
                                std::span<const float> /*tensor*/) {}
  // Whatever on_boundary_send left to do with the sent bytes, done before this returns.
  virtual void settle_sends() {}

  // On the stage actor's thread (not the compute thread), after the step's after_step
  // returned: where a policy ships what it captured (never blocking).
  virtual void after_step_shipped(std::int64_t /*iteration*/) {}
  // On the stage actor's thread: where this stage's snapshot copies go (the coordinator's
  // wiring; sent again after a recovery).
  virtual void on_wired(std::span<const actors::actor_ref> /*replicators*/) {}
  // On the stage actor's thread, after after_step_shipped.
  // What the stage reports as this iteration's popularity (summed over replicas by the
  // coordinator): routed tokens, or gate probabilities for a soft-count ordering.
  virtual bool soft_popularity() const { return false; }
  virtual checkpoint_stats stats() const { return {}; }
  // On the stage actor's thread: the newest window the job persisted that this stage holds
  // (its id and first iteration), for a standby head that takes over (StageState).
  virtual std::optional<std::pair<std::uint64_t, std::int64_t>> persisted_window() const {
    return std::nullopt;
  }
};

}  // namespace moevement::engine
