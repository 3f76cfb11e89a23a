// `moevement launch CONFIG [--set key=value ...]`: the head process of a job on the local
// backend. It listens (node 0), registers the coordinator, starts one `moevement worker`
// process per (stage, replica) plus cluster.spares spares, shows progress, writes the run log,
// and prints `state_hash=<16 hex>` at the end. Ctrl-C (or SIGTERM, or a closed stdout) stops every
// worker; the workers are in their own process group and die with the head (PR_SET_PDEATHSIG), so
// no process is left behind either way. With cluster.backend = "slurm" the workers are the tasks of
// one srun step instead (launcher/slurm_backend.hpp); the rest is the same.
#include <fmt/format.h>
#include <unistd.h>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/redirect_error.hpp>
#include <asio/signal_set.hpp>
#include <asio/steady_timer.hpp>
#include <asio/use_awaitable.hpp>

#include <sys/wait.h>

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
#include "launcher/head_session.hpp"
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

std::string new_token() {
  std::random_device rd;
  std::string t;
  for (int i = 0; i < 4; ++i) t += fmt::format("{:08x}", rd());
  return t;
}

namespace {

// Connections to the head's port that were refused or dropped before they were admitted: not
// the job's own traffic (another job, a scanner, a stale token). The link warns on stderr as
// they come; the run log keeps the totals.
void log_link_refusals(engine::run_log& log, const transport::ucx_link_counters& c) {
  if (c.refused_tokens + c.bad_hellos + c.hello_timeouts + c.failed_accepts + c.half_open_refused ==
      0) {
    return;
  }
  log.write(engine::json_record{}
                .add("kind", "event")
                .add("event", "link_refusals")
                .add("refused_tokens", c.refused_tokens)
                .add("bad_hellos", c.bad_hellos)
                .add("hello_timeouts", c.hello_timeouts)
                .add("failed_accepts", c.failed_accepts)
                .add("half_open_refused", c.half_open_refused)
                .add("time_s", log.seconds()));
}

}  // namespace

void head_session::make_callbacks() {
  cb_.on_recovery = [this](const std::string& event, std::int64_t) {
    injector_.recovery_event(event);
  };
  cb_.on_assigned = [this] { injector_.job_assigned(); };
  cb_.on_worker_lost = [this](transport::node_id n, int pid) {
    // A standby that took over started no worker: the process (on this host) goes by its pid,
    // once its command line shows it is that worker.
    if (took_over_) {
      worker_processes::kill_worker(n, pid, options_.standby_of);
    } else {
      processes_.kill_node(n, pid);
    }
  };
  cb_.on_replaced = [this] { replaced(); };
  cb_.exit_of = [this](transport::node_id n) {
    const auto end = processes_.end_of(n);
    return engine::worker_exit{end.started, end.status ? exit_text(*end.status) : ""};
  };
  cb_.on_notice = [this](const std::string& line) { say(line); };
  cb_.on_iteration = [this](const engine::iteration_record& r) {
    progress(r);
    extend(r);
  };
  cb_.on_validation = [this](std::int64_t it, double v) {
    say(fmt::format("iter {:>6}  val_loss {:.4f}", it, v));
  };
  cb_.on_finished = [this](const engine::job_outcome& o) { finish(o); };
  cb_.before_finish = [this] { return extensions_ended(); };
  if (!journal_) return;
  journal_writer_.emplace();
  cb_.on_durable_window = [this](const engine::resume_point& p) {
    journal_writer_->post([this, p] {
      if (journal_fenced_) return;  // replaced: the journal is the standby's now
      try {
        journal_->write(p);
        asio::post(io_, [this, p] { window_on_disk(p); });
      } catch (const std::exception& e) {
        asio::post(io_, [this, line = fmt::format("durable tier: the resume journal of window {} "
                                                  "was not written: {}",
                                                  p.window, e.what())] { cb_.on_notice(line); });
      }
    });
  };
}

void head_session::progress(const engine::iteration_record& r) {
  injector_.iteration_ended(r.iteration);
  const std::int64_t done = r.iteration + 1;
  const double eta = r.seconds * double(job_.train.iterations - done);
  // Iterations by index, as in the run log, `train` and --inject's iter=; then how many are done.
  const std::string line = fmt::format(
      "iter {:>6} ({} of {})  loss {:.4f}  {:>8.0f} tok/s  {:.3f} s/iter  ETA {}", r.iteration,
      done, job_.train.iterations, r.loss, r.tokens_per_s, r.seconds, duration_text(eta));
  if (tty_) {
    std::cout << "\r" << line << std::flush;
    progress_open_ = true;
  } else if (r.iteration % job_.train.log_every == 0 || done == job_.train.iterations) {
    std::cout << line << "\n" << std::flush;
  }
}

