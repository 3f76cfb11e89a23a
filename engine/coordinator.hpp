// The coordinator: one per job, on the head node. It admits the worker processes (bootstrap),
// gives each its role (a stage and replica, or spare), wires the stage actors together, and
// drives iterations: Iterate to every stage, gathers the reduced gradients' squared sums in
// canonical order, plans the optimizer step (clipping, fp16 loss scaling: the loss scaler is
// the coordinator's), Step to every stage, then the next iteration or a validation round. It
// can pause between iterations, abort the iteration in progress (nothing stepped; it is re-run
// under a new epoch) and resume. At the end it gathers the operators' digests: state_hash.
// The checkpoint policy's head side (its windows, and how a lost worker is recovered) is a
// head_recovery from recovery/ (engine/head_recovery.hpp), which the coordinator hosts and
// hands every loss and report to; the coordinator itself names no policy.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "actors/system.hpp"
#include "engine/checkpoint.hpp"
#include "engine/engine.capnp.h"
#include "engine/head_recovery.hpp"
#include "engine/job_config.hpp"
#include "engine/replica_check.hpp"
#include "engine/resume_point.hpp"
#include "engine/run_log.hpp"
#include "models/model.hpp"

namespace moevement::engine {

struct iteration_record {
  std::int64_t iteration = 0;
  double loss = 0.0, aux_loss = 0.0, grad_norm = 0.0;
  bool applied = true;
  float loss_scale = 1.0f;
  double seconds = 0.0;  // wall time of the iteration (Iterate sent .. all Stepped)
  double tokens_per_s = 0.0;
  double max_compute_s = 0.0;   // the busiest stage's forward + backward time
  double mean_compute_s = 0.0;  // the mean over stages (1 - mean / seconds: the bubble)
  std::int64_t attempts = 1;    // > 1 when the iteration was aborted and re-run
  // policy moevement (summed over stages, the stall the longest)
  std::uint64_t snapshot_bytes = 0, snapshot_host_bytes = 0, log_host_bytes = 0;
  std::uint64_t snapshot_lent_bytes = 0;              // of snapshot_bytes, in link-allocated memory
  std::uint64_t replica_maps = 0, replica_pulls = 0;  // the stages' replicas so far, by kind
  double stall_s = 0.0;
  // The busiest stage's compute-thread seconds logging its boundary tensors, and in the step's
  // hooks less the stall: checkpointing's share of the critical path beside the stall.
  double log_s = 0.0, step_hooks_s = 0.0;
  // The slowest stage's compute-thread seconds digesting its state for the silent-corruption
  // check, and what it digested (none, weights, state).
  double verify_s = 0.0;
  const char* verified = "none";
  // Of `seconds`, the step phase: from the Step messages to the last Stepped (the optimizer
  // and the step's hooks on the slowest stage, and the messages' way there and back).
  double step_phase_s = 0.0;
  double capture_cpu_s = 0.0;         // CPU time of the stages' last captures, summed
  double replication_cpu_s = 0.0;     // the workers' actor-thread CPU on replication, summed
  std::uint64_t fresh_bytes = 0;      // of their bytes, written into never-written memory
  std::uint64_t windows_skipped = 0;  // windows the stages captured nothing of so far, summed
  std::int64_t replication_lag = -1;  // iterations stepped since the persisted window's last
  // GPU stages with NCCL (train.collectives), the slowest stage's: waiting for the group to
  // form (the first iteration after a wiring; else 0), and the device sum.
  double group_form_s = 0.0, device_sum_s = 0.0;
  // Expert parallelism: seconds the stages waited for their EP peers' rows (the slowest, the
  // mean over stages): the all-to-all's cost beside the experts' compute.
  double max_expert_wait_s = 0.0, mean_expert_wait_s = 0.0;
  std::uint64_t peak_rss_bytes = 0;       // the largest worker process's peak resident memory
  std::uint64_t expert_rows_refused = 0;  // EP peers' messages the stages refused so far, summed
  // snapshot_host_bytes per stage replica, index d * pp + s (where a recovery's memory stays)
  std::vector<std::uint64_t> snapshot_host_bytes_by_stage;
};

struct job_outcome {
  bool ok = false;
  // Not ok, but on purpose: stopped with a window on disk to resume from (run log: job_stopped).
  bool stopped = false;
  std::string message;           // what went wrong, or where a stop goes on (empty when ok)
  std::uint64_t state_hash = 0;  // when ok
  // The last iteration's loss (none when this run trained none) and the last validation's
  // (none when none ran: train.val_batches = 0, or no iteration).
  std::optional<double> final_loss, val_loss;
  double seconds = 0.0;  // from the first iteration to the last step
  std::int64_t iterations = 0;
  // Where this run began: 0, or a resume's or a standby head's takeover's iteration.
  std::int64_t first_iteration = 0;
  double tokens_per_s = 0.0;
  // ETTR of the run: useful_s over wall_s. wall_s runs from job_start to the end, less
  // completed validation passes; useful_s sums, for every iteration index committed, the
  // time of its committed attempt (once, however often it ran). What failures cost
  // (detection, recovery, aborted and re-run iterations) is the difference; a policy's
  // per-iteration checkpoint overhead counts as useful here (the benches charge it too,
  // against a fault-free run of policy none).
  double wall_s = 0.0, useful_s = 0.0, ettr = 0.0;
};

// What the launcher knows of a worker's process.
struct worker_exit {
  bool watched = false;  // the launcher started it and hears of its exit
  std::string how;       // how it ended ("was killed by signal 9 (Killed)"); empty: running
};

struct coordinator_callbacks {
  std::function<void(const iteration_record&)> on_iteration;
  // A worker was declared lost (the launcher makes sure the process is gone: a hung one
  // would otherwise wake up later).
  std::function<void(transport::node_id node, int pid)> on_worker_lost;
  // How a worker's process ended, where the launcher started it (see worker_exit): a loss the
  // membership declared says that ("was killed by signal 9 (Killed)") rather than the link's
  // view of it (a redial refused: the process's sockets close just before its parent hears
  // of its exit).
  std::function<worker_exit(transport::node_id node)> exit_of;
  // One line for the operator about a failure or a recovery.
  std::function<void(const std::string&)> on_notice;
  // A recovery began ("recovery_start") or every region of it ended ("recovery_end"); the
  // launcher uses it to inject failures during a recovery.
  std::function<void(const std::string& event, std::int64_t target_iteration)> on_recovery;
  // Admission is complete and every worker was sent its role: the stages are being built.
  std::function<void()> on_assigned;
  std::function<void(std::int64_t iteration, double val_loss)> on_validation;
  std::function<void(const job_outcome&)> on_finished;  // exactly once
  // A durable window is on disk on every stage replica (policy moevement, checkpoint.durable):
  // what a resume from it needs beside the windows (recovery/ journals it).
  std::function<void(const resume_point&)> on_durable_window;
  // This head is fenced: it was stopped past the failure timeout and the standby head took
  // its place (cluster.standby_head). It ends without a word to the workers.
  std::function<void()> on_replaced;
  // Awaited once the last iteration ended, before the final state is read and the workers
  // shut down: what the launcher still asks of the stages (its head_extension) ends first.
  std::function<asio::awaitable<void>()> before_finish;
};

class coordinator : public actors::actor, private head_control {
 public:
  using interface =
      actors::interface<actors::tell_t<wire::WorkerHello>, actors::tell_t<wire::StageReady>,
                        actors::tell_t<wire::StageDone>, actors::tell_t<wire::Stepped>,
                        actors::tell_t<wire::StageFailed>, actors::tell_t<wire::ValLoss>,
                        actors::tell_t<wire::WindowReplicated>,
                        actors::tell_t<wire::DurableWritten>,
                        actors::ask_t<wire::RegionRestart, wire::RegionMembers>,
                        actors::tell_t<wire::RegionEscalated>, actors::tell_t<wire::StandbyJoined>>;
  static constexpr const char* registered_name = "moevement.coordinator";
  // An ordinary ask to the stages (wiring, abort, digests).
  static constexpr auto ask_timeout = std::chrono::seconds(30);

