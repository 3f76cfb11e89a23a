// The worker side of policy moevement's recovery (docs/recovery.md): a Restore from the
// coordinator rebuilds this worker's stage replica at the start of the target iteration,
// jointly with the region of contiguous lost stages it lies in. The region's windows come
// from the replicators that hold their slots (or from the durable tier's files), the boundary
// tensors from the logs of the healthy neighbours just outside the region, and sparse-to-dense
// conversion replays up to the target (recovery/sparse_to_dense.hpp).
//
// Who replays what: with a group (the Restore names one exchange per replica), this worker
// replays only its own replica of each region stage and sums gradients with the group's
// other members, each on its own worker (recovery/group_replay.hpp); without one it replays
// every replica of the region itself. With a pipeline (a joint region: the Restore names one
// exchange per region stage), it replays only its own stage, the boundary tensors with the
// region's other stages passing live between their members (boundary_exchange).
#pragma once

#include <asio/awaitable.hpp>

#include <memory>
#include <optional>
#include <vector>

#include "actors/system.hpp"
#include "engine/bulk_io.hpp"
#include "engine/checkpoint.hpp"
#include "engine/engine.capnp.h"
#include "engine/job_config.hpp"
#include "engine/stage_model.hpp"
#include "engine/stage_registry.hpp"
#include "recovery/durable_window.hpp"
#include "recovery/group_replay.hpp"
#include "recovery/log_store.hpp"
#include "recovery/moevement_policy.hpp"
#include "recovery/sparse_capture.hpp"
#include "transport/bulk.hpp"
#include "transport/shared_memory.hpp"

namespace moevement::recovery {

// What a restore leaves for the new stage's checkpoint hooks.
struct restored_stage {
  std::unique_ptr<engine::stage_model> model;
  // What the replay sent from this replica: the new stage's upstream log.
  std::unique_ptr<log_store> log;
  // A surviving replica's schedule state (none: every replica is rebuilt alike).
  std::optional<stage_schedule::state> schedule;
  // The regions (or memory files) this replica's own window was pulled into: the new stage's
  // slot pool starts with them; w: the window's W_sparse.
  std::vector<transport::bulk_region> regions;
  std::vector<transport::shared_memory> files;
  std::size_t w = 0;
  engine::worker_checkpoint::restore_timing timing;
};

// What a restore uses of its worker.
struct restore_context {
  actors::actor_system& system;
  engine::bulk_io& io;
  const engine::job_config& job;
  policy_limits limits;
  durable_writer* durable = nullptr;  // null: checkpoint.durable is off
  std::shared_ptr<group_inbox> inbox;
  std::shared_ptr<group_inbox> boundaries;  // a pipelined region's tensors (boundary_exchange)
  // A survivor replaying its own replica in place (a group replay): what it sent, from its
  // upstream log; every tensor the replay sends is checked against it (a send that differs is
  // silent corruption of what was sent then). Null: nothing to check against.
  const log_store* own_log = nullptr;
};

// Runs one Restore. Throws std::runtime_error (engine::snapshot_lost when every copy of a
// needed slot is gone) with what went wrong.
asio::awaitable<restored_stage> restore_region(restore_context ctx,
                                               engine::wire::Restore::Reader plan,
                                               const engine::stage_factory& factory,
                                               engine::stage_setup setup);

}  // namespace moevement::recovery