void head_session::extend(const engine::iteration_record& r) {
  if (!extension_.after_iteration) return;
  const std::int64_t done = r.iteration + 1;
  if (r.iteration % job_.train.log_every != 0 && done != job_.train.iterations) return;
  auto* c = coordinator();
  if (c == nullptr) return;
  std::vector<actors::actor_ref> stages(std::size_t(job_.pp * job_.dp));
  for (const auto& [n, w] : c->workers()) {
    if (w.stage >= 0) stages[std::size_t(w.replica * job_.pp + w.stage)] = w.stage_actor;
  }
  end_line();
  ++extensions_running_;
  asio::co_spawn(io_, extension_.after_iteration(sys_, r.iteration, std::move(stages)),
                 [this](const std::exception_ptr&) {
                   if (--extensions_running_ == 0) extensions_done_.cancel();
                 });
}

asio::awaitable<void> head_session::extensions_ended() {
  while (extensions_running_ > 0) {
    // Each extension bounds its own asks; the timer is only woken early by the last one's end.
    extensions_done_.expires_after(std::chrono::seconds(1));
    std::error_code ec;  // cancelled: the last one ended
    co_await extensions_done_.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
}

void head_session::finish(const engine::job_outcome& o) {
  finished_ = true;
  sys_.wind_down();  // the workers leave now: their connections closing is no fault
  outcome_ = o;
  start_timer_.cancel();
  injector_.stop();
  // Let the Shutdown messages go out, then leave.
  linger_.expires_after(std::chrono::milliseconds(200));
  linger_.async_wait([this](const std::error_code&) {
    sys_.shutdown();
    linger_.expires_after(std::chrono::milliseconds(100));
    linger_.async_wait([this](const std::error_code&) { io_.stop(); });
  });
}

void head_session::child_exited(transport::node_id n, pid_t pid, int status) {
  if (standby_step_ && pid == standby_step_->pid()) {
    // The standby's loss reaches the coordinator through the membership (it goes on without
    // one); one that never joined fails the start, with its step's last lines.
    standby_step_->exited(status);
    return;
  }
  if (step_ && pid == step_->pid()) {
    step_->exited(status);
    if (!finished_) {
      end_line();
      fail(slurm_step_ended_text(job_, *step_, exit_text(status)));
    }
    return;
  }
  auto* c = coordinator();
  if (job_.standby_head && n == transport::node_id(engine::standby_node(job_))) {
    // The standby, this process's child: the job goes on without one.
    if (c != nullptr && !finished_) c->standby_ended(exit_text(status));
    return;
  }
  const bool known = c != nullptr && c->said_hello(n);
  // The coordinator decides (a lost spare: it says so): recover the stage on a spare, or end the
  // job saying so.
  if (!finished_ && c != nullptr && known) {
    c->lose_worker(n, exit_text(status));
    // One truth about who is alive: the exit reaches the membership at once (asks to the
    // worker fail now, not at the heartbeat timeout or after a refused redial).
    sys_.lose_member(n, "its process " + exit_text(status));
  } else if (!finished_ && c != nullptr && c->awaits_hello(n)) {
    // Ended before its hello: admission goes on without it, a spare taking its role.
    c->lose_worker(n, exit_text(status));
  } else if (!finished_ && (c == nullptr || !c->started())) {  // never said hello
    fail(fmt::format("worker {} (pid {}) {}", n, pid, exit_text(status)));
  }
}

void head_session::on_signal(const std::error_code& ec, int sig) {
  if (ec) return;
  if (sig == SIGCHLD) {
    processes_.reap_exited(
        [this](transport::node_id n, pid_t pid, int status) { child_exited(n, pid, status); });
  } else if (standby_ && !took_over_) {
    // A standby that has not taken over: the job is the head's. SIGUSR1 (Slurm's warning sent
    // to every step) is the head's to act on, and a closed output (SIGPIPE) changes nothing
    // here; SIGINT or SIGTERM end the standby alone, and the head goes on without one.
    if (sig == SIGINT || sig == SIGTERM) {
      end_standby(128 + sig, fmt::format("stopped by signal {} ({}) before it took over: the job "
                                         "goes on without a standby head",
                                         sig, ::strsignal(sig)));
    }
  } else if (sig == SIGUSR1) {
    request_stop();
  } else if (!finished_) {
    end_line();
    interrupted_ = sig;
    const std::string resume =
        journal_ ? "; `moevement launch CONFIG --resume` goes on from the newest window on disk"
                 : "";
    fail(sig == SIGPIPE
             ? "the output was closed (SIGPIPE): stopped every worker (the run log has the "
               "progress; redirect the output to a file to keep it)" +
                   resume
             : fmt::format("interrupted by signal {} ({}): stopped every worker{}", sig,
                           ::strsignal(sig), resume));
  }
  signals_.async_wait([this](const std::error_code& e, int s) { on_signal(e, s); });
}

void head_session::request_stop() {
  if (finished_ || stop_requested_) return;
  if (!journal_) {
    say("moevement launch: SIGUSR1 asks to stop at the next window on disk, but this job has no "
        "durable tier (checkpoint.policy = \"moevement\" with checkpoint.durable = true): "
        "training goes on");
    return;
  }
  stop_requested_ = true;
  if (auto* c = coordinator()) c->durable_soon();  // unpaced: the stop waits for it
  say(
      fmt::format("moevement launch: SIGUSR1: stopping once the next durable window is on disk "
                  "(checkpoint.dir = {})",
                  job_.baseline.dir));
}

void head_session::window_on_disk(const engine::resume_point& p) {
  if (!stop_requested_ || finished_ || stopped_at_) return;
  stopped_at_ = p;
  if (auto* c = coordinator())
    c->stop_for_resume(
        fmt::format("stopped on SIGUSR1 with window {} on disk: {} from iteration {}", p.window,
                    options_.requeue ? "the requeued job goes on"
                                     : "`moevement launch CONFIG --resume` goes on",
                    p.target_iteration),
        p.target_iteration);
}

void head_session::arm_start_timeout(std::chrono::milliseconds after) {
  start_timer_.expires_after(after.count() > 0 ? after
                                               : std::chrono::milliseconds(job_.start_timeout_ms));
  start_timer_.async_wait([this](const std::error_code& ec) {
    auto* c = coordinator();
    if (ec || finished_ || c == nullptr || c->started()) return;
    if (c->waits_for_standby() || c->waits_for_standby_hello()) {
      fail(fmt::format(
          "the standby head did not {} within cluster.start_timeout_ms = {} ms (training waits "
          "for it, so that the head can be taken over from the start; every worker started){}",
          c->waits_for_standby() ? "join the cluster" : "say hello", job_.start_timeout_ms,
          standby_step_ ? "; its Slurm step's last lines:\n" + standby_step_->output_tail()
                        : std::string()));
      return;
    }
    // A few late ones (hung as they started, say) are replaced by spares, which get as long;
    // decided in the coordinator's turn (a report queued there counts).
    if (!c->took_over()) {
      c->check_start([this](const engine::coordinator::start_check& r) {
        if (finished_ || r.started) return;
        if (!r.short_of_spares) {
          for (const transport::node_id n : r.unheard) processes_.kill_child_of(n);
          arm_start_timeout(r.next);
          return;
        }
        start_failed();
      });
      return;
    }
    start_failed();
  });
}

void head_session::start_failed() {
  auto* c = coordinator();
  if (c == nullptr || finished_) return;
  fail(fmt::format(
      "the workers did not all {} within cluster.start_timeout_ms = {} ms ({} of {} said "
      "hello){}",
      c->took_over() ? "come back to the standby head that took over" : "start",
      job_.start_timeout_ms, c->workers().size(), c->expected_workers(),
      step_ ? "; the Slurm step's last lines:\n" + step_->output_tail() : ""));
}

asio::awaitable<void> head_session::start_workers() {
  auto r = co_await sys_.register_global(engine::coordinator::registered_name, coord_,
                                         std::chrono::seconds(5));
  if (!r.ok()) {
    fail("cannot register the coordinator: " + r.err().message);
    co_return;
  }
  const std::string head = fmt::format("{}:{}", job_.host, link_.port());
  if (job_.backend == "slurm") {
    try {
      // A resumed (or requeued) job's steps add to their output files, as to its run log.
      step_ = start_slurm_step(job_, self_, head, token_, worker_specs_, options_.resume);
      processes_.adopt(step_->pid(), 0);
      if (job_.standby_head) {
        standby_step_ =
            start_slurm_standby(job_, self_, standby_args(head), token_, options_.resume);
        processes_.adopt(standby_step_->pid(), transport::node_id(engine::standby_node(job_)));
      }
    } catch (const std::exception& e) {
      fail(e.what());
    }
    co_return;
  }
  for (int n = 1; n <= job_.workers() + job_.spares; ++n) {
    std::vector<std::string> args{"worker",
                                  "--head",
                                  head,
                                  "--node",
                                  std::to_string(n),
                                  "--host",
                                  job_.host,
                                  "--heartbeat-ms",
                                  std::to_string(job_.heartbeat_ms),
                                  "--failure-timeout-ms",
                                  std::to_string(job_.failure_timeout_ms)};
    for (const auto& spec : worker_specs_) {
      args.push_back("--inject");
      args.push_back(spec);
    }
    try {
      processes_.start(self_, args, transport::node_id(n), job_.standby_head);
    } catch (const std::exception& e) {
      fail(e.what());
      co_return;
    }
  }
  if (job_.standby_head) start_standby(head);
}

std::vector<std::string> head_session::standby_args(const std::string& head) const {
  std::vector<std::string> args{"launch", options_.config_path};
  for (const auto& o : options_.overrides) {
    args.push_back("--set");
    args.push_back(o);
  }
  args.insert(args.end(),
              {"--standby-of", head, "--node", std::to_string(engine::standby_node(job_))});
  // The report is drawn by whichever head ends the job, and a stop on SIGUSR1 under it requeues
  // the batch job as the head's would.
  if (!options_.report.empty()) args.insert(args.end(), {"--report", options_.report});
  if (options_.requeue) args.push_back("--requeue");
  return args;
}

int head_session::run() {
  signals_.async_wait([this](const std::error_code& e, int s) { on_signal(e, s); });
  if (standby_) {
    asio::co_spawn(io_, wait_as_standby(), asio::detached);
    io_.run();
    if (!took_over_) return standby_status_.value_or(1);
  } else {
    arm_start_timeout();
    asio::co_spawn(io_, start_workers(), asio::detached);
    io_.run();
  }
  if (replaced_) return wait_for_standby();
  end_line();
  log_link_refusals(log_, link_.counters());
  injector_.report_unfired(std::cout);
  // The run log is complete here (job_end, job_stopped or job_failed); state_hash= stays the last
  // line.
  if (!options_.report.empty()) {
    try {
      write_report({job_.run_log}, options_.report);
      std::cout << "report: " << options_.report << "\n";
    } catch (const std::exception& e) {
      std::cerr << "moevement launch: --report: " << e.what() << "\n";
    }
  }
  return report();
}

// Every worker goes: those that did not exit after Shutdown get SIGTERM, then SIGKILL. One that
// ends badly on its own after a good run (a crash while shutting down) fails the launch.
int head_session::report() {
  std::string step_end;
  if (step_) {  // srun goes first: the workers are its tasks
    processes_.forget(step_->pid());
    step_end = step_->stop(srun_grace_ms);
  }
  if (standby_step_) {  // the standby ends on the coordinator's Shutdown
    processes_.forget(standby_step_->pid());
    (void)standby_step_->stop(srun_grace_ms);
  }
  const auto bad_exits = processes_.end_all(std::chrono::milliseconds(outcome_.ok ? 3000 : 200));
  if (outcome_.ok && !bad_exits.empty()) {
    outcome_.ok = false;
    outcome_.message = bad_exits.front();
    for (std::size_t i = 1; i < bad_exits.size(); ++i) outcome_.message += "; " + bad_exits[i];
    outcome_.message += " (the job itself finished: see that worker's output above)";
  }
  if (!outcome_.ok) {
    std::cerr << "moevement launch: " << outcome_.message << "\n";
    std::cerr << "run log: " << job_.run_log << "\n";
    if (step_) {
      std::cerr << "Slurm step output (each task's stdout and stderr): " << step_->output_path()
                << " (" << step_end << ")\n";
    }
    if (stopped_at_) {
      if (options_.requeue) requeue_slurm_job(stopped_at_->window);
      return launch_stopped_status;
    }
    return interrupted_ != 0 ? 128 + interrupted_ : 1;  // as a shell reports the signal
  }
  std::cout << final_line(outcome_) << "\n";
  std::cout << "run log: " << job_.run_log << "\n";
  if (step_) {
    std::cout << "Slurm step output (each task's stdout and stderr): " << step_->output_path()
              << "\n";
  }
  std::cout << "state_hash=" << hex16(outcome_.state_hash) << "\n";
  return 0;
}

int run_launch(int argc, char** argv, const engine::stage_registry& registry,
               head_extension extension) {
  if (argc == 3 && (std::string_view(argv[2]) == "--help" || std::string_view(argv[2]) == "-h")) {
    std::cout << launch_usage;
    return 0;
  }
  auto options = parse_launch_options(argc, argv);
  if (!options) return 2;
  if (const auto why = launched_by_many_tasks()) {
    std::cerr << "moevement launch: " << *why << "\n";
    return 2;
  }
  engine::job_config job = checked_job(*options);
  if (const int spares = spares_filling_nodes(job);
      job.backend == "slurm" && spares != job.spares) {
    // Every process of the job reads the same (the workers the config sent to them).
    if (options->standby_of.empty()) {
      std::cout << fmt::format(
          "moevement launch: cluster.spares = {} raised to {}: {} workers + spares spread evenly "
          "over cluster.slurm_nodes = {} (Slurm fills the first node otherwise)\n",
          job.spares, spares, job.workers() + spares, job.slurm_nodes);
    }
    apply_override(options->raw, fmt::format("cluster.spares={}", spares));
    job = checked_job(*options);
  }
  (void)registry.find(job.stage_type);  // an unknown stage type is a config error, here
  registry.check_expert_parallel(job.stage_type, job.ep);
  injection_plan plan = plan_injections(options->injections, job, options->dry_run, std::cout);
  if (options->dry_run) return dry_run(*options, job);
  std::optional<recovery::resume_journal> journal;
  if (!options->standby_of.empty()) {  // the standby head: quiet until it takes over
    if (!job.standby_head) throw std::invalid_argument("--standby-of needs cluster.standby_head");
    // In a Slurm task on another node than the head's: it listens on its own node's address.
    if (job.backend == "slurm") job.host = slurm_task_host(job.host);
    head_session standby(*options, job, std::move(plan), journal, std::nullopt,
                         std::move(extension));
    std::vector<int> held;
    for (int i = 0; i < options->standby_locks; ++i) held.push_back(3 + i);
    if (!held.empty()) standby.adopt_locks(job_lock::adopt(std::move(held)));
    return standby.run();
  }
  check_run_log_path(job.run_log, options->report);
  // Held until this head ends, before the journal is read or started afresh.
  // A requeued job waits out its dead predecessor's locks on a network file system (they
  // outlive it until its lease ends, some 90 s on NFSv4).
  const job_lock lock = options->sbatch
                            ? job_lock{}
                            : job_lock::take(job, journaled_job(*options, job),
                                             std::chrono::seconds(options->requeued ? 180 : 0));
  auto resume_from = open_journal(*options, job, journal);
  // Nothing to run again, once the journal found this config the job's (a changed one is
  // refused as by any resume, not answered with the old job's hash).
  if (options->resume && said_job_ended(job)) return 0;
  options->resume = resume_from.has_value();  // the run log goes on where it was
  if (options->sbatch) {
    return submit_with_sbatch(job, options->config_path, options->overrides, options->sbatch_args);
  }
  if (job.backend == "slurm") {
    if (const auto why = slurm_precheck(job)) {
      std::cerr << "moevement launch: " << *why << "\n";
      return 1;
    }
    if (job.policy == engine::policy_kind::moevement && !engine::durable_tier(job)) {
      std::cerr << "moevement launch: warning: the durable tier is off (no checkpoint.dir): a "
                   "loss of every copy of a snapshot ends this job and it cannot be resumed; set "
                   "checkpoint.dir to a directory every node sees\n";
    }
  }
  std::cout << launch_line(job) << "\n";
  // A worker that needs the missing transport to reach a peer cannot connect (UCX only warns).
  if (const auto problem = transport::ucx_tls_problem(); !problem.empty()) {
    std::cerr << "moevement launch: warning: " << problem << "\n";
  }
  head_session session(*options, job, std::move(plan), journal, std::move(resume_from),
                       std::move(extension));
  session.share_locks(lock.fds());
  return session.run();
}

}  // namespace moevement::launcher