  // raw: the config as read (sent to every worker); job: its resolution. Workers are nodes
  // 1..job.workers() + job.spares. log may be null. resume: start from the durable tier where
  // a killed job left it (its journal), not from the initial state.
  // recovery: how this job recovers a lost worker (recovery::any_head_recovery; empty: the
  // job stops at a loss).
  // taken_over: this is a standby head that took the place of a lost one (cluster.standby_head):
  // the workers it expects (those alive), each saying hello with the role it holds; resume is
  // then the journal's newest window, which every stage restores in place.
  coordinator(job_config job, models::config_map raw, coordinator_callbacks callbacks, run_log* log,
              head_recovery_factory recovery = {},
              std::optional<resume_point> resume = std::nullopt,
              std::set<transport::node_id> taken_over = {});

  // Between iterations: stop after the current one / go on. abort_iteration(): drop the
  // iteration in progress on every stage and re-run it (resume() if paused).
  void pause() { pause_requested_ = true; }
  asio::awaitable<void> resume();
  asio::awaitable<void> abort_iteration();

  const std::map<transport::node_id, worker_info>& workers() const override { return workers_; }
  // The job has failed (a worker lost, a stage failed): stop with this message.
  void fail(const std::string& message) override;
  // The job stops on purpose (SIGUSR1 once a window is on disk): like fail, but the run log
  // says job_stopped, so a report or a tool reading it does not take it for a failure; its
  // iterations are `goes_on_at` (where the resume goes on), its ETTR measured.
  void stop_for_resume(const std::string& message, std::int64_t goes_on_at);
  // Worker `node` is gone (heartbeats stopped, it said goodbye, or its process exited; `how`
  // says which). A spare is dropped; a stage is recovered on a spare when the policy can,
  // else the job fails naming the worker.
  // Posts the loss to this actor (never changes anything in the caller's call).
  void lose_worker(transport::node_id node, const std::string& how);
  // The next persisted window goes to the durable tier at once (a stop on SIGUSR1 waits for it).
  void durable_soon() {
    if (recovery_) recovery_->durable_soon();
  }
  // The window every stage snapshots into (0 before it is chosen or under other policies).
  int w_sparse() const { return recovery_ ? recovery_->w_sparse() : 0; }
  std::int64_t recoveries() const { return recoveries_; }
  bool finished() const override { return finished_; }
  // Past admission and wiring: iterations have begun.
  bool started() const { return phase_ != phase::admitting && phase_ != phase::starting; }
  // Admission is complete: every worker was sent its role.
  bool assigned() const { return phase_ != phase::admitting; }
  // Every stage is ready and training waits for the standby head to join (StandbyJoined).
  bool waits_for_standby() const { return held_start_; }
  // Every worker said hello and admission waits for the standby head's hello.
  bool waits_for_standby_hello() const {
    return phase_ == phase::admitting && job_.standby_head && taken_over_.empty() &&
           !standby_.agent.valid() && !standby_gone_ && int(workers_.size()) >= expected_workers_;
  }
  // The standby head's process ended (`how`, e.g. "exited with status 143"): before its hello,
  // the job goes on without one (after it, the membership says so).
  void standby_ended(const std::string& how);
  // The workers whose hello admission waits for (a standby that took over: those it kept).
  int expected_workers() const { return expected_workers_; }
  bool took_over() const { return !taken_over_.empty(); }
  // Said hello: a worker of the job, or one lost since before training started.
  bool said_hello(transport::node_id n) const {
    return workers_.contains(n) || lost_before_start_.contains(n);
  }
  // What check_start found.
  struct start_check {
    bool started = false;          // training started (or the job ended): nothing to do
    bool short_of_spares = false;  // late workers the spares on time cannot replace
    // Replaced, and never said hello: the launcher ends their processes (hung as they started).
    std::vector<transport::node_id> unheard;
    std::chrono::milliseconds next{0};  // when the next worker's deadline passes
  };
  // cluster.start_timeout_ms (the launcher's timer), in this actor's turn: each worker has that
  // long from the start, or from when it was given its role (a spare given a lost worker's);
  // those past it are declared lost and their roles given to spares, when the spares on time
  // cover them all. `then` runs with what was found (short_of_spares: the start fails).
  void check_start(std::function<void(const start_check&)> then);
  // Admission waits for `n`'s hello: one of a fresh start's workers, not yet lost.
  bool awaits_hello(transport::node_id n) const {
    return phase_ == phase::admitting && taken_over_.empty() && n >= 1 &&
           int(n) <= job_.workers() + job_.spares && !said_hello(n);
  }

