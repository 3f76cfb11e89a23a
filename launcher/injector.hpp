// The head's failure injector (`moevement launch --inject`, [[inject]] tables): kills or stops
// the worker that holds a (stage, replica) as an iteration begins, a given time into a
// recovery, or at the times of a failure schedule (mtbf, trace). The phase=... injections are
// the workers' own (launcher/inject.hpp); the head only passes them on.
#pragma once

#include <asio/io_context.hpp>
#include <asio/steady_timer.hpp>

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "engine/head_recovery.hpp"
#include "engine/job_config.hpp"
#include "engine/run_log.hpp"
#include "launcher/inject.hpp"

namespace moevement::launcher {

// Every injection checked against the job, and the failure schedules (mtbf, trace) built,
// before anything starts: prints each schedule (and, on a dry run, every injection) to out.
struct injection_plan {
  std::vector<scheduled_failure> schedule;  // by time
  std::vector<std::string> worker_specs;    // phase=...: carried out by the workers
};
injection_plan plan_injections(const std::vector<injection>& injections,
                               const engine::job_config& job, bool dry_run, std::ostream& out);

class failure_injector {
 public:
  using worker_table = std::map<transport::node_id, engine::worker_info>;
  // workers: the coordinator's table now (null once it is gone); say: prints a line to the
  // user (ending a progress line first).
  failure_injector(asio::io_context& io, engine::run_log& log, std::vector<injection> injections,
                   injection_plan plan, std::int64_t iterations,
                   std::function<const worker_table*()> workers,
                   std::function<void(const std::string&)> say);

  // Iteration `iteration` ended: strikes the injections due as the next one begins, and
  // starts (or, at the last, closes) the failure schedule.
  void iteration_ended(std::int64_t iteration);
  // A recovery started or ended (coordinator_callbacks::on_recovery).
  void recovery_event(const std::string& event);
  // Every worker was sent its role (coordinator_callbacks::on_assigned): during=start fires.
  void job_assigned();
  // The job ended: nothing fires any more.
  void stop();
  // What was to fire and did not (the run ended first, or the nth recovery never started).
  void report_unfired(std::ostream& out) const;

 private:
  // whole_host: every process in the failure domain of the one that holds (stage, replica).
  bool strike(failure_kind what, int stage, int replica, const std::string& label,
              const std::string& note, bool whole_host = false);
  void inject_due(std::int64_t next_iteration);
  // Injection i strikes now, or delay_ms from now (note: when it fires, for the progress line).
  void fire_after_delay(std::size_t i, std::function<std::string()> note);
  void schedule_due();
  void log_injection(const std::string& spec, transport::node_id n, int stage, int replica);
  static bool ended(int pid);
  bool ours(int pid) const;
  std::chrono::steady_clock::time_point due(std::size_t i) const;

  asio::io_context& io_;
  engine::run_log& log_;
  std::vector<injection> injections_;
  std::vector<scheduled_failure> schedule_;
  std::int64_t iterations_;
  std::function<const worker_table*()> workers_;
  std::function<void(const std::string&)> say_;
  std::filesystem::path self_exe_;
  bool stopped_ = false;
  // Scheduled failures (mtbf, trace) count seconds of training from the end of iteration 0;
  // one falls due only while no recovery runs and the previous one was recovered, so that
  // each is recovered (and measured) on its own; during=recovery is how a failure is put
  // into a recovery on purpose.
  int recoveries_started_ = 0;
  bool recovering_ = false, awaiting_recovery_ = false, schedule_closed_ = false;
  std::size_t schedule_next_ = 0;
  std::optional<std::chrono::steady_clock::time_point> train_start_;
  asio::steady_timer schedule_timer_;
  std::vector<std::unique_ptr<asio::steady_timer>> delayed_;
  std::set<std::size_t> armed_;  // during=recovery injections waiting out their delay_ms
};

}  // namespace moevement::launcher
