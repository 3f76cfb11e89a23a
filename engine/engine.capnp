@0xca70d9bf422b0924;
# The engine's protocol: bootstrap (launcher <-> worker agents), the training iteration
# (coordinator <-> stage actors, stage <-> stage) and validation. Every message is untrusted
# on arrival: handlers check iteration, epoch, micro-batch and sizes against their own state.
#
# Epochs: the coordinator numbers every Iterate it sends (an aborted iteration is re-run under
# a new epoch), and every stage-to-stage message carries the epoch it belongs to, so that
# leftovers of an aborted attempt are recognised and dropped.

using Cxx = import "/capnp/c++.capnp";
$Cxx.namespace("moevement::engine::wire");

using Envelope = import "/transport/envelope.capnp";
using Bulk = import "/transport/bulk.capnp";
using Job = import "/engine/job_config.capnp";
using Address = Envelope.ActorAddress;

# ---- bootstrap

struct Peer {
  node @0 :UInt32;
  host @1 :Text;
  port @2 :UInt16;
}
# A worker process is up: where it listens, and its agent actor.
# The standby head -> the head's coordinator, once it joined the cluster (it watches the head
# from then on): training starts only then, so that a head lost at any point can be taken over.
struct StandbyJoined {
  node @0 :UInt32;
}
struct WorkerHello {
  node @0 :UInt32;
  host @1 :Text;
  port @2 :UInt16;
  agent @3 :Address;
  pid @4 :Int32;
  # The failure domain this process is in (its Slurm node, else its host): snapshot copies
  # go to other domains first.
  domain @5 :Text;
  # The standby head (cluster.standby_head) says hello too, as node pp*dp + spares + 1: it gets
  # every peer's address in its Assign and joins, but has no role.
  standby @6 :Bool;
  # A worker saying hello to a standby head that took over: the role it holds (stage -1: a
  # spare), which the new head keeps.
  taken @7 :Bool;
  stage @8 :Int32;
  replica @9 :Int32;
  # With taken: the newest recovery generation this worker has seen (its Restores', its group
  # exchange's). The new head numbers its generations past every one: from 1 again, a group
  # replay's members refused its announcements as superseded.
  generation @10 :UInt64;
}
# The coordinator's answer once every worker said hello: every peer's address (so that all
# can heartbeat all), the job's config, and this worker's role (stage -1: a spare).
struct Assign {
  peers @0 :List(Peer);
  config @1 :Job.JobConfig;
  stage @2 :Int32;
  replica @3 :Int32;
  coordinator @4 :Address;
  # `moevement launch --resume`: a stage role builds nothing from the initial state; it waits
  # for its durable Restore (and leaves the durable tier's windows on disk).
  resume @5 :Bool;
}
# The worker joined and built its stage (error non-empty: it could not).
struct StageReady {
  node @0 :UInt32;
  stage @1 :Int32;
  replica @2 :Int32;
  actor @3 :Address;
  error @4 :Text;
  # The checkpoint policy's actors in this worker (invalid under policy none): the stage's
  # checkpoint agent (snapshots, upstream log) and the replicator (peers' snapshot copies).
  checkpoint @5 :Address;
  replicator @6 :Address;
  # Algorithm 1's inputs from this stage: each operator's sizes, and the measured bandwidth
  # of writing a snapshot (bytes/s).
  opSizes @7 :List(OpSize);
  snapshotBandwidth @8 :Float64;
  # A replacement: the Restore generation it answers (older ones are ignored), and how long
  # pulling the windows and logs and the replay took.
  generation @9 :UInt64;
  pullSeconds @10 :Float64;
  replaySeconds @11 :Float64;
  iterationsReplayed @12 :Int64;
  # A replacement's restore failed because every copy of a snapshot slot it needs is gone
  # (with checkpoint.durable on, the job then rolls back to the durable tier).
  snapshotLost @13 :Bool;
  # How the restore got its window's slots (engine/checkpoint.hpp restore_timing).
  slotsMapped @14 :Int64;
  slotsPulled @15 :Int64;
  handlesRefused @16 :Int64;
  replayThreads @17 :Int32;  # the GEMM threads its replay ran with
  # The policy's group exchange in this worker (a recovery group's replay sums gradients
  # through it; invalid when the policy has none).
  groupExchange @18 :Address;
  # Expert parallelism (parallel.ep > 1): the stage's expert router (invalid without it).
  experts @19 :Address;
  # Copies of its window's slots refused as corrupt (their checksum), each replaced by another.
  copiesRefused @20 :Int64;
  # The restore failed because its replay sent other bits than logged (engine::replay_mismatch).
  replayMismatch @21 :Bool;
  # Of a replay mismatch: the iteration whose sends differ.
  mismatchIteration @22 :Int64 = -1;
  # Answers its neighbours' upstream logs came in (checkpoint.log_fetch_bytes each at most).
  logPieces @23 :Int64;
}
struct OpSize {
  computeBytes @0 :UInt64;
  masterBytes @1 :UInt64;
  optimBytes @2 :UInt64;
}
# A stage's neighbours: the previous and next stage of its replica (invalid at the ends) and
# every replica of this stage in replica order (the reduction chain).
struct Wire {
  prev @0 :Address;
  next @1 :Address;
  replicas @2 :List(Address);
  # Where this stage's snapshot slots are copied (the replicators of other workers).
  replicators @3 :List(Address);
  # Counts the coordinator's wirings: a GPU stage's NCCL group is made anew on each.
  wiring @4 :UInt64;
  # Expert parallelism: every replica's expert router, in replica order (empty without it).
  experts @5 :List(Address);
}
struct WireAck {}
# Policy moevement, between recoveries: a snapshot holder (a spare's replicator) was lost, and
# these are where the stage's slots are copied from now on (its checkpoint agent offers the
# slots still waiting for copies to them).
struct SnapshotTargets {
  replicators @0 :List(Address);
}
struct Shutdown {}