 protected:
  asio::awaitable<void> on_start() override;
  void on_stop(const actors::exit_reason& why) override;
  asio::awaitable<void> on_down(actors::actor_ref who, actors::exit_reason why) override;
  // The recovery tree's job supervisor (linked) ended: abnormally, the job stops.
  asio::awaitable<void> on_exit(actors::actor_ref who, actors::exit_reason why) override;

 private:
  // ---- head_control: the coordinator as its recovery (recovery/) uses it
  actors::actor& actor() override { return *this; }
  const job_config& job() const override { return job_; }
  run_log* log() const override { return log_; }
  std::map<transport::node_id, worker_info>& worker_roles() override { return workers_; }
  const models::loss_scaler& scaler() const override { return scaler_; }
  std::int64_t iteration() const override { return iteration_; }
  bool stepping() const override { return phase_ == phase::stepping; }
  bool validating() const override { return phase_ == phase::validating; }
  void notice(const std::string& line) override;
  void recovery_event(const std::string& event, std::int64_t target) override;
  void durable_window(const resume_point& p) override;
  void resume_instead(const resume_point& p) override;
  // Each checkpoint or window a recovery could not use, and why: a notice and a run log event
  // `event` per reason (`what` names the kind in the notice).
  void report_rejected(const char* event, const char* what,
                       const std::vector<std::string>& reasons) override;
  // A worker this coordinator counts on has left the actor system's membership and its
  // loss (queued) has not been handled yet: what a suspended handler checks after an await.
  bool loss_pending() const override;
  // After a failed ask during a recovery: true when a worker was lost since (waiting up to
  // the failure timeout for its loss to arrive).
  asio::awaitable<bool> loss_follows() override;
  void drop_stage(int stage, int replica) override;
  asio::awaitable<void> finish_stepping() override { return maybe_stepped_all(); }
  void enter_recovery() override {
    phase_ = phase::recovering;
    attempt_spanned_recovery_ = true;
  }
  asio::awaitable<bool> hold_training(double& group_abort_s) override;
  // Drops the iteration in progress on every surviving stage, at once (false: the job ended).
  asio::awaitable<bool> abort_survivors(double& group_abort_s);
  asio::awaitable<bool> rewire() override { return wire_all(); }
  asio::awaitable<void> recovered(const recovery_done& done) override;

