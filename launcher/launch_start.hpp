// What `moevement launch` checks and opens before its head starts: the run log's path, the
// job's locks, under the durable tier its directory and the resume journal, a --resume of a job
// that ended, and --dry-run. Each refusal names the key or the option to change.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "engine/job_config.hpp"
#include "launcher/launch_options.hpp"
#include "recovery/resume_journal.hpp"

namespace moevement::launcher {

// Where the run log goes, checked before anything is made beside it (its checkpoint.dir by
// default): a bad engine.run_log is named as such, not as the directory made from it, and a
// --report `report` that would overwrite it is refused before the job runs. Throws
// std::invalid_argument.
void check_run_log_path(const std::string& path, const std::string& report = "");

// Whether this launch journals its durable windows (policy moevement with the durable tier,
// not a --sbatch submission): what --resume needs.
bool journaled_job(const launch_options& o, const engine::job_config& job);

// The point a resume goes on from, read from `journal` (the windows it rejects said on
// stderr, each prefixed with `what`). Throws what is wrong: no usable journal, another job's,
// or one past train.iterations.
engine::resume_point resume_point_of(const recovery::resume_journal& journal,
                                     const engine::job_config& job, const std::string& what);

// For --resume: whether the job's run log says it ended (its last run's job_end, at
// train.iterations or past them): then it says so with that end's state_hash, and there is
// nothing to go on with. False when it was killed, stopped, failed, or is asked to train on.
bool said_job_ended(const engine::job_config& job);

// What the injections lose that the job cannot recover from, said as a warning ("" when none):
// more worker losses than cluster.spares, or any loss under checkpoint.policy = "none".
std::string injected_beyond_recovery(const std::vector<injection>& injections,
                                     const engine::job_config& job);

// `launch --dry-run`: what the start would check (the built-in stage's corpus; a --resume's
// journal, read, not written), said; exit status 0, or throws what is wrong.
int dry_run(const launch_options& o, const engine::job_config& job);

// An exclusive lock (flock) on a running job's run log and, when it journals its durable
// windows (journaled_job), its checkpoint.dir: a second head on the same files (a --resume started
// while the job still runs, the same config launched twice) is refused instead of both writing
// them. Released when this process ends (never inherited by the workers it starts). On a file
// system without locks, none is held.
class job_lock {
 public:
  // Throws std::runtime_error naming the key another process holds. `patience`: how long to
  // wait for a holder to let go first (a requeued job's dead predecessor on a network file
  // system, whose locks outlive it until its lease ends).
  static job_lock take(const engine::job_config& job, bool journaled,
                       std::chrono::seconds patience = std::chrono::seconds(0));
  // The same, but holds what it can and throws nothing (a standby head taking over from a
  // hung head, which holds the locks until it is gone).
  static job_lock try_take(const engine::job_config& job, bool journaled);
  // Every lock it was to take is held (try_take may hold fewer).
  bool holds_all() const { return fds_.size() == wanted_; }
  // Its descriptors: the local backend's standby head is started holding them too (the same
  // locks, released when both processes are gone), so that no `--resume` starts between the
  // head's death and the standby's takeover.
  const std::vector<int>& fds() const { return fds_; }
  // The locks a standby was started holding, as descriptors `fds`.
  static job_lock adopt(std::vector<int> fds);
  job_lock() = default;
  job_lock(job_lock&& o) noexcept;
  job_lock& operator=(job_lock&& o) noexcept;
  job_lock(const job_lock&) = delete;
  job_lock& operator=(const job_lock&) = delete;
  ~job_lock();

 private:
  static job_lock lock(const engine::job_config& job, bool journaled, bool must);
  std::vector<int> fds_;
  std::size_t wanted_ = 0;
};

// The head's journal of durable windows (policy moevement with the durable tier): read by a
// resume (the point it starts from), started afresh by a new job; under --dry-run only read
// (a --resume's point checked, nothing written). Throws what to change.
std::optional<engine::resume_point> open_journal(const launch_options& o,
                                                 const engine::job_config& job,
                                                 std::optional<recovery::resume_journal>& journal);

}  // namespace moevement::launcher