# ---- one iteration

struct Iterate {
  iteration @0 :Int64;
  epoch @1 :UInt64;
  lossScale @2 :Float32;
}
# A boundary tensor [B,T,C] fp32 ready to pull: an activation to the next stage, or the
# gradient of this stage's input to the previous one.
struct Activation {
  epoch @0 :UInt64;
  microBatch @1 :Int32;
  tensor @2 :Bulk.BulkDescriptor;
}
struct Gradient {
  epoch @0 :UInt64;
  microBatch @1 :Int32;
  tensor @2 :Bulk.BulkDescriptor;
}
# Gradient reduction along the replicas in order: replica d sends g_0 + ... + g_d to d + 1;
# the last replica sends the total to every other.
# Under expert parallelism there are two such folds (experts set: the second): the
# non-experts over every replica as above, and each expert block over its copies (EP rank k of
# every EP group, in group order), each copy adding its group's replicas' rows in order.
struct ReducePartial {
  epoch @0 :UInt64;
  tensor @1 :Bulk.BulkDescriptor;
  experts @2 :Bool;
}
struct ReduceTotal {
  epoch @0 :UInt64;
  tensor @1 :Bulk.BulkDescriptor;
  experts @2 :Bool;
}
# GPU stages with NCCL (train.collectives): replica 0 makes a group id on each wiring and
# tells the other replicas of its stage, which join it.
struct ReduceGroup {
  wiring @0 :UInt64;
  id @1 :Data;  # an ncclUniqueId (128 bytes)
}
# A replica of a stage has its reduced gradient.
struct StageDone {
  stage @0 :Int32;
  replica @1 :Int32;
  epoch @2 :UInt64;
  sqSums @3 :List(Float64);     # per operator, in canonical order
  losses @4 :List(Float64);     # last stage: per micro-batch cross-entropy
  auxLosses @5 :List(Float64);  # per micro-batch, this stage's load-balancing loss
  computeSeconds @6 :Float64;   # forward + backward time (the bubble measurement)
  popularity @7 :List(Float64); # per operator: tokens routed to it (experts), else 0
  # NCCL (train.collectives): seconds this iteration's reduction waited for the group to form
  # (after a wiring; else 0), and the sum's seconds.
  groupFormSeconds @8 :Float64;
  deviceSumSeconds @9 :Float64;
  # Expert parallelism: which operators are experts (sqSums then cover this replica's block
  # of experts only; the coordinator merges the EP ranks' in canonical order).
  experts @10 :List(Bool);
  # Expert parallelism: seconds the compute thread waited for its EP peers' answers.
  expertWaitSeconds @11 :Float64;
  # and how many of their messages it refused so far (malformed, or answers not awaited)
  expertRowsRefused @12 :UInt64;
}