  enum class phase : std::uint8_t {
    admitting,
    starting,
    running,
    stepping,
    validating,
    paused,
    recovering,
    done
  };
  asio::awaitable<void> hello(wire::WorkerHello::Reader m);
  asio::awaitable<void> ready(wire::StageReady::Reader m);
  asio::awaitable<void> stage_done(wire::StageDone::Reader m);
  asio::awaitable<void> stepped(wire::Stepped::Reader m);
  asio::awaitable<void> stage_failed(wire::StageFailed::Reader m);
  asio::awaitable<void> val_loss(wire::ValLoss::Reader m);
  asio::awaitable<void> window_replicated(wire::WindowReplicated::Reader m);
  asio::awaitable<void> durable_written(wire::DurableWritten::Reader m);
  // A region supervisor asks for its region's next generation: the recovery's to answer.
  asio::awaitable<void> region_restart(wire::RegionRestart::Reader m,
                                       wire::RegionMembers::Builder out);
  // The job supervisor reports a region supervisor that gave up: the recovery's to decide.
  asio::awaitable<void> region_escalated(wire::RegionEscalated::Reader m);
  bool recovering() const { return recovery_ && recovery_->active(); }
  bool replicates() const { return recovery_ && recovery_->replicates(); }

  // Wires every stage: neighbours, replicas, and where its snapshot copies go.
  asio::awaitable<bool> wire_all();
  // A worker's loss, as a turn of this actor (lose_worker posts it): a spare is dropped, a
  // stage's worker goes to the recovery (or the job stops, saying why).
  asio::awaitable<void> worker_lost(transport::node_id node, std::string how);
  // A worker lost before training started (admission, or its stage being built): nothing is
  // trained yet, so a spare takes its role as it is (the spare builds the stage the role starts
  // from, or restores it from disk with the others on a resume or takeover); a lost spare is
  // one fewer. false: no spare is left for the role (the caller ends the job saying so).
  asio::awaitable<bool> lost_before_training(transport::node_id node, const std::string& how);
  // Its worker_lost event (during: "admission", "takeover" or "start"; spare: who takes its
  // role, 0 none).
  void log_loss_before_training(transport::node_id node, const std::string& how, const char* during,
                                transport::node_id spare);
  // The workers past their start deadline (check_start) at `now`, and the earliest deadline
  // of the others still unreported.
  std::vector<transport::node_id> late_at_start(
      actors::clock::time_point now, std::optional<actors::clock::time_point>& next) const;
  // Every one of `late` whose role a spare must take can have one: the spares on time, less
  // the roles already owed to spares (lost during admission).
  bool spares_cover(const std::vector<transport::node_id>& late) const;
  // Training starts once every worker reported its stage (and a standby head joined).
  asio::awaitable<void> start_when_ready();
  // The membership declared the worker lost (`how`: its verdict): how its process ended, where
  // the launcher watches it and hears of it within exit_wait, is said instead.
  asio::awaitable<void> member_lost(transport::node_id node, std::string how,
                                    std::chrono::steady_clock::time_point declared_at);
  static constexpr std::chrono::milliseconds exit_wait{50};
  // Ends the stepping phase once every live stage has stepped.
  asio::awaitable<void> maybe_stepped_all();
  int live_stages() const;
  // Owner node -> the replicators holding its snapshot copies (engine/snapshot_placement).
  std::map<transport::node_id, std::vector<actors::actor_ref>> snapshot_holders() const;
  // A spare's replicator `lost` is gone between recoveries: every stage worker whose copies it
  // held (in `before`, the placement with it) is told where they go now (every policy whose
  // workers hold copies for each other).
  void retarget_snapshots(
      const std::map<transport::node_id, std::vector<actors::actor_ref>>& before,
      actors::actor_ref lost);
  // The run log's snapshot_holders event of one stage replica (on `owner`).
  void log_holders(int stage, int replica, transport::node_id owner,
                   const std::vector<actors::actor_ref>& holders) const;

