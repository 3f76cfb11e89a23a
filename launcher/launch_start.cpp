#include "launcher/launch_start.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "engine/run_log_reader.hpp"
#include "models/data.hpp"
#include "recovery/atomic_file.hpp"

namespace moevement::launcher {

void check_run_log_path(const std::string& path, const std::string& report) {
  namespace fs = std::filesystem;
  std::error_code ec;
  std::error_code ec_report, ec_log;
  const fs::path report_at = fs::weakly_canonical(report, ec_report);
  const fs::path log_at = fs::weakly_canonical(path, ec_log);
  if (!report.empty() && !ec_report && !ec_log && report_at == log_at) {
    throw std::invalid_argument(fmt::format(
        "--report {}: that is the job's run log (engine.run_log); name another file, e.g. "
        "{}.html",
        report, fs::path(path).replace_extension().string()));
  }
  if (fs::is_directory(path, ec)) {
    throw std::invalid_argument(
        fmt::format("engine.run_log = {} is a directory: name a file (a .jsonl)", path));
  }
  const fs::path dir = fs::path(path).has_parent_path() ? fs::path(path).parent_path() : ".";
  if (!fs::is_directory(dir, ec) || ::access(dir.c_str(), W_OK | X_OK) != 0) {
    throw std::invalid_argument(fmt::format(
        "engine.run_log = {}: its directory {} does not exist or cannot be written: name a file "
        "in a writable directory",
        path, dir.string()));
  }
}

namespace {

// A new job: every stage replica's windows an earlier job left, of any layout (each worker
// clears its own too; those of roles this layout lacks would stay for good).
void remove_stage_directories(const std::filesystem::path& dir) {
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    int s = 0, d = 0, end = 0;
    if (std::sscanf(name.c_str(), "stage-%d-replica-%d%n", &s, &d, &end) == 2 &&
        std::size_t(end) == name.size() && e.is_directory(ec)) {
      std::filesystem::remove_all(e.path(), ec);
    }
  }
}

}  // namespace

std::optional<engine::resume_point> open_journal(const launch_options& o,
                                                 const engine::job_config& job,
                                                 std::optional<recovery::resume_journal>& journal) {
  const bool journaled = journaled_job(o, job);
  if (o.resume && !journaled) {
    throw std::invalid_argument(
        "--resume needs the durable tier of policy moevement: the job must run with "
        "checkpoint.policy = \"moevement\" and checkpoint.durable = true (its windows and "
        "journal are under checkpoint.dir)");
  }
  if (!journaled) return std::nullopt;
  if (o.dry_run) {  // reads what a resume would, writes nothing
    if (!o.resume) return std::nullopt;
    journal.emplace(job);
    return resume_point_of(*journal, job, "--resume");
  }
  // Every window and the journal go there: a directory that cannot be written fails every
  // write of the job, so it is refused before anything starts.
  std::string why;
  try {
    recovery::create_private_directories(job.baseline.dir);  // 0700, as the writers make it
    if (::access(job.baseline.dir.c_str(), W_OK | X_OK) != 0) why = std::strerror(errno);
  } catch (const std::exception& e) {
    why = e.what();
  }
  if (!why.empty()) {
    throw std::invalid_argument(fmt::format(
        "checkpoint.dir = {} cannot be written ({}): the durable tier writes its windows "
        "there; set checkpoint.dir to a writable directory, or checkpoint.durable = false",
        job.baseline.dir, why));
  }
  journal.emplace(job);
  if (!o.resume && !o.requeued) {
    if (!journal->empty()) {
      std::cout << fmt::format(
          "moevement launch: checkpoint.dir = {} held an earlier run's durable windows: this "
          "launch starts the job anew and removes them (`--resume` goes on from them instead)\n",
          job.baseline.dir);
    }
    journal->clear();
    remove_stage_directories(job.baseline.dir);
    return std::nullopt;
  }
  if (o.requeued && !o.resume && journal->empty()) {
    // Requeued before its first window reached the disk: nothing was kept, so from the start.
    std::cout << "moevement launch: requeued by Slurm with no window on disk yet: starting "
                 "from the beginning\n";
    journal->clear();
    return std::nullopt;
  }
  auto point = resume_point_of(*journal, job, o.resume ? "--resume" : "requeued job's resume");
  if (o.requeued) {
    std::cout << fmt::format("moevement launch: requeued by Slurm: resuming from window {}\n",
                             point.window);
  }
  return point;
}