# ---- expert parallelism (parallel.ep; engine/expert_router.hpp)

# Rows of one (layer, micro-batch) from a source replica to the EP rank holding their
# experts: forward, the routed inputs [rows, C] with the rows of each of the receiver's
# experts; backward, the gradient of those experts' outputs (rows as in the forward).
struct ExpertRows {
  epoch @0 :UInt64;      # the iteration's (validation: 0)
  layer @1 :Int32;
  microBatch @2 :Int32;  # -1: a validation batch (nothing kept for a backward)
  backward @3 :Bool;
  source @4 :Int32;      # the sender's EP rank
  rows @5 :List(Int32);  # forward: per expert of the receiver's block
  tensor @6 :Bulk.BulkDescriptor;  # unset when there are no rows
  seq @7 :UInt64;  # counts the sender's exchanges: the answer names it
}
# The answer: the experts' outputs (forward) or the gradient of their inputs (backward).
struct ExpertOutput {
  epoch @0 :UInt64;
  layer @1 :Int32;
  microBatch @2 :Int32;
  backward @3 :Bool;
  owner @4 :Int32;  # the sender's EP rank
  tensor @5 :Bulk.BulkDescriptor;  # unset when there are no rows
  seq @6 :UInt64;  # the request's
  error @7 :Text;  # non-empty: the rows could not be computed (what was wrong with them)
}
struct Step {
  epoch @0 :UInt64;
  apply @1 :Bool;
  gradMul @2 :Float32;
  # Checkpointing: the window size every stage uses (0: not chosen yet, nothing captured),
  # and this stage's popularity summed over its replicas in replica order (so that every
  # replica of a stage computes the same sparse schedule).
  wSparse @3 :Int32;
  popularity @4 :List(Float64);
  # Policy moevement: the window and slot this step captures (the head places every slot:
  # recovery/window_plan.hpp; wSparse is that window's size).
  window @5 :UInt64;
  slot @6 :UInt32;
  # The step's gradient norm (a replay's record of it), and the first iteration whose step
  # the head still keeps for a replay (policy moevement; -1: none): the stage keeps the same
  # steps, so that a standby head taking over from the live stages has them.
  gradNorm @7 :Float64;
  keepFrom @8 :Int64;
  # Silent-corruption checks (docs/recovery.md "Silent data corruption"): what the stage
  # digests after this step for the head to compare across its replicas (Stepped.digests).
  verify @9 :Verify;
}
enum Verify {
  none @0;
  weights @1;  # each operator's compute weights: what the next forward uses (every iteration)
  state @2;    # each operator's master, Adam m and v, and step (checkpoint.verify_every)
}
struct Stepped {
  stage @0 :Int32;
  replica @1 :Int32;
  epoch @2 :UInt64;
  # The checkpoint policy's view of this step (engine/hooks.hpp checkpoint_stats).
  snapshotBytes @3 :UInt64;
  stallSeconds @4 :Float64;
  snapshotHostBytes @5 :UInt64;
  logHostBytes @6 :UInt64;
  snapshotLentBytes @7 :UInt64;
  replicaMaps @8 :UInt64;   # copies of this stage replica's slots made so far by mapping
  replicaPulls @9 :UInt64;  # and by pulling
  captureCpuSeconds @10 :Float64;  # CPU time of the last capture
  windowsSkipped @11 :UInt64;  # windows captured nothing of so far (memory bound; hooks.hpp)
  peakRssBytes @12 :UInt64;    # the worker process's peak resident memory so far (VmHWM)
  # The compute thread's seconds in the policy's hooks this iteration: logging the boundary
  # tensors it sent (the upstream log), and the step's hooks less the stall.
  logSeconds @13 :Float64;
  stepHookSeconds @14 :Float64;
  freshBytes @15 :UInt64;  # of the last capture, bytes written into never-written memory
  # Step.verify's digests (XXH3), per operator in this replica's order (empty: none asked, or
  # a stage whose state lives on a GPU), and the compute thread's seconds computing them.
  digests @16 :List(UInt64);
  verifySeconds @17 :Float64;
  # The worker's actor-thread CPU time on snapshot replication since the last step (its agent's
  # and replicator's handlers; recovery/replication_cpu.hpp).
  replicationCpuSeconds @18 :Float64;
}
# Drop the iteration in progress (nothing was stepped); answered once dropped.
struct Abort {
  epoch @0 :UInt64;
}
struct AbortAck {
  groupAbortSeconds @0 :Float64;  # the NCCL group's abort (GPU stages with NCCL), else 0
}
# Something failed inside a stage (a pull, a computation); the coordinator decides.
struct StageFailed {
  stage @0 :Int32;
  replica @1 :Int32;
  message @2 :Text;
}

