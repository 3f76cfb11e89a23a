// Where a recovery lives on the head: the coordinator's twin of worker_checkpoint
// (engine/checkpoint.hpp). The launcher gives the coordinator a factory (recovery/ has one per
// way of recovering: regions under supervisors for policy moevement, the global rollback for
// the baselines); policy none has none. The coordinator hands its head_recovery, in the
// coordinator's own turns, every loss of a stage's worker, every report of a worker the
// recovery put to work, and its region supervisors' asks and escalations. The recovery drives the
// job back through head_control, which the coordinator implements: the coordinator keeps
// admission, wiring, iterations, pause/abort/resume and the accounting, and holds no recovery
// state of its own.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "actors/system.hpp"
#include "engine/checkpoint.hpp"
#include "engine/engine.capnp.h"
#include "engine/job_config.hpp"
#include "engine/resume_point.hpp"
#include "engine/run_log.hpp"
#include "engine/takeover.hpp"
#include "models/model.hpp"

namespace moevement::engine {

// A worker process as the head knows it.
struct worker_info {
  transport::node_id node = 0;
  std::string host;
  std::string domain;  // failure domain (Slurm node, else host)
  std::uint16_t port = 0;
  int pid = 0;
  actors::actor_ref agent;
  int stage = -1, replica = -1;  // -1: spare
  actors::actor_ref stage_actor;
  actors::actor_ref checkpoint, replicator;  // the policy's actors there (moevement)
  actors::actor_ref group_exchange;          // where a parallel group replay sends it gradients
  actors::actor_ref experts;                 // its stage's expert router (parallel.ep > 1)
  std::vector<op_size> op_sizes;
  double snapshot_bandwidth = 0.0;
};

// An iteration whose step is planned (every stage reported it), as a policy's checkpoints
// see it.
struct planned_iteration {
  std::int64_t iteration = 0;
  planned_step step;           // what a replay of it applies
  models::loss_scaler scaler;  // once it is stepped (what a rollback to iteration + 1 resumes)
  double seconds = 0.0;        // from its Iterate until now (a profile of the iteration)
  std::span<const double> compute_s;  // each stage's forward + backward, index d * pp + s
};

// What the checkpoints cost one stepped iteration, as its stages reported it.
struct iteration_cost {
  std::int64_t iteration = 0;
  double seconds = 0.0;              // the iteration's wall time (Iterate to the last Stepped)
  double stall_s = 0.0;              // the longest a step waited for the capture before it
  double log_s = 0.0;                // the longest a stage spent logging its boundary sends
  double capture_cpu_s = 0.0;        // the captures' CPU time, summed over the stages
  double replication_cpu_s = 0.0;    // the workers' actor-thread CPU on replication, summed
  std::uint64_t snapshot_bytes = 0;  // the bytes the stages' last captures wrote
  std::uint64_t fresh_bytes = 0;     // of those, written into never-written memory
};

// How a recovery ended: where training goes on.
struct recovery_done {
  std::int64_t target = 0;  // the iteration training goes on at
  bool validation = false;  // the loss came during a validation round: it is run again
  bool counts = true;       // a recovery from a loss (not a --resume)
  // A rollback (the baselines): the loss scaler of `target`, where every stage went back to.
  std::optional<models::loss_scaler> rolled_back;
};

// The coordinator, as a recovery uses it.
class head_control {
 public:
  virtual ~head_control() = default;
  // The coordinator's actor: a recovery sends, asks, links and spawns as it.
  virtual actors::actor& actor() = 0;
  virtual const job_config& job() const = 0;
  virtual run_log* log() const = 0;  // may be null
  virtual const std::map<transport::node_id, worker_info>& workers() const = 0;
  // The same, to give spares their roles (stage, replica) and drop stale stage actors.
  virtual std::map<transport::node_id, worker_info>& worker_roles() = 0;
  virtual const models::loss_scaler& scaler() const = 0;  // before the next step
  virtual std::int64_t iteration() const = 0;
  virtual bool stepping() const = 0;    // the survivors are stepping the current iteration
  virtual bool validating() const = 0;  // a validation round is out
  virtual bool finished() const = 0;    // the job ended (a recovery's awaits check it)
  // Ends the job with this message.
  virtual void fail(const std::string& message) = 0;
  // One line for the operator; the launcher's hook at a recovery's start and end.
  virtual void notice(const std::string& line) = 0;
  virtual void recovery_event(const std::string& event, std::int64_t target) = 0;
  // A durable window is on disk on every stage replica: what a resume from it needs beside
  // the windows (the launcher journals it).
  virtual void durable_window(const resume_point& p) = 0;
  // A resume goes on from `p` instead (an older journal: none of the newer one's windows was
  // whole): training goes on at its iteration, with its loss scaler.
  virtual void resume_instead(const resume_point& /*p*/) {}
  // Each checkpoint or window a recovery could not use: a notice and a run log `event` each.
  virtual void report_rejected(const char* event, const char* what,
                               const std::vector<std::string>& reasons) = 0;
  // A worker the job counts on has left the membership and its loss is still queued: what a
  // suspended handler checks after an await. loss_follows(): after a failed ask, true when a
  // loss arrives within the failure timeout.
  virtual bool loss_pending() const = 0;
  virtual asio::awaitable<bool> loss_follows() = 0;
  // The stage actor of (stage, replica) is gone: it is rebuilt (its worker restores it anew).
  virtual void drop_stage(int stage, int replica) = 0;
  // A recovery begins. While the survivors step, finish_stepping() lets them finish (then
  // the recovery's go_on()). Otherwise hold_training() holds training and drops the iteration
  // in progress on every surviving stage at once: false when the job ended meanwhile, or more
  // losses are queued (their turns go on); group_abort_s: the slowest NCCL group abort of
  // the survivors' answers. enter_recovery() only holds training (a --resume).
  virtual asio::awaitable<void> finish_stepping() = 0;
  virtual asio::awaitable<bool> hold_training(double& group_abort_s) = 0;
  virtual void enter_recovery() = 0;
  // Wires every stage anew (false: a loss meanwhile, whose turn goes on, or the job ended).
  virtual asio::awaitable<bool> rewire() = 0;
  // Every stage is back: training goes on.
  virtual asio::awaitable<void> recovered(const recovery_done& done) = 0;
};

// What a judge's replay answered (head_recovery::judge).
struct replay_judgement {
  std::vector<std::uint64_t> digests;  // the replayed replica's operator digests
  std::string error;                   // non-empty: no verdict, and why
  transport::node_id spare = 0;        // the worker that replayed (0: none)
  double seconds = 0.0;
  std::int64_t first_iteration = 0;  // where its replay began (the window's first)
  // A shadow check's: it replayed from the job's start or a window vouched for (else one
  // taken on trust after a recovery: shadow_windows).
  bool vouched = true;
};

class head_recovery {
 public:
  virtual ~head_recovery() = default;
  // ---- the policy's checkpoints, as the head keeps track of them
  // Its stages copy snapshots to replicators: the wiring names each stage's holders, and the
  // iteration records carry what capturing them cost.
  virtual bool replicates() const { return true; }
  // Iteration it's step is planned: where every stage's Step says its checkpoint goes (the
  // window and slot under moevement; the baselines' checkpoint interval k).
  virtual checkpoint_place planned(const planned_iteration& it) = 0;
  // Every stage stepped iteration c.iteration: what its checkpoints cost (policy moevement
  // re-chooses W_sparse from it).
  virtual void stepped(const iteration_cost& /*c*/) {}
  virtual asio::awaitable<void> window_replicated(wire::WindowReplicated::Reader) { co_return; }
  virtual asio::awaitable<void> durable_written(wire::DurableWritten::Reader) { co_return; }
  // The next persisted window goes to the durable tier whatever its pace
  // (checkpoint.durable_share): a stop waits for it (SIGUSR1).
  virtual void durable_soon() {}
  virtual int w_sparse() const { return 0; }  // 0: no window chosen (yet)
  // The first iteration whose step plan it keeps for a replay (-1: none): the stages keep the
  // same (Step.keepFrom), for a standby head that takes over from them.
  virtual std::int64_t steps_kept_from() const { return -1; }
  // Iterations stepped since the newest persisted window's last (-1: none, or no windows).
  virtual std::int64_t replication_lag(std::int64_t /*iteration*/) const { return -1; }

