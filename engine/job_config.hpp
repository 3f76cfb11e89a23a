// The job configuration of `moevement launch`: the model.* and train.* keys (models/config.hpp)
// plus the engine's own sections parallel.*, checkpoint.*, cluster.*, engine.*, resolved from the
// flat config_map the launcher reads from TOML and --set. Every engine default lives in
// job_config below (docs/configuration.md lists them; a test checks).
//
// On the wire (job_config.capnp) the head sends the unresolved map; each worker resolves it
// again with resolve_job, so head and workers agree by construction.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "base/result.hpp"
#include "engine/job_config.capnp.h"
#include "models/config.hpp"

namespace moevement::engine {

// The knobs of the baseline policies dense-memory, dense-disk and pec (checkpoint.*): the one
// place their defaults live (recovery::policy_config starts from these; docs/policies.md).
struct baseline_knobs {
  // checkpoint.interval: iterations between two checkpoints; 0 = Young's optimum
  // round(sqrt(2 * C * MTBF) / T) from the measured snapshot cost C and iteration time T.
  int interval = 0;
  // checkpoint.mtbf_s: the job's mean time between failures (Young's MTBF), seconds. One
  // hour: a failure rate that makes Young's k visible on the CPU presets.
  double mtbf_s = 3600.0;
  // checkpoint.dir: where dense-disk and the durable tier persist (stage-<s>-replica-<d>/
  // under it). Unset: beside the run log, named after it (resolve_job: run.jsonl ->
  // run.checkpoints, engine.run_log's default), so that every run has its own.
  std::string dir = "run.checkpoints";
  // checkpoint.keep: verified snapshots kept on disk per stage replica (>= 2, so that a
  // corrupt newest one always has a previous good one behind it).
  int keep = 2;
  // checkpoint.pec_experts: K, experts per MoE layer saved in full per PEC checkpoint.
  int pec_experts = 1;
  // checkpoint.pec_order: sequential (MoC-System's default) or load-aware.
  std::string pec_order = "sequential";
  bool operator==(const baseline_knobs&) const = default;
};

// checkpoint.policy, parsed once (policy_name() spells it back).
enum class policy_kind : std::uint8_t { none, moevement, dense_memory, dense_disk, pec };
std::string policy_name(policy_kind policy);
// How a policy brings a lost worker back: not at all (none), by localized recovery from the
// sparse window (moevement), or by a global rollback to a checkpoint (the baselines).
enum class recovery_kind : std::uint8_t { none, localized, rollback };
recovery_kind recovery_of(policy_kind policy);

struct job_config {
  models::model_config model;
  models::train_config train;  // train.data_parallel == dp
  int pp = 1;                  // parallel.pp: pipeline stages
  int dp = 1;                  // parallel.dp: data-parallel replicas of each stage
  int ep = 1;  // parallel.ep: each stage's experts sharded over EP groups of ep replicas
  policy_kind policy = policy_kind::none;  // checkpoint.policy
  int w_sparse = 0;  // checkpoint.w_sparse: iterations per window; 0 = Algorithm 1
  // checkpoint.max_overhead: with Algorithm 1's W (w_sparse 0), the fraction of the iteration
  // time capturing may cost before the head raises W (recovery/window_tuner.hpp); 0: W stays
  // Algorithm 1's.
  double max_overhead = 0.01;
  // checkpoint.durable_share: on CPU stages, the share of the hosts' cores the durable tier's
  // writes may take: after a window is written, the next is written only once the writers'
  // CPU time is this share of the cores' time since the last write began (persisted windows
  // in between are not written). 0: every window it can (one at a time). GPU stages: unpaced.
  double durable_share = 0.01;
  // checkpoint.window_rule: how the head re-chooses Algorithm 1's W at window starts:
  // "overhead" keeps capturing under max_overhead; "ettr" picks the W that maximises the
  // predicted ETTR under checkpoint.mtbf_s (the capture's measured cost against the replay a
  // failure costs).
  bool window_by_ettr = false;
  int snapshot_replicas = 2;  // checkpoint.replicas: copies of every snapshot slot (r)
  // checkpoint.replay_threads: GEMM threads of a moevement recovery's replay (the stages
  // outside its region are paused meanwhile); 0 = this host's cores.
  int replay_threads = 0;
  // checkpoint.region_restarts: a recovery region's restart intensity. A region restarts when
  // a loss in or next to it comes while it recovers (it grows); past this many restarts in
  // one recovery it escalates to the job: under `moevement` with the durable tier the whole
  // job rolls back to disk, otherwise the job stops (the baselines' rollback is one region).
  int region_restarts = 3;
  // checkpoint.max_window_wait_ms: how long a step that would start a fourth window waits for
  // the job to persist one (memory stays at three windows); past it the window is skipped.
  int max_window_wait_ms = 10000;
  // checkpoint.log_fetch_bytes: a recovery fetches a neighbour's upstream log in answers of at
  // most this many bytes (whole iterations, at least one each): each is a region the neighbour
  // allocates and registers for it, and a large model's 2 x W iterations of log can exceed
  // what one answer may hold (policy_limits::max_log_bytes, 8 GiB).
  std::uint64_t log_fetch_bytes = std::uint64_t(256) << 20;
  // checkpoint.verify_every: silent-corruption checks (docs/recovery.md "Silent data
  // corruption"). With dp > 1 every stage replica digests its compute weights after every step
  // and its whole state (master, m, v, step) every verify_every-th; the head compares a stage's
  // replicas before the next iteration starts. 0: no checks. 32: measured within the noise of
  // no checks on the demo (docs/benchmarks.md); the compute weights, which keep every bit that
  // reaches the computation, are checked every step whatever it is.
  int verify_every = 32;
  // checkpoint.shadow_every: every shadow_every iterations an idle spare replays one stage
  // (in turn) and the head compares the result with the live stage: what finds silent
  // corruption with one copy (dp = 1). Policy moevement; 0: never.
  int shadow_every = 0;
  // checkpoint.shadow_coverage: "recent" (false), each check replays from the persisted window
  // (W_sparse to about 2 W iterations: cheap, blind to a corruption that window captured);
  // "full" (true), from a window earlier checks vouched for (recovery/shadow_windows.hpp):
  // every iteration is replayed once or more, at about the cost of training that stage again.
  bool shadow_full = false;
  // checkpoint.share_memory: a `moevement` replica on the owner's host maps the slot's memory
  // instead of copying it (transport/shared_memory.hpp); false: every replica pulls a copy.
  bool share_memory = true;
  // checkpoint.pipelined_replay: a joint region (several contiguous stages lost together)
  // replays as a pipeline, each member only its own stage, the tensors between them passing
  // live; false: each member replays every region stage of its replica (one stage's compute
  // per member against the region's; the same bits either way).
  bool pipelined_replay = true;
  // checkpoint.spread_replay: a lost stage's recovery group (every replica of its stage) replays
  // spread over its workers, each replica on its own, survivors rolled back on theirs; false:
  // each replacement replays the whole group in its process and keeps its replica (dp times a
  // replica's compute per replacement; the same bits either way).
  bool spread_replay = true;
  std::string ordering = "popularity";  // checkpoint.ordering: what orders a window's operators
  double decay_alpha = 0.9;             // checkpoint.decay_alpha: time-decayed history weight
  double reorder_change = 0.10;    // checkpoint.reorder_change: an expert's popularity moved by
  double reorder_fraction = 0.25;  // checkpoint.reorder_fraction: for this share of experts
  // checkpoint.durable: the durable tier (persisted windows on disk, under checkpoint.dir).
  // Unset ("auto", the default): on for dense-disk (whose checkpoints are the disk) and for
  // moevement on the local backend, or under Slurm where checkpoint.dir is set; off for the
  // others. durable_tier() resolves it, the one place that default lives.
  std::optional<bool> durable;
  baseline_knobs baseline;        // checkpoint.interval, .mtbf_s, .dir, .keep, .pec_*
  std::string backend = "local";  // cluster.backend: local | slurm
  int spares = 0;                 // cluster.spares: idle workers beside pp*dp
  // cluster.standby_head: `launch` also starts a standby head, which takes over when the head
  // is lost (docs/recovery.md "Head failover"). Off: a lost head ends the job (--resume).
  bool standby_head = false;
  std::string host = "127.0.0.1";     // cluster.host: where the head listens
  std::string stage_type = "moe";     // engine.stage: a stage_registry name
  std::string run_log = "run.jsonl";  // engine.run_log: path of the JSONL run log
  std::int64_t heartbeat_ms = 100;    // cluster.heartbeat_ms
  // cluster.failure_timeout_ms: silence => dead. Above a one-second stall (a loaded host, a
  // page-faulting copy, a SYN retry), which must not cost a recovery; a hung peer is still
  // found within 1.6 s (a dead one at once: its connection fails).
  std::int64_t failure_timeout_ms = 1500;
  std::int64_t abort_at = -1;  // engine.abort_at: abort this iteration once (tests)
  // engine.head_exit_at: at this iteration the head sends its Step to the first half of the
  // stages only, then kills itself (tests of a standby's takeover; never a standby's own).
  std::int64_t head_exit_at = -1;
  // engine.durable_write_delay_ms: every durable window write waits this long first (tests of
  // a rollback that must wait for a write in flight, as on a loaded host); 0: none.
  std::int64_t durable_write_delay_ms = 0;
  // engine.durable_fail_from: the last stage's replica 0 fails its durable writes of this window
  // and later (tests of a role whose disk fails); -1: never.
  std::int64_t durable_fail_from = -1;
  std::int64_t start_timeout_ms = 30000;  // cluster.start_timeout_ms: workers must join by then
  // cluster.iteration_timeout_ms: an iteration some stage has not finished by then, its worker
  // alive (a hung kernel or collective, a deadlock: heartbeats flow, nothing moves): a stage
  // stuck in its compute is fenced and rebuilt, else the job ends naming the stages; 0 never.
  // Ten minutes, as a collective library's own watchdog: far above any iteration a job means to
  // run, and a recovery's time does not count.
  std::int64_t iteration_timeout_ms = 600000;
  std::string slurm_partition;  // cluster.slurm_partition: "" = Slurm's default
  int slurm_nodes = 0;          // cluster.slurm_nodes: srun -N; 0 = Slurm chooses