# ---- validation (replica 0's pipeline)

struct Validate {
  round @0 :UInt64;
  batches @1 :Int32;
}
struct ValActivation {
  round @0 :UInt64;
  index @1 :Int32;
  tensor @2 :Bulk.BulkDescriptor;
}
struct ValLoss {
  round @0 :UInt64;
  index @1 :Int32;
  loss @2 :Float64;
}

# ---- state

struct DigestsQuery {}
struct Digests {
  values @0 :List(UInt64);  # per operator, in canonical order
  # Expert parallelism: which of them are experts (the coordinator merges the EP ranks').
  experts @1 :List(Bool);
  names @2 :List(Text);  # the operators' names, in the same order
}

# The head, an iteration past cluster.iteration_timeout_ms, asks the worker of each stage that
# has not finished it where its compute thread is (engine/compute_watch.hpp): its agent answers,
# the stage actor being busy while its compute runs. One computing, not waiting for a peer, for
# longer than the limit is stuck (a hung kernel); one idle or waiting is waiting for another.
struct StageProbe {}
struct StageProbed {
  epoch @0 :UInt64;  # the newest epoch the stage began
  hasStage @1 :Bool;  # false: this worker runs no stage (now)
  state @2 :ComputeState;
  seconds @3 :Float64;  # how long it has been in that state
}
enum ComputeState {
  idle @0;       # between tasks: waiting for a message (its inputs, the head's)
  computing @1;  # running a task of its own
  waiting @2;    # within a task, waiting for its peers (an EP exchange, the device sum)
}

# A standby head that took over asks every live stage where it is (engine/takeover.hpp):
# the iteration in flight, if any, is dropped first (as Abort drops it, whatever its epoch).
struct StageStateQuery {}
struct StageState {
  epoch @0 :UInt64;    # the newest epoch the stage has seen
  known @1 :Bool;      # false: a rebuilt stage that has not iterated (stepped is unknown)
  stepped @2 :Int64;   # the last iteration it stepped (-1: none, the initial state)
  dropped @3 :Bool;    # an iteration was in flight and is dropped
  wiring @4 :UInt64;   # the newest wiring it was given
  window @5 :UInt64;   # its last step's checkpoint window, and that window's size (0: none)
  wSparse @6 :Int32;
  steps @7 :List(StepRecord);  # the step plans it keeps (Step.keepFrom on), oldest first
  # The next iteration's gradients are reduced here and wait for its Step (kept, not
  # dropped: the head may have been lost while its Steps went out, and other stages stepped).
  reduced @8 :Bool;
  slot @9 :UInt32;                  # its last step's slot in `window`
  popularity @10 :List(Float64);    # and that Step's popularity, as it came
  # The newest window the job persisted that it holds (policy moevement), and its first
  # iteration.
  hasPersisted @11 :Bool;
  persistedWindow @12 :UInt64;
  persistedFirst @13 :Int64;
}

# ---- checkpointing and recovery (policy moevement)

