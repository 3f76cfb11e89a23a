// The head process of a job (`moevement launch`): head_session, one job's head (launch.cpp),
// its standby part (head_session_standby.cpp). Internal to the launcher.
#pragma once

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/redirect_error.hpp>
#include <asio/signal_set.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <vector>
#include "actors/system.hpp"
#include "base/hash.hpp"
#include "engine/coordinator.hpp"
#include "engine/job_config.hpp"
#include "engine/run_log.hpp"
#include "engine/run_log_reader.hpp"
#include "launcher/config.hpp"
#include "launcher/injector.hpp"
#include "launcher/launch.hpp"
#include "launcher/launch_options.hpp"
#include "launcher/launch_start.hpp"
#include "launcher/launch_text.hpp"
#include "launcher/report.hpp"
#include "launcher/slurm_backend.hpp"
#include "launcher/standby_agent.hpp"
#include "launcher/worker_processes.hpp"
#include "recovery/durable_window.hpp"
#include "recovery/resume_journal.hpp"
#include "recovery/rollback_recovery.hpp"
#include "transport/ucx_context.hpp"
#include "transport/ucx_link.hpp"

namespace moevement::launcher {

// A fresh job token (random, 128 bits in hex).
std::string new_token();

// One job's head: the link and actor system of node 0, the coordinator, the worker processes,
// the failure injector, the progress lines and the run log.
class head_session {
 public:
  head_session(const launch_options& o, const engine::job_config& job, injection_plan plan,
               std::optional<recovery::resume_journal>& journal,
               std::optional<engine::resume_point> resume_from, head_extension extension)
      : options_(o),
        job_(job),
        extension_(std::move(extension)),
        journal_(journal),
        standby_(!o.standby_of.empty()),
        token_(standby_ ? standby_token() : new_token()),
        processes_(token_),
        link_(io_, link_options(job, token_, standby_ ? o.standby_node : 0)),
        sys_(io_, link_, system_config(job)),
        log_(job.run_log, o.resume || standby_),
        worker_specs_(plan.worker_specs),
        injector_(
            io_, log_, o.injections, std::move(plan), job.train.iterations,
            [this]() -> const failure_injector::worker_table* {
              auto* c = coordinator();
              return c != nullptr ? &c->workers() : nullptr;
            },
            [this](const std::string& line) { say(line); }) {
    outcome_.message = "the job did not finish";
    signals_.add(SIGUSR1);  // the signal set's constructor takes three
    // A closed standard output (`launch ... | head`) stops the job as an interrupt does, saying
    // so on stderr and in the run log, not by killing the head where it printed.
    signals_.add(SIGPIPE);
    // A hang-up (the terminal closed) stops the job as an interrupt does; not under nohup (its
    // SIG_IGN kept), nor a standby's: the kernel sends one to the launch's process group when
    // the head dies while a member is stopped, and the standby is the one that goes on then.
    transport::release_hangup_signal();
    struct sigaction before {};
    if (standby_) {
      std::signal(SIGHUP, SIG_IGN);
    } else if (::sigaction(SIGHUP, nullptr, &before) == 0 && before.sa_handler != SIG_IGN) {
      signals_.add(SIGHUP);
    }
    if (standby_) {  // the coordinator comes when this standby takes over (take_over)
      const auto colon = o.standby_of.rfind(':');
      const long port = colon == std::string::npos
                            ? 0
                            : std::strtol(o.standby_of.c_str() + colon + 1, nullptr, 10);
      if (port < 1 || port > 65535) {
        throw std::invalid_argument("--standby-of: expected HOST:PORT, got '" + o.standby_of + "'");
      }
      link_.add_peer(0, o.standby_of.substr(0, colon), std::uint16_t(port));
      return;
    }
    make_callbacks();
    coord_ = sys_.spawn<engine::coordinator>(job_, options_.raw, cb_, &log_,
                                             recovery::any_head_recovery(job_.policy),
                                             std::move(resume_from));
  }

  // Runs the job to its end; the exit status of `moevement launch`.
  int run();
  // The head's job locks, which the standby it starts holds too (job_lock::fds); on the
  // standby, those it was started holding (--locks).
  void share_locks(std::vector<int> fds) { lock_fds_ = std::move(fds); }
  void adopt_locks(job_lock held) { lock_ = std::move(held); }

 private:
  static transport::ucx_link_options link_options(const engine::job_config& job,
                                                  const std::string& token,
                                                  transport::node_id self) {
    transport::ucx_link_options opt;
    opt.self = self;
    opt.job_token = token;
    opt.listen_host = job.host;
    return opt;
  }
  static actors::system_config system_config(const engine::job_config& job) {
    actors::system_config cfg;
    cfg.head = 0;
    if (job.standby_head) cfg.standby = engine::standby_node(job);
    cfg.heartbeat_interval = std::chrono::milliseconds(job.heartbeat_ms);
    cfg.heartbeat_timeout = std::chrono::milliseconds(job.failure_timeout_ms);
    return cfg;
  }

