// Sparse-to-dense conversion (paper section 3.3 and appendix A), in process: rebuild every
// replica of one stage (its recovery group: the replicas share all-reduced gradients) at the
// start of iteration t from the stage's persisted window and its neighbours' upstream logs.
//
// With the window's slots 0..W-1 holding the state at the start of iterations w0 .. w0+W-1:
//   load slot 0 (its full operators active, every other operator frozen with slot 0's compute
//   weights); replay w0 on every replica from the logged boundary inputs; reduce the weight
//   gradients across replicas (left fold in replica order); apply the logged step plan (only
//   active operators move); load slot 1 (its full operators become active, the still-frozen
//   take slot 1's compute weights); replay w0+1; ... until every operator is active; then
//   replay, all active, up to t-1. The result is bit-identical to the stage that failed.
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
  int stage = 0, stages = 1, micro_batches = 1;
  std::int64_t target_iteration = 0;  // t: rebuild the state at the start of t
  // [replica][slot]: each replica's persisted window (serialised slots, slot order).
  std::vector<std::vector<std::span<const std::byte>>> windows;
  // [replica]: the log of stage-1's replica (activations it sent to this stage; empty on the
  // first stage) and of stage+1's replica (gradients it sent back; empty on the last stage).
  std::vector<const log_store*> upstream, downstream;
  // Optional [replica]: this stage's own log, when it survived somewhere; every tensor the
  // replay sends is then checked against it bit for bit.
  std::vector<const log_store*> own;
  // Step plans of w0 .. t-1 (the same on every stage: take them from any survivor).
  const std::map<std::int64_t, step_record>* steps = nullptr;
  models::train_config train;
  // Every window empty (none was persisted yet): the replicas as given are the initial state
  // (freshly built), and the replay runs from initial_iteration (0) to t.
  std::int64_t initial_iteration = 0;
  // Called with every tensor the replay sends (to rebuild the stage's own upstream log).
  std::function<void(std::int64_t iteration, int micro_batch, log_direction dir,
                     std::size_t replica, std::span<const float> tensor)>
      on_sent;
};

struct conversion_report {
  std::uint64_t window = 0;
  std::int64_t first_iteration = 0;  // w0
  int iterations_replayed = 0;       // t - w0
  // [slot]: operators active after loading slot j (the last is every operator).
  std::vector<std::size_t> active_after_slot;
  // Replica-iterations replayed with frozen operators, and tensors checked against `own`.
  int sparse_replays = 0;
  std::size_t tensors_checked = 0;
};

// replicas[d]: replica d of the stage (a fresh stage_model, as a replacement is); its
// operators are overwritten. Throws conversion_error (or snapshot_error for a slot that does
// not verify, wrapped with where it came from) and leaves the stage unusable on error.
conversion_report sparse_to_dense(std::span<engine::stage_model* const> replicas,
                                  const conversion_input& in);

}  // namespace moevement::recovery
