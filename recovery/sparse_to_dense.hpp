// Sparse-to-dense conversion (paper section 3.3 and appendix A), in process: rebuild every
// replica of a region of stages (its recovery group: each stage's replicas share all-reduced
// gradients; contiguous lost stages recover jointly) at the start of iteration t from the
// region's persisted windows and the upstream logs of the healthy stages just outside it.
//
// With the window's slots 0..W-1 holding the state at the start of iterations w0 .. w0+W-1:
//   load slot 0 (its full operators active, every other operator frozen with slot 0's compute
//   weights); replay w0 on every replica from the logged boundary inputs (tensors between
//   the region's stages pass in memory: engine::replay_region); reduce the weight gradients
//   across replicas (left fold in replica order); apply the logged step plan (only active
//   operators move); load slot 1 (its full operators become active, the still-frozen take
//   slot 1's compute weights); replay w0+1; ... until every operator is active; then
//   replay, all active, up to t-1. The result is bit-identical to the stages that failed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <stdexcept>
#include <vector>

#include "engine/stage_model.hpp"
#include "recovery/log_store.hpp"
#include "recovery/sparse_capture.hpp"

namespace moevement::recovery {

// A conversion that cannot proceed: a slot that does not verify, a missing log entry or
// step plan, windows of different replicas that disagree. Says which piece is missing.
class conversion_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct conversion_input {
  // The region: stages stage .. stage + region_stages - 1 of a pipeline of `stages`.
  int stage = 0, region_stages = 1, stages = 1, micro_batches = 1;
  std::int64_t target_iteration = 0;  // t: rebuild the state at the start of t
  // [j * replicas + replica][slot]: the persisted window of stage `stage + j`'s replica
  // (serialised slots, slot order).
  std::vector<std::vector<std::span<const std::byte>>> windows;
  // Optional [i], as windows: the replica whose window was given where it is another than i's
  // own (a replica fenced for silent corruption is rebuilt from a trusted replica's copies of
  // the same stage and shard; docs/recovery.md "Silent data corruption"); -1 or empty: its own.
  std::vector<int> window_replicas;
  // [replica]: the log of the replica of the stage before the region (activations it sent
  // to the region; empty when the region starts at stage 0) and of the stage after it
  // (gradients it sent back; empty when the region ends at the last stage).
  std::vector<const log_store*> upstream, downstream;
  // Optional [j * replicas + replica]: the stage's own log, when it survived somewhere; every
  // tensor the replay sends is then checked against it bit for bit.
  std::vector<const log_store*> own;
  // Step plans of w0 .. t-1 (the same on every stage: take them from any survivor).
  const std::map<std::int64_t, step_record>* steps = nullptr;
  models::train_config train;
  // Every window empty (none was persisted yet): the replicas as given are the initial state
  // (freshly built), and the replay runs from initial_iteration (0) to t.
  std::int64_t initial_iteration = 0;
  // The recovery group replays in parallel (recovery/group_replay.hpp): the replicas given are
  // this worker's, replica `first_replica` of each stage of the region, and `reduce` sums
  // their gradients after each iteration with the other members' (every stage's, stage
  // order, in place) in replica order. Unset: the replicas given are the whole group, summed
  // here. upstream, downstream and own are indexed by the replicas given.
  std::size_t first_replica = 0;
  std::function<void(std::int64_t iteration, std::span<float> gradients)> reduce;
  // Under expert parallelism with `reduce` (each member replays its own replica, and its EP
  // group's members compute each other's expert rows through the exchange each replica's
  // model was given: engine::expert_router across workers): experts_begin(it) is called once
  // this member's stages began iteration it (rows of it may be served from then on),
  // experts_end(it) once it replayed it (it returns when every source's rows of it were
  // served here). `reduce` then gets group_layout{...}'s buffer: the non-expert gradients,
  // then every source's part of the member's expert blocks (fold_group says how it sums).
  std::function<void(std::int64_t iteration)> experts_begin, experts_end;
  // A joint region replayed as a pipeline across workers: the region given (region_stages 1,
  // one replica) is one stage of a larger region whose other stages other workers replay at
  // the same time, each its own. live_before: the stage before is such a member, and its
  // activations come from take_live as this stage needs them (not from `upstream`);
  // live_after: the same for the gradients of the stage after. on_sent then gets each tensor
  // the moment it is made (those members wait for it). take_live may wait; it throws to give
  // up (the replay ends with that error).
  bool live_before = false, live_after = false;
  std::function<std::vector<float>(std::int64_t iteration, int mb, log_direction dir)> take_live;
  // Called with every tensor the replay sends (to rebuild the stages' own upstream logs).
  std::function<void(int stage, std::int64_t iteration, int micro_batch, log_direction dir,
                     std::size_t replica, std::span<const float> tensor)>
      on_sent;
};

struct conversion_report {
  std::uint64_t window = 0;
  std::int64_t first_iteration = 0;  // w0
  int iterations_replayed = 0;       // t - w0
  // [slot]: operators of the region active after loading slot j (the last is every operator).
  std::vector<std::size_t> active_after_slot;
  // Stage-replica-iterations replayed with frozen operators, and tensors checked against `own`.
  int sparse_replays = 0;
  std::size_t tensors_checked = 0;
};

// The gradients a member of a parallel group replay hands `reduce`: `dense` floats of the
// region stages' non-expert operators (every operator without expert parallelism), then, for
// each source s < ep, `block` floats: source s's part of the member's expert blocks (every
// region stage's, stage order).
struct group_layout {
  std::size_t dense = 0, block = 0;
  int ep = 1;
  std::size_t floats() const { return dense + block * std::size_t(ep); }
};

// The layout of one member's models (its replica of each region stage) at expert parallelism
// `ep`: under ep > 1 the non-experts are dense and each stage's expert_shard gives the block.
group_layout group_layout_of(std::span<engine::stage_model* const> models, int ep);

// The group's sum as the member replaying replica `me` keeps it, folded one member at a time
// in replica order: fold_group(l, me, d, g_d, sum) for d = 0, 1, ... The non-experts become
// g_0 + g_1 + ... (as training sums them); the expert block of me's EP rank k becomes the sum
// over every replica r of the rows it routed there, in replica order (kept as source r % ep by
// the copy of the block in r's EP group: replica (r / ep) * ep + k), as training sums them
// (engine::local_group). `sum` holds dense + block floats.
void fold_group(const group_layout& l, std::size_t me, std::size_t d, std::span<const float> g,
                std::span<float> sum);

// replicas[j * replicas + d]: replica d of stage `stage + j` (a fresh stage_model, as a
// replacement is); its operators are overwritten. Under expert parallelism
// (train.expert_parallel > 1) either the whole group is given (no `reduce`): each EP group's
// replicas compute each other's expert rows through an engine::local_group meanwhile, and each
// block of experts sums every replica's rows in replica order, as training does; or one
// replica, with `reduce` and experts_begin / experts_end (above). Throws conversion_error (or
// snapshot_error for a slot that does not verify, wrapped with where it came from) and leaves the
// stage unusable on error.
conversion_report sparse_to_dense(std::span<engine::stage_model* const> replicas,
                                  const conversion_input& in);

}  // namespace moevement::recovery