engine::resume_point resume_point_of(const recovery::resume_journal& journal,
                                     const engine::job_config& job, const std::string& what) {
  std::vector<std::string> rejected;
  auto point = journal.load(&rejected);
  for (const auto& r : rejected) std::cerr << "moevement launch: " << what << ": " << r << "\n";
  if (!point.ok()) throw std::runtime_error(what + ": " + point.err().message);
  if (point->target_iteration > job.train.iterations) {
    throw std::runtime_error(fmt::format(
        "{}: the checkpoint in {} goes on at iteration {}, past train.iterations = {}: resume "
        "with train.iterations of at least {} (the job's own, say), or run the job anew in "
        "another checkpoint.dir",
        what, job.baseline.dir, point->target_iteration, job.train.iterations,
        point->target_iteration));
  }
  return std::move(*point);
}

namespace {

std::optional<std::string> ended_job_hash(const engine::job_config& job) {
  const auto log = engine::read_run_log(job.run_log);
  if (!log.ok() || !log->stopped.empty()) return std::nullopt;  // torn at the end: killed
  for (auto r = log->records.rbegin(); r != log->records.rend(); ++r) {
    if (r->is("event", "job_end")) {
      const auto hash = r->text("state_hash");
      const auto its = r->number("iterations");
      if (!hash || !its || *its < double(job.train.iterations)) return std::nullopt;
      return hash;
    }
    if (r->is("event", "job_start") || r->is("event", "job_failed") ||
        r->is("event", "job_stopped")) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

}  // namespace

bool said_job_ended(const engine::job_config& job) {
  const auto hash = ended_job_hash(job);
  if (!hash) return false;
  std::cout << fmt::format(
      "moevement launch: --resume: the job already ended (train.iterations = {}; its run log {} "
      "ends with job_end): nothing to resume; raise train.iterations to train on\n"
      "state_hash={}\n",
      job.train.iterations, job.run_log, *hash);
  return true;
}

std::string injected_beyond_recovery(const std::vector<injection>& injections,
                                     const engine::job_config& job) {
  // Each kill, hang or stall loses a worker (scope=host maybe more), which a spare replaces;
  // an mtbf spec loses up to its max= (cluster.spares where not given), a trace its lines.
  // One before training starts (during=start) costs no recovery, under any policy.
  std::size_t losses = 0, in_training = 0;
  for (const injection& i : injections) {
    using k = injection::kind;
    std::size_t n = 0;
    if (i.what == k::kill || i.what == k::hang || i.what == k::stall) n = 1;
    if (i.what == k::mtbf) n = std::size_t(i.max_failures >= 0 ? i.max_failures : job.spares);
    if (i.what == k::trace) n = read_trace(i.file).size();
    losses += n;
    if (!i.during_start || i.delay_ms > 0) in_training += n;  // (delayed: maybe in training)
  }
  if (losses == 0) return "";
  if (job.policy == engine::policy_kind::none && in_training > 0) {
    return "checkpoint.policy = \"none\" recovers from nothing: the first injected failure "
           "in training ends the job";
  }
  if (losses > std::size_t(job.spares)) {
    return fmt::format(
        "{} worker losses injected and cluster.spares = {}: the job stops when no spare is left "
        "(raise cluster.spares)",
        losses, job.spares);
  }
  return "";
}

int dry_run(const launch_options& o, const engine::job_config& job) {
  check_run_log_path(job.run_log, o.report);
  // What the built-in stage reads first: a corpus it cannot read is a config error here, as it
  // is to `moevement train`, not each worker's at its start.
  if (job.stage_type == "moe") {
    (void)models::corpus::load(job.train.corpus, job.train.val_fraction, job.train.seq_len);
  }
  std::optional<recovery::resume_journal> journal;
  if (const auto from = open_journal(o, job, journal)) {  // --resume: read, checked
    std::cout << fmt::format(
        "moevement launch: dry run: --resume would go on from window {} (iteration {})\n",
        from->window, from->target_iteration);
  }
  if (const auto warning = injected_beyond_recovery(o.injections, job); !warning.empty()) {
    std::cout << "moevement launch: dry run: warning: " << warning << "\n";
  }
  std::cout << fmt::format(
      "moevement launch: dry run: the config and {} injection(s) are valid; nothing started\n",
      o.injections.size());
  return 0;
}

bool journaled_job(const launch_options& o, const engine::job_config& job) {
  return job.policy == engine::policy_kind::moevement && engine::durable_tier(job) && !o.sbatch;
}

job_lock::job_lock(job_lock&& o) noexcept
    : fds_(std::exchange(o.fds_, {})), wanted_(std::exchange(o.wanted_, 0)) {}

job_lock& job_lock::operator=(job_lock&& o) noexcept {
  if (this != &o) {
    for (int fd : fds_) ::close(fd);
    fds_ = std::exchange(o.fds_, {});
    wanted_ = std::exchange(o.wanted_, 0);
  }
  return *this;
}

job_lock::~job_lock() {
  for (int fd : fds_) ::close(fd);
}

job_lock job_lock::take(const engine::job_config& job, bool journaled,
                        std::chrono::seconds patience) {
  const auto until = std::chrono::steady_clock::now() + patience;
  while (std::chrono::steady_clock::now() < until) {
    auto held = lock(job, journaled, false);
    if (held.holds_all()) return held;
    std::this_thread::sleep_for(std::chrono::seconds(1));
  }
  return lock(job, journaled, true);
}

job_lock job_lock::adopt(std::vector<int> fds) {
  job_lock held;
  held.wanted_ = fds.size();
  held.fds_ = std::move(fds);
  for (int fd : held.fds_) ::fcntl(fd, F_SETFD, FD_CLOEXEC);  // never the workers'
  return held;
}

job_lock job_lock::try_take(const engine::job_config& job, bool journaled) {
  return lock(job, journaled, false);
}

job_lock job_lock::lock(const engine::job_config& job, bool journaled, bool must) {
  job_lock held;
  struct target {
    std::string path, what;
    bool dir = false;
  };
  std::vector<target> targets{{job.run_log, "engine.run_log = " + job.run_log}};
  if (journaled)
    targets.push_back({job.baseline.dir, "checkpoint.dir = " + job.baseline.dir, true});
  held.wanted_ = targets.size();
  std::vector<std::string> unlockable;  // said once this lock is settled, not every retry
  // Ok, or refused (a must throws naming the key); a missing one is made only once every
  // existing one is held, so that a refused launch makes nothing.
  auto hold = [&](const target& t) {
    const int fd = ::open(t.path.c_str(), (t.dir ? O_RDONLY | O_DIRECTORY : O_RDWR) | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      held.fds_.push_back(fd);
      return false;
    }
    const int err = errno;
    ::close(fd);
    if (err == ENOLCK || err == EOPNOTSUPP || err == EINVAL || err == ENOSYS) {
      // No locks on this file system (ENOLCK: NFS without its lock service): nobody can hold
      // this one, so it is not waited for (a requeued job waited out its whole patience, a
      // standby retried for good).
      --held.wanted_;
      unlockable.push_back(fmt::format(
          "moevement launch: {}: not locked ({}): its file system takes no locks, so a second "
          "launch on the same files is not refused\n",
          t.what, std::strerror(err)));
      return false;
    }
    if (err == EWOULDBLOCK && must) {
      throw std::runtime_error(fmt::format(
          "{} is in use by another running `moevement launch` (it holds its lock): wait for "
          "that job to end or stop it, or give this one another {}",
          t.what, t.what.substr(0, t.what.find(' '))));
    }
    return false;
  };
  std::vector<const target*> missing;
  for (const auto& t : targets) {
    if (hold(t)) missing.push_back(&t);
  }
  for (const target* t : missing) {
    try {  // what cannot be made is refused later, naming its key (open_journal, run_log)
      if (t->dir) {
        recovery::create_private_directories(t->path);
      } else if (const int fd = ::open(t->path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0600);
                 fd >= 0) {
        ::close(fd);
      }
    } catch (const std::exception&) {
      continue;
    }
    (void)hold(*t);
  }
  if (must || held.holds_all()) {
    for (const auto& line : unlockable) std::cerr << line;
  }
  return held;
}

}  // namespace moevement::launcher
