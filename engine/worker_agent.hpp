// The worker agent: the first actor of every worker process. It says hello to the coordinator
// (where this process listens), and on Assign learns every peer's address, joins the cluster,
// builds its stage (stage_registry) and spawns the stage actor, or idles as a spare. Shutdown
// ends the process cleanly.
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>

#include "actors/system.hpp"
#include "engine/bulk_io.hpp"
#include "engine/checkpoint.hpp"
#include "engine/engine.capnp.h"
#include "engine/hooks.hpp"
#include "engine/stage_registry.hpp"
#include "transport/ucx_link.hpp"

namespace moevement::engine {

// Every peer's address from an Assign into `link` (this node and the head skipped: the head's
// address is known already); a host name over 255 bytes is not one of ours and is skipped.
void add_assigned_peers(transport::ucx_link& link, const actors::actor_system& system,
                        capnp::List<wire::Peer>::Reader peers);

class worker_agent : public actors::actor {
 public:
  using interface =
      actors::interface<actors::tell_t<wire::Assign>, actors::tell_t<wire::Restore>,
                        actors::tell_t<wire::Shutdown>, actors::ask_t<wire::Judge, wire::Judged>,
                        actors::ask_t<wire::StageProbe, wire::StageProbed>>;

  // on_exit(status, message): the process should end (Shutdown: 0; a failure: 1).
  // checkpoints: the job's checkpoint policy in this process (empty: policy none).
  // faults: the failure injections of the stage this process runs (empty: none).
  worker_agent(transport::ucx_link& link, const stage_registry& registry,
               std::function<void(int, const std::string&)> on_exit,
               checkpoint_factory checkpoints = {}, fault_factory faults = {});

  // Tells the coordinator this worker is up (call once the agent has started); once assigned,
  // tells a standby head that took over, with the role held.
  // domain: the failure domain (Slurm node name; empty: the host).
  void say_hello(actors::actor_ref coordinator, const std::string& host,
                 const std::string& domain = "");
  bool assigned() const { return assigned_; }

  // Whether a worker holding role (held_stage, held_replica), last restored at
  // held_generation (0: never), takes a Restore of (stage, replica, generation): its own role
  // under a newer generation. The head sends Restores only to a region's members and counts
  // on every one it sends; a worker that held its role since the start takes one too, plain or
  // not (a survivor whose region grew, under ep > 1 and no pipelined replay, before its first
  // Restore went out: it dropped the plain one, and the recovery waited for ever).
  static bool takes_restore(int held_stage, int held_replica, std::uint64_t held_generation,
                            int stage, int replica, std::uint64_t generation) {
    return generation > held_generation && stage == held_stage && replica == held_replica;
  }
  // A second Assign from its own head, with a role, to a spare that holds none and was never
  // restored: the role of a worker lost before training started
  // (coordinator::lost_before_training).
  static bool takes_role_before_training(bool from_its_head, int held_stage, bool has_stage,
                                         bool restored, int stage) {
    return from_its_head && held_stage < 0 && !has_stage && !restored && stage >= 0;
  }

 private:
  asio::awaitable<void> assign(wire::Assign::Reader m);
  // What the Assign said, once the job is known: a spare idles; a role's stage is built from
  // the initial state, or waits for its durable Restore (resume).
  asio::awaitable<void> take_role(int stage, int replica, bool resume);
  // A second Assign: from a standby head that took over (say_hello again first), or from its
  // own head giving this spare the role of a worker lost before training started.
  asio::awaitable<void> taken_over(wire::Assign::Reader m);
  asio::awaitable<void> restore(wire::Restore::Reader m);
  asio::awaitable<void> shutdown(wire::Shutdown::Reader m);
  // An idle spare replays a stage whose replicas disagree, for the head to judge them
  // (docs/recovery.md "Silent data corruption"); it stays a spare.
  asio::awaitable<void> judge(wire::Judge::Reader m, wire::Judged::Builder out);
  // The head's stuck-stage probe (cluster.iteration_timeout_ms): where this worker's stage's
  // compute thread is, read from its compute_watch.
  asio::awaitable<void> probe(wire::StageProbe::Reader m, wire::StageProbed::Builder out);
  // Spawns the stage actor for `model` and tells the coordinator (StageReady).
  // replacement: rebuilt on this spare (Restore) rather than assigned at the start.
  void start_stage(stage_setup setup, std::unique_ptr<stage_model> model, bool replacement);
  // snapshot_lost: a restore failed for want of a snapshot copy (engine::snapshot_lost).
  // mismatch_at >= 0: it failed for a send of that iteration its replay computed otherwise
  // (replay_mismatch).
  void report(const actors::actor_ref& stage, const std::string& error, bool snapshot_lost = false,
              std::int64_t mismatch_at = -1);

  transport::ucx_link& link_;
  const stage_registry& registry_;
  std::function<void(int, const std::string&)> on_exit_;
  checkpoint_factory checkpoints_;
  fault_factory faults_;
  std::unique_ptr<bulk_io> bulk_;
  std::unique_ptr<worker_checkpoint> checkpoint_;
  std::future<void> prewarmed_;  // a GPU spare's CUDA context, made while it idles
  std::optional<job_config> job_;
  actors::actor_ref coordinator_;
  int stage_index_ = -1, replica_ = -1;
  bool assigned_ = false, restored_ = false;
  std::uint64_t generation_ = 0;  // of the Restore this replacement last answered
  actors::actor_ref stage_;
  actors::actor_ref experts_;  // the stage's expert router actor (parallel.ep > 1)
};

}  // namespace moevement::engine
