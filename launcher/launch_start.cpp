#include "launcher/launch_start.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <stdexcept>
#include <vector>

#include "recovery/atomic_file.hpp"

namespace moevement::launcher {

void check_run_log_path(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
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

std::optional<engine::resume_point> open_journal(const launch_options& o,
                                                 const engine::job_config& job,
                                                 std::optional<recovery::resume_journal>& journal) {
  const bool journaled =
      job.policy == engine::policy_kind::moevement && engine::durable_tier(job) && !o.sbatch;
  if (o.resume && !journaled) {
    throw std::invalid_argument(
        "--resume needs the durable tier of policy moevement: the job must run with "
        "checkpoint.policy = \"moevement\" and checkpoint.durable = true (its windows and "
        "journal are under checkpoint.dir)");
  }
  if (!journaled) return std::nullopt;
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
    journal->clear();
    return std::nullopt;
  }
  std::vector<std::string> rejected;
  auto point = journal->load(&rejected);
  const char* what = o.resume ? "--resume" : "requeued job's resume";
  for (const auto& r : rejected) std::cerr << "moevement launch: " << what << ": " << r << "\n";
  if (!point.ok() && o.requeued && !o.resume && rejected.empty()) {
    // Requeued before its first window reached the disk: nothing was kept, so from the start.
    std::cout << "moevement launch: requeued by Slurm with no window on disk yet: starting "
                 "from the beginning\n";
    journal->clear();
    return std::nullopt;
  }
  if (!point.ok()) throw std::runtime_error(std::string(what) + ": " + point.err().message);
  if (point->target_iteration > job.train.iterations) {
    throw std::runtime_error(fmt::format(
        "{}: the checkpoint in {} goes on at iteration {}, past train.iterations = {}: resume "
        "with train.iterations of at least {} (the job's own, say), or run the job anew in "
        "another checkpoint.dir",
        what, job.baseline.dir, point->target_iteration, job.train.iterations,
        point->target_iteration));
  }
  if (o.requeued) {
    std::cout << fmt::format("moevement launch: requeued by Slurm: resuming from window {}\n",
                             point->window);
  }
  return std::move(*point);
}

}  // namespace moevement::launcher