  engine::coordinator* coordinator() { return sys_.local_actor<engine::coordinator>(coord_); }
  void fail(const std::string& why) {
    if (auto* c = coordinator()) c->fail(why);
  }
  // Ends an open progress line (a tty redraws one line in place).
  void end_line() {
    if (progress_open_) std::cout << "\n";
    progress_open_ = false;
  }
  void say(const std::string& line) {
    end_line();
    std::cout << line << "\n" << std::flush;
  }
  void make_callbacks();
  void progress(const engine::iteration_record& r);
  // The program's head_extension after iteration r (every log_every).
  void extend(const engine::iteration_record& r);
  // Returns once no extension runs (the job's end waits for the last iteration's).
  asio::awaitable<void> extensions_ended();
  void finish(const engine::job_outcome& o);
  void on_signal(const std::error_code& ec, int sig);
  void request_stop();
  void window_on_disk(const engine::resume_point& p);
  void child_exited(transport::node_id n, pid_t pid, int status);
  // At cluster.start_timeout_ms (or `after`): late workers replaced by spares where they cover
  // them (coordinator::check_start), else the start fails (start_failed).
  void arm_start_timeout(std::chrono::milliseconds after = {});
  void start_failed();
  asio::awaitable<void> start_workers();
  void start_standby(const std::string& head);
  // `launch CONFIG [--set ...] --standby-of HEAD --node N`: the standby head's command line.
  std::vector<std::string> standby_args(const std::string& head) const;
  int report();
  // ---- the standby head (cluster.standby_head; launcher/standby_agent.hpp)
  static std::string standby_token() {
    const char* t = std::getenv("MOEVEMENT_JOB_TOKEN");
    if (t == nullptr || *t == '\0') {
      throw std::invalid_argument("--standby-of: MOEVEMENT_JOB_TOKEN is not set (launch sets it)");
    }
    return t;
  }
  asio::awaitable<void> wait_as_standby();
  void standby_membership(transport::node_id n, actors::member_event e);
  // The head is lost and this standby is the head now: the coordinator again, from the
  // journal's newest window, with the workers that are alive.
  void take_over();
  void end_standby(int status, const std::string& why);
  // A standby that took over: the job's locks (job_lock), tried until held.
  void take_locks();
  // The old head, fenced: the standby took its place while this one was stopped.
  void replaced();
  int wait_for_standby();

  const launch_options& options_;
  const engine::job_config& job_;
  const head_extension extension_;
  std::optional<recovery::resume_journal>& journal_;
  const bool standby_;  // this process is the standby head (until it takes over)
  bool took_over_ = false, replaced_ = false;
  std::optional<pid_t> standby_child_;  // a replaced head waits for it (wait_for_standby)
  std::optional<int> standby_status_;   // the standby ended without taking over
  const std::string token_;
  const std::string self_ = std::filesystem::read_symlink("/proc/self/exe").string();
  worker_processes processes_;
  asio::io_context io_{1};
  transport::ucx_link link_;
  actors::actor_system sys_;
  engine::run_log log_;
  job_lock lock_;              // a standby's, once it took over (the head's is run_launch's)
  std::vector<int> lock_fds_;  // the head's, which its standby shares
  const std::vector<std::string> worker_specs_;  // phase=... injections: the workers'
  failure_injector injector_;
  // Progress redrawn in place on a terminal; not by a standby head, whose output is a log
  // (under Slurm, srun --unbuffered gives its task a pseudo-terminal).
  const bool tty_ = ::isatty(STDOUT_FILENO) != 0 && !standby_;
  engine::job_outcome outcome_;
  bool finished_ = false, progress_open_ = false;
  int interrupted_ = 0;               // the signal that stopped the job (SIGINT, SIGTERM), or 0
  std::unique_ptr<slurm_step> step_;  // backend slurm: srun, node 0 among the processes
  std::unique_ptr<slurm_step> standby_step_;  // backend slurm: the standby head's srun
  asio::steady_timer linger_{io_}, start_timer_{io_};
  asio::steady_timer relock_{io_};  // a standby that took over: its next try at the locks
  int extensions_running_ = 0;
  asio::steady_timer extensions_done_{io_};
  asio::signal_set signals_{io_, SIGINT, SIGTERM, SIGCHLD};  // and SIGUSR1 (run)
  engine::coordinator_callbacks cb_;
  actors::actor_ref coord_;
  // SIGUSR1 (a Slurm --signal before a time limit or preemption, or a user): stop once the
  // next durable window is journaled; stopped_at_ is that window.
  bool stop_requested_ = false;
  std::optional<engine::resume_point> stopped_at_;
  // The journal is written on a thread of its own, in order (its fsyncs must not hold the
  // head's actor thread and its heartbeats); a failure comes back as a notice.
  std::optional<recovery::durable_writer> journal_writer_;
  std::atomic<bool> journal_fenced_{false};  // replaced(): no journal write from here on
};

}  // namespace moevement::launcher