  int workers() const { return pp * dp; }
  bool operator==(const job_config&) const = default;
};

// The node id of the standby head (cluster.standby_head): after every worker and spare.
inline std::uint32_t standby_node(const job_config& j) {
  return std::uint32_t(j.workers() + j.spares + 1);
}

// Whether the job writes persisted windows to disk (checkpoint.durable resolved): unless set,
// on for dense-disk, and for moevement on the local backend or with checkpoint.dir given (under
// Slurm the default directory would be on each node's own disk); off for the others.
bool durable_tier(const job_config& job);
// checkpoint.dir's default: beside the run log, named after it (run.jsonl -> run.checkpoints).
std::string checkpoint_dir_beside(const std::string& run_log);

// The GEMM threads of a recovery's replay: checkpoint.replay_threads when set (> 0), else
// the cores this process may run on divided among the `host_share` replays on its host (at least
// one each): replays that each take every core collapse when they share a host.
int replay_threads_for(int configured, int host_share, int cores);

// Upper bound on pp*dp + cluster.spares (processes of one job).
inline constexpr int max_job_workers = 256;
// The largest cluster.heartbeat_ms and cluster.failure_timeout_ms, which the workers' flags
// take as well (one bound: a config the head took must not stop every worker at its start).
inline constexpr std::int64_t max_heartbeat_ms = 60'000;
inline constexpr std::int64_t max_failure_timeout_ms = 3'600'000;

// Consumes every key of the map: model.* and train.* (models::apply_config) and the engine's
// sections. An unknown key, a wrong type or a bad value throws models::config_error naming the
// key, saying what is allowed. Cross-checks: parallel.pp <= model.layers for stage type "moe";
// pp*dp + spares <= max_job_workers; checkpoint.policy and cluster.backend name choices that
// exist, and only those this version runs. engine.stage is checked against the stage registry
// by the launcher, not here (only its spelling is checked here).
job_config resolve_job(models::config_map map);

// The engine's own keys (parallel.*, checkpoint.*, cluster.*, engine.*); the model.* and
// train.* keys are models::config_keys().
std::vector<std::string> job_config_keys();

// The policy names of checkpoint.policy, in documentation order, and those this version runs.
std::vector<std::string> checkpoint_policy_names();
// The sparse schedule's operator orderings (paper section 3.2, appendix B).
std::vector<std::string> ordering_names();
bool policy_available(const std::string& name);

// Limits on a config read from the wire (untrusted). Defaults live here and only here.
struct config_wire_limits {
  std::size_t max_entries = 1024;
  std::size_t max_key_bytes = 128;
  std::size_t max_text_bytes = 4096;
};

// The map as sent by the head (before resolution).
void write_config(wire::JobConfig::Builder out, const models::config_map& map);
// Checks everything (entry count, key spelling and length, text length, duplicates, unknown
// union members, malformed pointers) and never throws: a bad input is an error result.
result<models::config_map> read_config(wire::JobConfig::Reader in,
                                       const config_wire_limits& limits = {});
// Whether the workers will take `map` from the head (write_config then read_config under the
// same limits): the head checks it before any worker starts, so that a value too long for the
// wire is an error at once, naming the key, not a failure of every worker.
result<void> fits_the_wire(const models::config_map& map, const config_wire_limits& limits = {});

}  // namespace moevement::engine
