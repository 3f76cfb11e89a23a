// Where a checkpoint policy (recovery/) lives in a worker process. The launcher gives the
// worker agent a factory; the agent makes one worker_checkpoint once the process has joined
// the job, asks it for the stage's hooks when it runs a stage, and asks it to rebuild a lost
// stage when the coordinator turns this spare into a replacement (Restore). Policy none has
// no factory.
#pragma once

#include <asio/awaitable.hpp>

#include <functional>
#include <memory>
#include <span>
#include <stdexcept>
#include <vector>

#include "actors/system.hpp"
#include "engine/bulk_io.hpp"
#include "engine/engine.capnp.h"
#include "engine/hooks.hpp"
#include "engine/job_config.hpp"
#include "engine/stage_registry.hpp"

namespace moevement::engine {

// Algorithm 1's view of one operator.
struct op_size {
  std::uint64_t compute_bytes = 0, master_bytes = 0, optim_bytes = 0;
};

// Thrown by worker_checkpoint::restore() when every copy of a snapshot the restore needs is
// gone: the coordinator may then fall back to the durable tier (checkpoint.durable).
class snapshot_lost : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Thrown by a restore whose replay sent other bits than the stage logged sending then:
// silent corruption of what was sent (docs/recovery.md "Silent data corruption"), which has
// reached every stage since; the coordinator rolls the job back to before `iteration`.
class replay_mismatch : public std::runtime_error {
 public:
  replay_mismatch(const std::string& what, std::int64_t iteration)
      : std::runtime_error(what), iteration_(iteration) {}
  std::int64_t iteration() const { return iteration_; }  // whose sends differ

 private:
  std::int64_t iteration_;
};

class worker_checkpoint {
 public:
  virtual ~worker_checkpoint() = default;
  // The replicator this process runs for its peers (invalid when the policy has none).
  virtual actors::actor_ref replicator() const = 0;
  // Where the other members of a recovery group replaying in parallel send this worker their
  // gradients (invalid when the policy has no parallel group replay).
  virtual actors::actor_ref group_exchange() const { return {}; }
  // The checkpoint agent of this process's stage, valid once make_hooks() was called.
  virtual actors::actor_ref agent() const = 0;
  // The hooks of the stage this process runs (called once, on the actor thread, after the
  // stage was built; `model` outlives the hooks). Also measures what Algorithm 1 needs.
  virtual std::unique_ptr<stage_hooks> make_hooks(const stage_setup& setup, stage_model& model,
                                                  actors::actor_ref coordinator) = 0;
  // The heavy part of the stage's set-up that needs no actor (a baseline's copy of the initial
  // state, which is also its snapshot cost): called on the thread that built the stage, before
  // every make_hooks() (a policy may require it), so that this node's heartbeats go on meanwhile (a
  // 165 MB stage copied on the actor thread by five processes on two cores went silent past the
  // failure timeout).
  virtual void prepare(const stage_setup& setup, stage_model& model) {
    (void)setup;
    (void)model;
  }
  virtual std::vector<op_size> op_sizes() const = 0;
  virtual double snapshot_bandwidth() const = 0;  // bytes/s, measured by make_hooks()
  // Rebuilds replica `setup.replica` of stage `setup.stage` at the start of the restore's
  // target iteration (on the actor thread; heavy work goes to other threads). Throws with a
  // message saying what was missing. May be called again (a newer generation of the same
  // role, after a cascading failure): the previous stage's hooks are gone by then.
  virtual asio::awaitable<std::unique_ptr<stage_model>> restore(wire::Restore::Reader plan,
                                                                const stage_factory& factory,
                                                                stage_setup setup) = 0;
  // Failure injection: the next stage's snapshot copies to corrupt (fault_hooks::copy_flip);
  // set before make_hooks.
  virtual void set_copy_flip(copy_flip_hook /*flip*/) {}
  // A judge's replay (wire::Judge): rebuilds the plan's replica like restore(), then drops it
  // and returns its operator digests (engine::operator_digests). Nothing of it stays: the
  // worker is still a spare. Throws with a message where there is no verdict.
  virtual asio::awaitable<std::vector<std::uint64_t>> judge(wire::Restore::Reader plan,
                                                            const stage_factory& factory,
                                                            stage_setup setup);
  // What the last restore() spent (for the run log's recovery breakdown).
  struct restore_timing {
    double pull_s = 0.0, replay_s = 0.0;
    std::int64_t iterations_replayed = 0;
    // How it got the window's slots: mapped on this host, or pulled; of the pulled, those
    // whose holder offered a memory-file handle that could not be mapped here (another host).
    std::int64_t slots_mapped = 0, slots_pulled = 0, handles_refused = 0;
    std::int64_t copies_refused = 0;  // slot copies whose checksum failed (another one used)
    std::int64_t log_pieces = 0;      // FetchLog answers pulled (checkpoint.log_fetch_bytes)
    int replay_threads = 0;           // the GEMM threads the replay ran with
  };
  virtual restore_timing last_restore() const { return {}; }
  // A standby head took over (cluster.standby_head) and the stage runs on: its checkpoint
  // actors report to the new coordinator from now on.
  virtual void set_coordinator(actors::actor_ref /*coordinator*/) {}
  // The newest recovery generation this worker's exchanges have begun (0: none), which a new
  // head numbers past (WorkerHello.generation).
  virtual std::uint64_t newest_generation() const { return 0; }
};

inline asio::awaitable<std::vector<std::uint64_t>> worker_checkpoint::judge(wire::Restore::Reader,
                                                                            const stage_factory&,
                                                                            stage_setup) {
  throw std::runtime_error("this checkpoint policy keeps no windows to replay a judge from");
  co_return std::vector<std::uint64_t>{};
}

using checkpoint_factory = std::function<std::unique_ptr<worker_checkpoint>(
    actors::actor_system& system, bulk_io& io, const job_config& job)>;

}  // namespace moevement::engine