  // ---- recovery
  // A loss is being recovered (from its first report until training goes on).
  virtual bool active() const = 0;
  // The generation the worker-side replays of the job have reached: at the job's end every
  // group exchange hears one past it, so that no worker waits in a replay.
  virtual std::uint64_t generations() const { return 0; }
  // A worker saw generation `seen` under the head this one took over from: the next one
  // numbered is past it.
  virtual void generations_past(std::uint64_t /*seen*/) {}
  // Worker w, holding a stage (w.stage >= 0), was lost while training ran: recover it.
  virtual asio::awaitable<void> lost(worker_info w) = 0;
  // Worker n works for this recovery (it rebuilds or replays a stage for it, or did before a
  // restart replaced it): its loss is the recovery's (lost_member, after the coordinator
  // dropped the worker).
  virtual bool involves(transport::node_id n) const = 0;
  virtual asio::awaitable<void> lost_member(transport::node_id n) = 0;
  // The survivors finished stepping while a loss waited (finish_stepping): go on.
  virtual asio::awaitable<void> go_on() = 0;
  // Worker n reports a stage of generation `generation`: true when it rebuilds one for this
  // recovery, and the report is of its current work (else the coordinator ignores it, or
  // takes it as a worker starting with the job).
  virtual bool rebuilding(transport::node_id n) const = 0;
  virtual bool current(transport::node_id n, std::uint64_t generation) const = 0;
  // Worker n's restore failed (snapshot_lost: every copy of a snapshot it needed is gone).
  virtual asio::awaitable<void> restore_failed(transport::node_id n, const std::string& message,
                                               bool snapshot_lost) = 0;
  // Its stage is back (the coordinator has recorded its actors).
  virtual asio::awaitable<void> restored(transport::node_id n, wire::StageReady::Reader m) = 0;
  // A region supervisor's ask for its region's next generation.
  virtual asio::awaitable<void> region_restart(wire::RegionRestart::Reader,
                                               wire::RegionMembers::Builder out) {
    out.setError("this job recovers no region");
    co_return;
  }
  // The recovery tree's root (its job supervisor, linked to the coordinator; invalid while
  // there is none), and a region supervisor that gave up, as the job supervisor reports it:
  // the job's strategy applies.
  virtual actors::actor_ref tree_root() const { return {}; }
  virtual asio::awaitable<void> escalated(std::uint64_t /*region*/, std::string /*reason*/) {
    co_return;
  }
  // Replica (stage, replica) holds corrupted state, found after iteration `through` (docs/
  // recovery.md "Silent data corruption"); its loss follows. Its copies of windows begun by
  // then are not trusted: whoever rebuilds it takes those of replica `from` (the same stage
  // and shard; -1: there is none). False: this recovery cannot repair it.
  virtual bool corrupted(int /*stage*/, int /*replica*/, int /*from*/, std::int64_t /*through*/) {
    return false;
  }
  // Silent corruption with no majority: an idle spare replays stage `stage`'s group from the
  // persisted window (whose copies the replicas must hold alike) up to `target` and answers
  // replica `replica`'s operator digests, against which the head judges the live copies.
  virtual asio::awaitable<replay_judgement> judge(int /*stage*/, int /*replica*/,
                                                  std::int64_t /*target*/) {
    co_return replay_judgement{
        {}, "this job's checkpoint policy keeps no windows to replay", 0, 0.0};
  }
  // dp = 1's shadow check (checkpoint.shadow_every) of stage `stage`'s replica 0: as judge(),
  // from a window earlier checks vouched for (recovery/shadow_windows.hpp). Its verdict:
  // shadow_agreed, shadow_skipped (no verdict), or corruption, whose earlier states are
  // clean before shadow_clean_before(stage).
  virtual asio::awaitable<replay_judgement> shadow_judge(int stage, std::int64_t target) {
    co_return co_await judge(stage, 0, target);
  }
  virtual void shadow_agreed(int /*stage*/, std::int64_t /*iteration*/) {}
  virtual void shadow_skipped() {}
  virtual std::int64_t shadow_clean_before(int /*stage*/) const { return 0; }
  // Silent corruption no region can repair: what it computed may have spread to every stage
  // (one copy), or no window holds a copy to trust (docs/recovery.md "Rolling back past the
  // corruption"). The whole job rolls back to the newest durable window every capture of
  // which precedes step `clean_before` (the states after the steps before it are known
  // clean), replays to `clean_before` and trains on from there. can_roll_back_before: the
  // durable tier knows such a window (its files are checked when the rollback chooses).
  // roll_back_before marks the recovery that follows (the bad worker's fence, or
  // roll_back_now() where none is known) as this rollback; in a recovery already under way
  // (a replay found it) the rollback starts at once. False: this recovery cannot.
  virtual bool can_roll_back_before(std::int64_t /*clean_before*/) const { return false; }
  virtual asio::awaitable<bool> roll_back_before(std::int64_t /*clean_before*/,
                                                 std::string /*why*/) {
    co_return false;
  }
  virtual asio::awaitable<void> roll_back_now() { co_return; }
  // --resume: every stage restores from the durable tier, as the journal says (the coordinator
  // has taken its state from p already).
  virtual asio::awaitable<void> resume(const resume_point& p) = 0;
  // A standby head took over from the live stages (engine/takeover.hpp): the windows and steps
  // are the journal's and the stages' (t.steps), the stages go on at t.target, and every
  // window they began before it is abandoned; the next one placed is t.next_window. The
  // in-memory windows persisted before are unknown here: until one of this head's persists,
  // a recovery goes back to the journal's durable window. False: this recovery cannot (the
  // stages go back to the durable tier instead).
  virtual bool taken_over(const resume_point& /*journal*/, const live_takeover& /*t*/) {
    return false;
  }
  // The job ended: the recovery's supervisors stop.
  virtual void stop() {}
};

using head_recovery_factory = std::function<std::unique_ptr<head_recovery>(head_control&)>;

}  // namespace moevement::engine
