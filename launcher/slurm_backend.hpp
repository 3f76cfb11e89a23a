// The Slurm backend of `moevement launch` (cluster.backend = "slurm", docs/slurm.md).
//
// The launch process is the head (node 0: coordinator, progress, run log). It starts every
// worker and spare as the tasks of ONE `srun` step; each task runs
// `moevement worker --slurm ...`, computes its role from Slurm's environment with
// place_workers() (every task computes the same placement, so no message is needed), and
// becomes the coordinator's node for that role. The job token travels in the environment
// (MOEVEMENT_JOB_TOKEN), never on a command line.
#pragma once

#include <sys/types.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/job_config.hpp"
#include "engine/stage_registry.hpp"
#include "launcher/placement.hpp"
#include "launcher/slurm_env.hpp"

namespace moevement::launcher {

// How long the head waits for srun to end on its own after the job (the workers leave on
// Shutdown), and then after SIGTERM (srun ends the step: SIGTERM to the tasks, SIGKILL after
// the cluster's KillWait), before it scancels the step and kills srun.
inline constexpr int srun_grace_ms = 3000;
// A batch job submitted with --sbatch is signalled (SIGUSR1) this long before its time limit:
// time for the next durable window to reach the disk (Slurm signals within about a minute of
// the time asked for). sbatch options after `--` may say otherwise (--signal).
inline constexpr int requeue_signal_s = 180;
inline constexpr int srun_term_wait_ms = 8000;

// Where srun's output goes: the run log's path with ".jsonl" (if any) replaced by ".slurm.log".
std::string slurm_output_path(const std::string& run_log);

// What the head passes to every task besides Slurm's own environment.
struct slurm_task_args {
  std::string head;         // HOST:PORT of the head
  std::string worker_host;  // address workers listen on; "" = their node name, resolved
  int pp = 1, dp = 1, spares = 0;
  long heartbeat_ms = 100, failure_timeout_ms = 1000;
  std::vector<std::string> injections;  // phase=... specs (launcher/inject.hpp), as --inject
};

// The full srun command line (argv[0] = "srun"). step_name names the step (and the job, when
// srun makes its own allocation) so that it can be found for scancel. in_allocation: the head
// runs inside a Slurm job (SLURM_JOB_ID set); outside one srun asks for an allocation and
// gives up after cluster.start_timeout_ms (--immediate) instead of queueing for ever.
std::vector<std::string> srun_command(const engine::job_config& job, const std::string& self,
                                      const slurm_task_args& args, const std::string& step_name,
                                      bool in_allocation);

// A task's role, from its Slurm environment.
struct slurm_role {
  int task = 0;                  // SLURM_PROCID
  int ntasks = 0;                // SLURM_NTASKS
  std::string node_name;         // SLURMD_NODENAME
  int node_index = 0;            // in the step's node list
  int stage = -1, replica = -1;  // -1: a spare
  std::uint32_t node_id = 0;     // the coordinator's node id for this role (see below)
};

// Places the step (place_workers on SLURM_STEP_TASKS_PER_NODE) and returns this task's role.
// The coordinator numbers node n = replica * pp + stage + 1 for workers and pp*dp + 1 + k for
// the k-th spare, so that is the node id. Throws slurm_env_error / placement_error with a
// message saying what to change when the step does not match the job (task count, ...).
slurm_role slurm_role_of(const slurm_env& env, int pp, int dp, int spares);

// `moevement launch` run as one of several tasks of a Slurm step (`srun -n N moevement launch`):
// each would be a head of its own job. Says so, or nothing (one task, or not in a step).
std::optional<std::string> launched_by_many_tasks();

// Before starting srun: checks what can be checked in this process's environment (srun on
// PATH; inside an allocation, enough tasks). Returns an error message, or nullopt.
std::optional<std::string> slurm_precheck(const engine::job_config& job);

// cluster.spares raised so that workers + spares divide by cluster.slurm_nodes: srun spreads
// a step's tasks evenly (--ntasks-per-node) only then, and otherwise fills the first node,
// where a stage's replicas and every spare could share one node's fate. The extra tasks are
// spares in slots --ntasks-per-node reserves anyway. job.spares where nothing is to round.
int spares_filling_nodes(const engine::job_config& job);

// `moevement worker --slurm --head HOST:PORT --pp P --dp D --spares S [--host H]
// [--heartbeat-ms X] [--failure-timeout-ms Y]`: a task of the step. Computes its role and
// runs run_worker() as that node.
int run_slurm_worker(int argc, char** argv, const engine::stage_registry& registry);

// `moevement launch --requeue`, stopped on SIGUSR1 with `window` on disk: requeues this Slurm
// batch job (scontrol requeue SLURM_JOB_ID), which then starts again and resumes from it.
// Prints what it did, or why it could not (not a batch job, not requeueable).
void requeue_slurm_job(std::uint64_t window);

// `moevement launch CONFIG [--set k=v ...] --sbatch [-- SBATCH_OPTION ...]`: writes a batch
// script that runs the same launch (the head) inside its allocation, submits it with sbatch
// for pp x dp + spares tasks (cluster.slurm_nodes, cluster.slurm_partition; the options after
// `--` go to sbatch as they are), prints the job id and where its output goes, and returns.
// With the durable tier the job is requeueable (docs/slurm.md).
int submit_with_sbatch(const engine::job_config& job, const std::string& config_path,
                       const std::vector<std::string>& overrides,
                       const std::vector<std::string>& sbatch_args);

class slurm_step;

// The head's side: starts the srun step of every worker and spare (printing the step's name
// and where its output goes), with the token in its environment.
// injections: the phase=... specs every task carries out itself (launcher/inject.hpp).
// With cluster.standby_head the step outlives the head (the standby takes its workers over).
// append: the output file goes on (a resumed or requeued job's: each run's lines kept).
std::unique_ptr<slurm_step> start_slurm_step(const engine::job_config& job, const std::string& self,
                                             const std::string& head, const std::string& token,
                                             const std::vector<std::string>& injections = {},
                                             bool append = false);
// The standby head (cluster.standby_head) as a step of its own, one task running `self` with
// `standby_args` (launch CONFIG [--set ...] --standby-of HEAD --node N), outliving the head;
// inside an allocation it overlaps the workers' step (it idles until it takes over). Its
// output (after a takeover: the job's progress and its state_hash) goes to
// slurm_standby_output_path(job.run_log).
std::unique_ptr<slurm_step> start_slurm_standby(const engine::job_config& job,
                                                const std::string& self,
                                                const std::vector<std::string>& standby_args,
                                                const std::string& token, bool append = false);
std::string slurm_standby_output_path(const std::string& run_log);
// The batch script's body after its comment, for a job with a standby head: the head `head`
// (a quoted command line) as a child, whose signals it passes on, then a wait for the standby's
// step, which outlives a lost head; ends 0 where `run_log`'s last end is a job_end.
std::string batch_script_with_standby(const std::string& head, const std::string& run_log);
// The address a process in a Slurm task listens on: job_host where it is a loopback address
// (one host) or outside a task, else this task's node name resolved (SLURMD_NODENAME).
// Throws slurm_env_error when the node name does not resolve.
std::string slurm_task_host(const std::string& job_host);
// Why the job cannot go on once srun ended before it (how: "exited with status 1", ...):
// the last lines srun and the tasks wrote, and a hint for a wrong partition or too few tasks.
std::string slurm_step_ended_text(const engine::job_config& job, const slurm_step& step,
                                  const std::string& how);

// The srun process of a job, owned by the head.
class slurm_step {
 public:
  // Starts srun (own process group, output to output_path, the token in its environment).
  // outlive_head: srun does not end with this process (a standby head takes the job over).
  // append: output_path goes on rather than starting empty.
  slurm_step(std::vector<std::string> command, const std::string& token, std::string output_path,
             std::string step_name, bool outlive_head = false, bool append = false);
  slurm_step(const slurm_step&) = delete;
  slurm_step& operator=(const slurm_step&) = delete;
  ~slurm_step();

  pid_t pid() const { return pid_; }
  const std::string& output_path() const { return output_; }
  // The last lines srun and the tasks wrote (for error messages).
  std::string output_tail(std::size_t max_lines = 6) const;
  // srun ended with this wait status (reaped by the caller's waitpid).
  void exited(int status);
  bool running() const { return pid_ > 0 && !exited_; }
  // This process no longer owns srun (a standby head took the job over): nothing is stopped.
  void release() { pid_ = -1; }
  // Ends the step and reaps srun: waits grace_ms for it to exit, then SIGTERM (srun cancels
  // the step), then scancel of the step by name, then SIGKILL. Returns how it ended.
  std::string stop(int grace_ms);

 private:
  bool wait_for_exit(int ms);
  void scancel();

  pid_t pid_ = -1;
  bool exited_ = false;
  int status_ = 0;
  std::string output_, name_;
};

}  // namespace moevement::launcher