# A stage's checkpoint agent: every slot of `window` is stored on its replicators.
struct WindowReplicated {
  stage @0 :Int32;
  replica @1 :Int32;
  window @2 :UInt64;
  firstIteration @3 :Int64;
  scheduleDigest @4 :UInt64;  # which operators its slots hold: equal across a stage's replicas
}
# The coordinator: every stage has `window` replicated; older windows, and logs and plans
# before firstIteration, may go.
struct WindowPersisted {
  window @0 :UInt64;
  firstIteration @1 :Int64;
  # The durable tier: every stage writes this window to disk (in the background) and answers
  # DurableWritten. Set for one window at a time (the previous one written everywhere).
  durable @2 :Bool;
  # Older windows kept too, and logs and plans from retainedFirst on where it is >= 0 (dp = 1's
  # shadow checks replay from a window an earlier round of checks vouched for).
  retained @3 :List(UInt64);
  retainedFirst @4 :Int64 = -1;
  # Durable windows the stages keep on disk beside checkpoint.keep's newest: for a rollback
  # past a corruption a shadow check finds, the newest captured before each retained window.
  durableKept @5 :List(UInt64);
  # To replicators only: the job restarted from durable window `window` (a standby head went
  # back to disk, a resume): drop every copy held, and take windows after `window` again.
  restart @6 :Bool;
}
# The coordinator, when a recovery resumes the job at iteration `before`: windows begun before
# it and not persisted never will be (the lost stages' slots of them are gone, and
# their replacements capture from `before` on). A stage's agent drops its copies of them, or
# its bound on windows held would stall the next window.
struct WindowsAbandoned {
  before @0 :Int64;
}
# A stage's checkpoint agent: window `window` is on disk (error empty), or why not.
struct DurableWritten {
  stage @0 :Int32;
  replica @1 :Int32;
  window @2 :UInt64;
  bytes @3 :UInt64;
  seconds @4 :Float64;
  error @5 :Text;
  cpuSeconds @6 :Float64;  # the writer thread's CPU time (the head paces the writes by it)
}
# Coordinator -> a worker's replicator, before a rollback to the durable tier: which windows
# of (stage, replica) are on disk, complete and verified (written windows drained first).
struct DurableQuery {
  stage @0 :Int32;
  replica @1 :Int32;
}
struct DurableOffer {
  windows @0 :List(UInt64);  # verified, any order
  rejected @1 :List(Text);   # windows that did not verify, each with its reason
}
# What a replay of one iteration applies (the same on every stage).
struct StepRecord {
  iteration @0 :Int64;
  lossScale @1 :Float32;
  apply @2 :Bool;
  gradMul @3 :Float32;
  gradNorm @4 :Float64;
}
# Where one replica of the failed stage finds what it needs.
struct RestoreSource {
  slotHolders @0 :List(Address);   # replicators holding this replica's window (any order)
  upstream @1 :Address;            # the checkpoint agent of (stage - 1, replica); invalid at 0
  downstream @2 :Address;          # the checkpoint agent of (stage + 1, replica); invalid last
  survivor @3 :Address;            # the agent of this (stage, replica) when it is not lost
  # >= 0: take the window of this other replica of the stage (same shard) instead of this
  # replica's own: its copies are not trusted (it was fenced for silent data corruption), or,
  # from disk (durable), its files are gone or fail their checks.
  slotsFrom @4 :Int32 = -1;
}
# To a spare: become (stage, replica), rebuilt at the start of targetIteration from window
# `window` (hasWindow false: from the initial state, replaying from iteration 0), jointly
# with the region firstStage..lastStage it lies in (contiguous lost stages). A region that
# grew (a cascading failure) is restored again under a newer generation, also by spares
# that already finished an older one.
struct Restore {
  stage @0 :Int32;
  replica @1 :Int32;
  targetIteration @2 :Int64;
  hasWindow @3 :Bool;
  window @4 :UInt64;
  firstIteration @5 :Int64;
  wSparse @6 :Int32;
  sources @7 :List(RestoreSource);  # [(s - firstStage) * dp + replica] for s in the region
  steps @8 :List(StepRecord);       # firstIteration .. targetIteration - 1
  coordinator @9 :Address;
  firstStage @10 :Int32;
  lastStage @11 :Int32;
  generation @12 :UInt64;
  # The durable tier's rollback: the region is the whole pipeline, window `window` comes from
  # each stage replica's files under checkpoint.dir (sources name no holders), and nothing is
  # pulled from peers.
  durable @13 :Bool;
  # Restores the coordinator runs at once on this worker's host (>= 1; 0 from an older head:
  # 1). With checkpoint.replay_threads = 0 each replay takes its share of the host's cores,
  # never all of them each (replays competing for the cores collapse).
  hostShare @14 :Int32;
  # A durable Restore of a window written at another layout (`moevement launch --resume` on
  # another pp or dp): the window's pipeline depth and replicas (0: this job's). Every stage
  # replica of that layout is replayed, then this role's operators are taken from it.
  windowStages @15 :Int32;
  windowReplicas @16 :Int32;
  # The recovery group replays in parallel (dp > 1): [replica] the group exchange of the
  # worker holding (stage, replica) in this generation, survivors included. This worker then
  # replays only its own replica of the region and sums the gradients with these peers after
  # each iteration, in replica order. Empty: it replays every replica itself.
  group @17 :List(Address);
  # A joint region (firstStage < lastStage) replayed as a pipeline: [s - firstStage] the group
  # exchange of the worker replaying (s, replica) in this generation. This worker then replays
  # only its own stage, taking the boundary tensors of its region neighbours from them live and
  # sending them its own; the logs of the healthy stages outside serve the region's ends.
  # Empty: it replays every stage of the region itself.
  pipeline @18 :List(Address);
  # With windowStages: the window's expert parallelism (0: 1).
  windowEp @19 :Int32;
  # A judge's replay (Judge): every replica's copy of the window must hold the same state, or
  # the restore fails saying which differ (a judge trusts only a window the replicas agree on).
  judge @20 :Bool;
}