  asio::awaitable<void> wire_and_start();
  // Every stage is ready (and the standby, if any, joined): wire and train, or resume.
  asio::awaitable<void> start_training();
  void release_start();  // the start held for the standby's join goes on (or without it)
  asio::awaitable<void> standby_joined(wire::StandbyJoined::Reader m);
  // Once every stage reported an iteration (stage_done): the step plan and the iteration's
  // record (false: the replicas disagreed, the job failed); the Step to every stage, with the
  // policy's window size (recovery_->planned).
  bool plan_iteration();
  void send_steps();
  // One stage's Step (send_steps, and a standby completing the lost head's last one).
  void send_step(const actors::actor_ref& to, std::uint64_t epoch, const models::step_plan& plan,
                 const checkpoint_place& place, std::int64_t keep_from,
                 std::span<const double> popularity, wire::Verify verify);
  // Silent-corruption checks (coordinator_verify.cpp; docs/recovery.md "Silent data
  // corruption"): what the stages digest after iteration it's step, and, once every stage
  // stepped, the comparison of a stage's replicas. True when one was found corrupted: it is
  // fenced and its loss is recovered (or the job stopped, saying why).
  wire::Verify verify_for(std::int64_t it) const;
  asio::awaitable<bool> verify_replicas();
  // No majority: a spare's replay judges (head_recovery::judge); the replicas to fence, or
  // nullopt with why the replay gave no verdict (empty: the job ended).
  asio::awaitable<std::optional<std::vector<std::pair<int, int>>>> judge_by_replay(
      const std::vector<divergence>& found, std::int64_t it, std::string& why_none);
  // No replica is known bad: the whole job rolls back to before the last state check that
  // agreed (head_recovery::roll_back_before), or stops saying why.
  asio::awaitable<void> no_verdict(std::int64_t it, const std::string& why);
  // checkpoint.shadow_every: after iteration_ - 1's step, one stage (in turn) replayed on a
  // spare (from the persisted window, or with checkpoint.shadow_coverage "full" from one
  // earlier checks vouched for) and compared with the live stage. True when they
  // differ: the stage's worker is fenced and the job rolled back to before the corruption (or
  // stopped, saying why).
  asio::awaitable<bool> shadow_check();
  // A shadow check of stage s found operators `differ` corrupted, every state before
  // `clean_before` clean: its worker fenced and the job rolled back, or the job stops.
  asio::awaitable<bool> shadow_found(int s, std::int64_t it, transport::node_id spare,
                                     const std::vector<std::string>& differ,
                                     std::int64_t clean_before);
  // Fences the bad replicas' workers and recovers them (the job stops where it cannot).
  // rolling_back: the recovery is a rollback past the corruption (roll_back_before), which
  // trusts every replica's copies of the windows it restores.
  asio::awaitable<void> fence(const std::vector<std::pair<int, int>>& bad, const char* how,
                              std::int64_t it, bool rolling_back = false);
  // A recovery's replay sent other bits than replica (stage, replica) logged sending in
  // iteration `at` (worker w's StageReady): the whole job rolls back to before it and w is
  // fenced, or the job stops.
  asio::awaitable<void> replay_mismatch_found(worker_info w, int stage, int replica,
                                              std::int64_t at, const std::string& message);
  // The operator names of stage replica (s, d) (DigestsQuery), for the notices.
  asio::awaitable<std::vector<std::string>> operator_names(int s, int d);
  json_record job_start_record() const;  // the run log's job_start event
  void start_iteration();
  // cluster.iteration_timeout_ms: armed at each iteration's start (an attempt re-run after a
  // recovery starts it again). At the limit the workers of the stages that have not finished
  // it are probed (engine/compute_watch.hpp): a stage whose compute has run one task for
  // longer than the limit, not waiting for a peer (a hung kernel; or whose worker's actor
  // thread does not answer), is stuck; one computing for less is looked at again when it
  // reaches the limit. Stuck stages are fenced and rebuilt like lost workers where the policy
  // recovers; otherwise, or with none stuck, the job ends naming the late stages.
  // after: when it fires (0: cluster.iteration_timeout_ms from now).
  void arm_iteration_timeout(std::chrono::milliseconds after = std::chrono::milliseconds(0));
  asio::awaitable<void> iteration_overdue(std::uint64_t epoch);
  // What the probe found of the late stages of attempt `epoch`.
  struct probed_stages {
    std::vector<actors::actor_ref> stuck;
    std::vector<double> stuck_s;  // how long each has computed (-1: its worker did not answer)
    double recheck_s = 0.0;       // until a computing stage reaches the limit, or an unheard worker
                                  // the failure timeout
    std::string behind;           // stages that never began the attempt (dropped its Iterate)
  };
  asio::awaitable<probed_stages> probe_late(const std::vector<actors::actor_ref>& late,
                                            std::uint64_t epoch);
  asio::awaitable<void> after_iteration();
  // After a step (and its validation round, if any): the end, a pause, or the next iteration.
  asio::awaitable<void> go_on();
  void start_validation();
  asio::awaitable<void> finish();
  void finish_with(job_outcome outcome);
  actors::actor_ref stage_ref(int s, int d) const { return stages_[std::size_t(d * job_.pp + s)]; }