# The head -> an idle spare's worker agent, where a stage's replicas disagree with no majority
# (docs/recovery.md "Silent data corruption"): replay `restore` (one stage, every replica of
# its group replayed here) and answer the digests (engine::operator_digests) of the replica it
# names; nothing of it stays on the spare, which is still a spare.
struct Judge {
  restore @0 :Restore;
}
struct Judged {
  digests @0 :List(UInt64);
  error @1 :Text;  # non-empty: no verdict (the window's copies differ, a pull failed, ...)
}

# ---- the recovery tree (recovery/job_supervisor.hpp, recovery/region_supervisor.hpp)

# A region's supervisor -> the coordinator, before it starts its children (the first time,
# after a member's worker was lost, after the region grew): begin a new generation of region
# `region` (a spare for every role whose worker is gone, the Restores sent) and say on which
# worker each member runs now.
struct RegionRestart {
  region @0 :UInt64;
}
struct RegionMembers {
  nodes @0 :List(UInt32);  # [member] its worker, in the order the region's children start
  error @1 :Text;          # non-empty: the region cannot go on (no spare left, job ended)
}

# The job supervisor (recovery/job_supervisor.hpp) -> the coordinator: region `region`'s
# supervisor gave up (past checkpoint.region_restarts, or it could not start its children);
# the job's strategy decides (the durable tier's rollback of the whole job, or the job stops).
struct RegionEscalated {
  region @0 :UInt64;
  reason @1 :Text;  # the region supervisor's exit reason
}

# Coordinator -> a worker's group exchange (the policy's, engine/checkpoint.hpp
# group_exchange): generation `generation` of a recovery group's parallel replay begins (or,
# at the job's end, one past the last): a replay of an older generation still waiting there
# for its peers' gradients ends (its peers moved on, or the job did).
struct ReplayGeneration {
  generation @0 :UInt64;
}

# ---- global rollback (policies dense-memory, dense-disk, pec; docs/policies.md)

# Coordinator -> a stage's checkpoint agent, every stage paused: which checkpoints (state
# iterations) this stage can load, each verified. A replacement looks for its copies on
# `holders` (every live worker's checkpoint holder).
struct RollbackQuery {
  holders @0 :List(Address);
}
struct RollbackOffer {
  iterations @0 :List(Int64);  # verified, any order; 0 (the initial state) is always offered
  rejected @1 :List(Text);     # candidates that did not verify, each with its reason
}
# Load checkpoint `iteration` into the stage: the whole job restarts there.
struct RollbackLoad {
  iteration @0 :Int64;
  interval @1 :Int32;  # the job's checkpoint interval k (captures go on from `iteration`)
}
struct RollbackLoaded {
  error @0 :Text;                # non-empty: nothing usable was loaded (what went wrong)
  source @1 :Text;               # where the bytes came from
  bytes @2 :UInt64;              # checkpoint bytes loaded
  # pec: per MoE layer of this stage (model order), tokens routed to experts restored older
  # than `iteration` since their save (summed over the stage's replicas), and how many such
  # stale experts there are.
  lostTokens @3 :List(Int64);
  staleExperts @4 :UInt32;
}