  job_config job_;
  models::config_map raw_;
  coordinator_callbacks callbacks_;
  run_log* log_;
  int expected_workers_;
  std::int64_t abort_at_ = -1;
  std::set<transport::node_id> taken_over_;  // a standby that took over: the workers it expects
  worker_info standby_;                      // the standby head, once it said hello
  // Training starts once the standby joined the cluster (it watches this head from then on:
  // a head lost before that could not be taken over); held_start_: every stage was ready first.
  bool standby_joined_ = false, held_start_ = false;
  bool standby_gone_ = false;   // it ended before its hello: admission no longer waits for it
  bool standby_heard_ = false;  // its hello came (its loss is then the membership's to report)
  // A standby that took over sent the lost head's last Step to the stages that lacked it:
  // once they stepped, training goes on (nothing of that iteration is logged again).
  bool completing_takeover_ = false;
  // Every role held by exactly one worker (a role whose worker was lost during admission given
  // to a spare); false (the job failed) otherwise.
  bool roles_complete();
  // Every expected worker said hello (and the roles are complete): the Assigns go out.
  void admitted();
  // Admission is complete: every worker (and the standby head) gets its Assign.
  void send_assigns();
  // `to`'s Assign: its role, the config and every member's address.
  void send_assign(const worker_info& to);
  std::map<transport::node_id, worker_info> workers_;
  std::vector<actors::actor_ref> stages_;  // [dp * pp], index d * pp + s
  // The workers whose stage (or, a spare's, none) is reported for the role they hold now.
  std::set<transport::node_id> ready_;
  // Lost before training started: never admitted again (a hello already on its way).
  std::set<transport::node_id> lost_before_start_;
  // A role's worker lost during admission (index d * pp + s): its failure domain (its spare is
  // chosen from another, choose_spare) and what became of it (for the job's end without one).
  struct lost_role {
    std::string domain;
    std::string what;  // "worker 2 (pid 4711) exited with status 1"
  };
  std::map<int, lost_role> lost_roles_;
  // The start's deadlines (check_start): from the head's start, and for a spare given a role
  // before training, from then.
  actors::clock::time_point start_began_{};
  std::map<transport::node_id, actors::clock::time_point> role_given_at_;

  phase phase_ = phase::admitting;
  models::loss_scaler scaler_;
  std::int64_t iteration_ = 0;
  std::uint64_t epoch_ = 0;
  std::int64_t attempts_ = 0;
  bool pause_requested_ = false;
  // the current epoch's reports, index d * pp + s
  std::vector<std::optional<std::vector<double>>> sq_, losses_, aux_;
  // Expert parallelism: which of each stage replica's operators are experts (StageDone).
  std::vector<std::vector<bool>> expert_ops_;
  std::vector<double> expert_wait_s_;          // per stage replica, this iteration
  std::vector<std::uint64_t> expert_refused_;  // per stage replica, so far
  // One stage's per-operator values in canonical order, merged from the EP ranks of replica
  // group 0 (values[k] and experts[k]: rank k's, in its operators' order); throws
  // std::invalid_argument where they do not fit together.
  template <class T>
  static std::vector<T> merge_ranks(const std::vector<std::vector<T>>& values,
                                    const std::vector<std::vector<bool>>& experts);
  // Appends stage st's values (one EP rank's as they are; several merged) to out; false (and
  // the job failed) where the ranks' operators do not fit together.
  template <class T>
  bool append_stage(int st, const std::vector<std::vector<T>>& values,
                    const std::vector<std::vector<bool>>& experts, std::vector<T>& out);
  std::vector<double> compute_s_;
  double group_form_s_ = 0.0, device_sum_s_ = 0.0;  // of this iteration, the slowest stage's
  std::uint64_t wirings_ = 0;                       // Wire.wiring: one per wire_all()
  int done_count_ = 0;
  std::vector<bool> stepped_flags_;
  actors::time_source::timer_id overdue_timer_ = 0;  // 0: none armed
  std::uint64_t rechecked_epoch_ = 0;  // the attempt whose late stages were looked at twice
  // This iteration's silent-corruption check: what was asked, and each stage replica's digests
  // (index d * pp + s).
  wire::Verify verify_ = wire::Verify::NONE;
  std::vector<replica_report> verify_reports_;
  std::int64_t sdc_found_ = 0;  // replicas fenced for silent corruption (job_end's sdc_fenced)
  // The newest iteration whose whole-state check found every replica alike (-1: none yet):
  // the states before its step are clean (a rollback past corruption goes back before it).
  std::int64_t state_agreed_ = -1;
  // Per stage replica (d * pp + s): the windows_skipped it last reported (a new worker's starts
  // again from 0), so that new skips are noticed.
  std::vector<std::uint64_t> windows_skipped_;
  // When each stage replica's skips were last noticed on the console (at most once a minute:
  // a stuck replication skips window after window).
  std::vector<std::chrono::steady_clock::time_point> skips_noticed_;
  models::step_plan plan_;
  std::chrono::steady_clock::time_point iteration_start_, job_start_;
  std::chrono::steady_clock::time_point steps_sent_;  // this iteration's Step messages
  double train_seconds_ = 0.0;
  bool fewer_copies_noticed_ = false;  // checkpoint.replicas more than the workers allow
  // The iteration this head's training began at (a resume's or a takeover's target): its
  // tokens per second count the iterations from there.
  std::int64_t first_iteration_ = 0;
  // The iteration's attempt went on across a loss (a stage lost after it stepped is rebuilt
  // one step further; the others' steps commit the iteration): its time is mostly detection
  // and recovery, not training, so the useful time it counts is that of the last attempt that
  // did not (useful_s, ETTR).
  bool attempt_spanned_recovery_ = false;
  double last_clean_s_ = 0.0;
  std::map<std::int64_t, double> committed_s_;  // iteration -> its committed attempt (s)
  double validation_s_ = 0.0;                   // completed validation passes (s)
  std::chrono::steady_clock::time_point validation_start_;
  iteration_record last_;
  std::uint64_t val_round_ = 0;
  std::vector<std::optional<double>> val_losses_;
  std::optional<double> last_val_;  // the last validation's loss
  bool finished_ = false;
  double head_stall_s_ = 0.0;  // the longest this process did not run (actor system's on_stall)
  // Workers declared lost on silence (no heartbeat, their processes not seen to end), and when:
  // a majority of them at once says the head itself may be the one cut off (cut_off_hint()).
  std::map<transport::node_id, std::chrono::steady_clock::time_point> silent_losses_;
  std::string cut_off_hint() const;

  // The policy on the head (recovery/; null: policy none): what its checkpoints are, and how a
  // lost worker is recovered (the job stops at a loss without one).
  std::unique_ptr<head_recovery> recovery_;
  std::int64_t recoveries_ = 0;
  std::vector<std::optional<std::vector<double>>> pop_;  // this epoch's popularity, by index
  // --resume (engine/coordinator_recovery.cpp): the journal's point, until every worker is up;
  // then every stage restores from the newest durable window all of them verify.
  std::optional<resume_point> resume_;
  asio::awaitable<void> start_resume(bool takeover = false);  // takeover: a standby went to disk
  // A standby that took over: training goes on from the live stages where they agree
  // (engine/takeover.hpp), else every stage goes back to the journal's window (start_resume).
  asio::awaitable<void> start_takeover();
  // Why the stages cannot go on live ("" once they do).
  asio::awaitable<std::string> go_on_live();
};

}  // namespace moevement::engine
