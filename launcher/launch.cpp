// `moevement launch CONFIG [--set key=value ...]`: the head process of a job on the local
// backend. It listens (node 0), registers the coordinator, starts one `moevement worker`
// process per (stage, replica) plus cluster.spares spares, shows progress, writes the run log,
// and prints `state_hash=<16 hex>` at the end. Ctrl-C (or SIGTERM) stops every worker; the
// workers are in their own process group and die with the head (PR_SET_PDEATHSIG), so no
// process is left behind either way.
// With cluster.backend = "slurm" the workers are the tasks of one srun step instead
// (launcher/slurm_backend.hpp); the rest is the same.
#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/signal_set.hpp>
#include <asio/steady_timer.hpp>

#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "actors/system.hpp"
#include "base/hash.hpp"
#include "engine/coordinator.hpp"
#include "engine/job_config.hpp"
#include "engine/run_log.hpp"
#include "launcher/config.hpp"
#include "launcher/exec_child.hpp"
#include "launcher/inject.hpp"
#include "launcher/launch.hpp"
#include "launcher/slurm_backend.hpp"
#include "recovery/dense_capture.hpp"
#include "recovery/durable_window.hpp"
#include "recovery/moevement_policy.hpp"
#include "recovery/resume_journal.hpp"
#include "recovery/rollback_recovery.hpp"
#include "transport/ucx_link.hpp"

namespace moevement::launcher {

namespace {

constexpr const char* launch_usage =
    "usage: moevement launch CONFIG [--set key=value ...] [--inject SPEC ...] [--dry-run]\n"
    "                        [--resume] [--sbatch [-- SBATCH_OPTION ...]]\n"
    "  CONFIG: a TOML file (examples/configs/demo.toml); keys in docs/configuration.md\n"
    "  SPEC: kill|hang:stage=S,replica=D,iter=T[,phase=forward|backward|step|snapshot],\n"
    "        kill|hang:stage=S,replica=D,during=recovery[,nth=K][,delay_ms=M],\n"
    "        mtbf:SECONDS[,seed=N][,max=K] or trace:FILE (docs/recovery.md); they add to the\n"
    "        config's [[inject]] tables\n"
    "  --dry-run: check the config and the injections, print the failure schedules, start "
    "nothing\n"
    "  --resume: start where a killed run of the same job left off: the newest durable window\n"
    "        of checkpoint.dir (policy moevement with checkpoint.durable = true)\n"
    "  --sbatch: (cluster.backend = \"slurm\") submit this launch as a Slurm batch job and "
    "return\n";

std::string new_token() {
  std::random_device rd;
  std::string t;
  for (int i = 0; i < 4; ++i) t += fmt::format("{:08x}", rd());
  return t;
}

std::string duration_text(double s) {
  const auto total = static_cast<long>(s + 0.5);
  return fmt::format("{}:{:02d}", total / 60, static_cast<int>(total % 60));
}

std::string exit_text(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return fmt::format("was killed by signal {} ({})", sig, ::strsignal(sig));
  }
  return "stopped";
}

// Starts `self worker ...` in its own process group, dying with us.
pid_t start_worker(const std::string& self, const std::vector<std::string>& args,
                   const std::string& token) {
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(self.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);  // Ctrl-C goes to the head only; the head stops the workers
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(1);  // the head died before prctl took effect
    ::setenv("MOEVEMENT_JOB_TOKEN", token.c_str(), 1);
    close_inherited_fds();  // not the head's listeners (UCX opens them without close-on-exec)
    ::execv(self.c_str(), argv.data());
    ::_exit(127);
  }
  return pid;
}

// Connections to the head's port that were refused or dropped before they were admitted: not
// the job's own traffic (another job, a scanner, a stale token). The link warns on stderr as
// they come; the run log keeps the totals.
void log_link_refusals(engine::run_log& log, const transport::ucx_link_counters& c) {
  if (c.refused_tokens + c.bad_hellos + c.hello_timeouts + c.failed_accepts == 0) return;
  log.write(engine::json_record{}
                .add("kind", "event")
                .add("event", "link_refusals")
                .add("refused_tokens", c.refused_tokens)
                .add("bad_hellos", c.bad_hellos)
                .add("hello_timeouts", c.hello_timeouts)
                .add("failed_accepts", c.failed_accepts)
                .add("time_s", log.seconds()));
}

}  // namespace

int run_launch(int argc, char** argv, const engine::stage_registry& registry) {
  if (argc < 3) {
    std::cerr << launch_usage;
    return 2;
  }
  models::config_map raw = load_config_file(argv[2]);
  std::vector<injection> injections;
  std::vector<std::string> overrides, sbatch_args;
  bool sbatch = false, dry_run = false, resume = false;
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--set" && i + 1 < argc) {
      overrides.emplace_back(argv[++i]);
      apply_override(raw, overrides.back());
    } else if (a.starts_with("--set=")) {
      overrides.push_back(a.substr(6));
      apply_override(raw, overrides.back());
    } else if (a == "--inject" && i + 1 < argc) {
      injections.push_back(parse_injection(argv[++i]));
    } else if (a.starts_with("--inject=")) {
      injections.push_back(parse_injection(a.substr(9)));
    } else if (a == "--dry-run") {
      dry_run = true;
    } else if (a == "--resume") {
      resume = true;
    } else if (a == "--sbatch") {
      sbatch = true;
      if (i + 1 < argc && std::string(argv[i + 1]) == "--") {
        sbatch_args.assign(argv + i + 2, argv + argc);
        break;
      }
    } else {
      std::cerr << "moevement launch: unexpected argument '" << a << "'\n" << launch_usage;
      return 2;
    }
  }
  if (sbatch && resume) {
    throw std::invalid_argument(
        "--resume does not go with --sbatch: submit a batch script that runs `moevement launch "
        "CONFIG --resume` instead");
  }
  if (sbatch && !injections.empty()) {
    throw std::invalid_argument(
        "--inject does not go with --sbatch (the batch job runs the launch from CONFIG and "
        "--set only): write the injections as [[inject]] tables in CONFIG "
        "(docs/configuration.md)");
  }
  // The config's [[inject]] tables first, then the command line's (--set may edit tables).
  {
    auto tables = take_inject_tables(raw, argv[2]);
    injections.insert(injections.begin(), tables.begin(), tables.end());
  }
  const engine::job_config job = engine::resolve_job(raw);
  check_host_memory(job.model, job.train);
  if (auto fits = engine::fits_the_wire(raw); !fits.ok()) {
    throw std::runtime_error(fits.err().message +
                             " (the workers would refuse the config: shorten the value)");
  }
  (void)registry.find(job.stage_type);  // an unknown stage type is a config error, here
  // Every injection checked against the job, and the failure schedules (mtbf, trace) built,
  // before anything starts.
  std::vector<scheduled_failure> schedule;
  std::vector<std::string> worker_injections;  // phase=...: carried out by the workers
  for (const auto& inj : injections) {
    const auto s = check_injection(inj, job);
    if (!s.empty()) {
      std::string line = "injection: " + inj.text() + " schedule:";
      for (const auto& f : s) line += " " + f.text() + ";";
      line.pop_back();
      std::cout << line << "\n";
    } else if (dry_run) {
      std::cout << "injection: " << inj.text() << "\n";
    }
    schedule.insert(schedule.end(), s.begin(), s.end());
    if (inj.phase) worker_injections.push_back(inj.text());
  }
  std::stable_sort(schedule.begin(), schedule.end(),
                   [](const auto& a, const auto& b) { return a.at_s < b.at_s; });
  if (dry_run) {
    std::cout << fmt::format(
        "moevement launch: dry run: the config and {} injection(s) are valid; nothing started\n",
        injections.size());
    return 0;
  }
  // The head's journal of durable windows (policy moevement with the durable tier): read by a
  // resume, started afresh by a new job.
  const bool journaled =
      job.policy == engine::policy_kind::moevement && engine::durable_tier(job) && !sbatch;
  std::optional<recovery::resume_journal> journal;
  std::optional<engine::resume_point> resume_from;
  if (resume && !journaled) {
    throw std::invalid_argument(
        "--resume needs the durable tier of policy moevement: the job must run with "
        "checkpoint.policy = \"moevement\" and checkpoint.durable = true (its windows and "
        "journal are under checkpoint.dir)");
  }
  if (journaled) {
    journal.emplace(job);
    if (resume) {
      std::vector<std::string> rejected;
      auto point = journal->load(&rejected);
      for (const auto& r : rejected) std::cerr << "moevement launch: --resume: " << r << "\n";
      if (!point.ok()) throw std::runtime_error("--resume: " + point.err().message);
      resume_from = std::move(*point);
    } else {
      journal->clear();
    }
  }
  const int nworkers = job.workers() + job.spares;
  const bool slurm = job.backend == "slurm";
  if (sbatch) return submit_with_sbatch(job, argv[2], overrides, sbatch_args);
  if (slurm) {
    if (const auto why = slurm_precheck(job)) {
      std::cerr << "moevement launch: " << *why << "\n";
      return 1;
    }
  }
  std::cout << fmt::format(
      "moevement launch: model {} ({} layers, {:.3f} M parameters), pp={} dp={}, {} workers + "
      "{} spare(s), stage type {}, checkpoint policy {}\n",
      job.model.preset, job.model.layers, double(job.model.parameter_count()) / 1e6, job.pp, job.dp,
      job.workers(), job.spares, job.stage_type, engine::policy_name(job.policy));

  const std::string token = new_token();
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  asio::io_context io(1);
  transport::ucx_link_options opt;
  opt.self = 0;
  opt.job_token = token;
  opt.listen_host = job.host;
  transport::ucx_link link(io, opt);
  actors::system_config cfg;
  cfg.head = 0;
  cfg.heartbeat_interval = std::chrono::milliseconds(job.heartbeat_ms);
  cfg.heartbeat_timeout = std::chrono::milliseconds(job.failure_timeout_ms);
  actors::actor_system sys(io, link, cfg);
  engine::run_log log(job.run_log, resume);

  const bool tty = ::isatty(STDOUT_FILENO) != 0;
  engine::job_outcome outcome;
  outcome.message = "the job did not finish";
  bool finished = false, progress_open = false, interrupted = false;
  std::map<pid_t, transport::node_id> children;
  std::unique_ptr<slurm_step> step;  // backend slurm: srun, node 0 in `children`
  asio::steady_timer linger(io), start_timer(io);
  asio::signal_set signals(io, SIGINT, SIGTERM, SIGCHLD);
  auto end_line = [&] {
    if (progress_open) std::cout << "\n";
    progress_open = false;
  };

  engine::coordinator_callbacks cb;
  actors::actor_ref coord_ref;
  // The run log's `inject` event: what the head struck, and where (phase=... injections are
  // the workers' own and show as their worker_lost).
  auto log_injection = [&](const std::string& spec, transport::node_id n, int stage, int replica) {
    log.write(engine::json_record{}
                  .add("kind", "event")
                  .add("event", "inject")
                  .add("spec", spec)
                  .add("node", std::int64_t{n})
                  .add("stage", stage)
                  .add("replica", replica)
                  .add("time_s", log.seconds()));
  };
  // Injected failures: once iteration T begins, the worker that runs (stage, replica) then.
  auto inject_due = [&](std::int64_t next_iteration) {
    auto* c = sys.local_actor<engine::coordinator>(coord_ref);
    if (c == nullptr) return;
    for (auto& inj : injections) {
      if (inj.done || inj.phase || inj.during_recovery || inj.iteration != next_iteration ||
          (inj.what != injection::kind::kill && inj.what != injection::kind::hang)) {
        continue;
      }
      for (const auto& [n, w] : c->workers()) {
        if (w.stage != inj.stage || w.replica != inj.replica) continue;
        inj.done = true;
        const bool kill = inj.what == injection::kind::kill;
        end_line();
        std::cout << fmt::format("inject: {} (worker {}, pid {})\n", inj.text(), n, w.pid)
                  << std::flush;
        log_injection(inj.text(), n, inj.stage, inj.replica);
        ::kill(w.pid, kill ? SIGKILL : SIGSTOP);
        break;
      }
    }
  };
  // during=recovery: the K-th recovery to start arms the injection, which fires delay_ms later
  // at whichever worker then holds (stage, replica): the spare being rebuilt, if it is that one.
  // Scheduled failures (mtbf, trace) count seconds of training from the end of iteration 0;
  // one falls due only while no recovery runs and the previous one was recovered, so that
  // each is recovered (and measured) on its own; during=recovery is how a failure is put
  // into a recovery on purpose.
  int recoveries_started = 0;
  bool recovering = false, awaiting_recovery = false, schedule_closed = false;
  std::vector<std::unique_ptr<asio::steady_timer>> delayed;
  asio::steady_timer schedule_timer(io);
  std::size_t schedule_next = 0;
  std::optional<std::chrono::steady_clock::time_point> train_start;
  // Kills (or stops) the worker that holds (stage, replica) now; false if none does.
  auto strike = [&](failure_kind what, int stage, int replica, const std::string& label,
                    const std::string& note) {
    auto* c = sys.local_actor<engine::coordinator>(coord_ref);
    if (c == nullptr || finished) return false;
    for (const auto& [n, w] : c->workers()) {
      if (w.stage != stage || w.replica != replica) continue;
      end_line();
      std::cout << fmt::format("inject: {} (worker {}, pid {}; {})\n", label, n, w.pid, note)
                << std::flush;
      log_injection(label, n, stage, replica);
      ::kill(w.pid, what == failure_kind::kill ? SIGKILL : SIGSTOP);
      return true;
    }
    end_line();
    std::cout << fmt::format("inject: {}: no worker holds stage {} replica {} now; skipped\n",
                             label, stage, replica)
              << std::flush;
    return false;
  };
  std::function<void()> schedule_due = [&] {
    if (!train_start || schedule_closed || finished) return;
    auto due = [&](std::size_t i) {
      return *train_start + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                std::chrono::duration<double>(schedule[i].at_s));
    };
    const auto now = std::chrono::steady_clock::now();
    while (schedule_next < schedule.size() && due(schedule_next) <= now) {
      if (recovering || awaiting_recovery) return;  // recovery_end calls again
      const scheduled_failure& f = schedule[schedule_next++];
      const double at = std::chrono::duration<double>(now - *train_start).count();
      const std::string kind = f.what == failure_kind::kill ? "kill" : "hang";
      awaiting_recovery =
          strike(f.what, f.stage, f.replica,
                 fmt::format("{}: {} stage={} replica={}", f.origin, kind, f.stage, f.replica),
                 fmt::format("due at {:.3f} s of training, now {:.3f} s", f.at_s, at));
    }
    if (schedule_next < schedule.size()) {
      schedule_timer.expires_at(due(schedule_next));
      schedule_timer.async_wait([&](const std::error_code& ec) {
        if (!ec) schedule_due();
      });
    }
  };
  cb.on_recovery = [&](const std::string& event, std::int64_t) {
    if (event == "recovery_end") {
      recovering = false;
      awaiting_recovery = false;
      schedule_due();
      return;
    }
    if (event != "recovery_start") return;
    recovering = true;
    const int k = ++recoveries_started;
    for (auto& inj : injections) {
      if (inj.done || !inj.during_recovery || inj.nth != k) continue;
      inj.done = true;
      auto fire = [&, text = inj.text(), what = inj.failure(), s = inj.stage, d = inj.replica, k] {
        strike(what, s, d, text,
               fmt::format("recovery {} {}", k,
                           recovering && recoveries_started == k ? "in progress" : "ended"));
      };
      if (inj.delay_ms == 0) {
        fire();
        continue;
      }
      delayed.push_back(std::make_unique<asio::steady_timer>(io));
      delayed.back()->expires_after(std::chrono::milliseconds(inj.delay_ms));
      delayed.back()->async_wait([fire](const std::error_code& ec) {
        if (!ec) fire();
      });
    }
  };
  cb.on_worker_lost = [&](transport::node_id n, int pid) {
    // A hung worker must not wake up later and talk as if nothing happened.
    for (const auto& [p, node] : children) {
      if (node == n && p == pid) ::kill(pid, SIGKILL);
    }
  };
  cb.on_notice = [&](const std::string& line) {
    end_line();
    std::cout << line << "\n" << std::flush;
  };
  cb.on_iteration = [&](const engine::iteration_record& r) {
    inject_due(r.iteration + 1);
    if (r.iteration + 1 >= job.train.iterations) {
      schedule_closed = true;  // the end of the job (validation, digests) is not targeted
      schedule_timer.cancel();
    } else if (!train_start && !schedule.empty()) {
      train_start = std::chrono::steady_clock::now();
      schedule_due();
    }
    const std::int64_t done = r.iteration + 1;
    const double eta = r.seconds * double(job.train.iterations - done);
    const std::string line =
        fmt::format("iter {:>6}/{}  loss {:.4f}  {:>8.0f} tok/s  {:.3f} s/iter  ETA {}", done,
                    job.train.iterations, r.loss, r.tokens_per_s, r.seconds, duration_text(eta));
    if (tty) {
      std::cout << "\r" << line << std::flush;
      progress_open = true;
    } else if (r.iteration % job.train.log_every == 0 || done == job.train.iterations) {
      std::cout << line << "\n" << std::flush;
    }
  };
  cb.on_validation = [&](std::int64_t it, double v) {
    end_line();
    std::cout << fmt::format("iter {:>6}  val_loss {:.4f}\n", it + 1, v) << std::flush;
  };
  cb.on_finished = [&](const engine::job_outcome& o) {
    finished = true;
    outcome = o;
    start_timer.cancel();
    schedule_timer.cancel();
    for (auto& t : delayed) t->cancel();
    // Let the Shutdown messages go out, then leave.
    linger.expires_after(std::chrono::milliseconds(200));
    linger.async_wait([&](const std::error_code&) {
      sys.shutdown();
      linger.expires_after(std::chrono::milliseconds(100));
      linger.async_wait([&](const std::error_code&) { io.stop(); });
    });
  };
  // The journal is written on a thread of its own, in order (its fsyncs must not hold the
  // head's actor thread and its heartbeats); a failure comes back as a notice.
  std::optional<recovery::durable_writer> journal_writer;
  if (journal) {
    journal_writer.emplace();
    cb.on_durable_window = [&](const engine::resume_point& p) {
      journal_writer->post([&, p] {
        try {
          journal->write(p);
        } catch (const std::exception& e) {
          asio::post(io, [&, line = fmt::format("durable tier: the resume journal of window {} "
                                                "was not written: {}",
                                                p.window, e.what())] { cb.on_notice(line); });
        }
      });
    };
  }
  auto coord = sys.spawn<engine::coordinator>(job, raw, cb, &log,
                                              recovery::any_head_recovery(job.policy), resume_from);
  coord_ref = coord;
  auto fail = [&](const std::string& why) {
    if (auto* c = sys.local_actor<engine::coordinator>(coord)) c->fail(why);
  };

  std::function<void(const std::error_code&, int)> on_signal = [&](const std::error_code& ec,
                                                                   int sig) {
    if (ec) return;
    if (sig == SIGCHLD) {
      int status = 0;
      pid_t pid;
      while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
        auto it = children.find(pid);
        if (it == children.end()) continue;
        const transport::node_id n = it->second;
        children.erase(it);
        if (step && pid == step->pid()) {
          step->exited(status);
          if (!finished) {
            end_line();
            fail(slurm_step_ended_text(job, *step, exit_text(status)));
          }
          continue;
        }
        auto* c = sys.local_actor<engine::coordinator>(coord);
        bool spare = false, known = false;
        if (c != nullptr) {
          const auto w = c->workers().find(n);
          known = w != c->workers().end();
          spare = c->started() && (!known || w->second.stage < 0);
        }
        if (!finished && spare && known) {
          end_line();
          std::cout << fmt::format("spare worker {} (pid {}) {}; training goes on\n", n, pid,
                                   exit_text(status));
        }
        // The coordinator decides: recover the stage on a spare, or end the job saying so.
        if (!finished && c != nullptr && known) {
          c->lose_worker(n, exit_text(status));
          // One truth about who is alive: the exit reaches the membership at once (asks to
          // the worker fail now, not at the heartbeat timeout).
          link.forget(n);
        } else if (!finished && (c == nullptr || !c->started())) {  // never said hello
          fail(fmt::format("worker {} (pid {}) {}", n, pid, exit_text(status)));
        }
      }
    } else if (!finished) {
      end_line();
      interrupted = true;
      fail(fmt::format("interrupted by signal {} ({}): stopped every worker", sig,
                       ::strsignal(sig)));
    }
    signals.async_wait(on_signal);
  };
  signals.async_wait(on_signal);

  start_timer.expires_after(std::chrono::milliseconds(job.start_timeout_ms));
  start_timer.async_wait([&](const std::error_code& ec) {
    auto* c = sys.local_actor<engine::coordinator>(coord);
    if (ec || finished || c == nullptr || c->started()) return;
    fail(
        fmt::format("the workers did not all start within cluster.start_timeout_ms = {} ms "
                    "({} of {} said hello){}",
                    job.start_timeout_ms, c->workers().size(), nworkers,
                    step ? "; the Slurm step's last lines:\n" + step->output_tail() : ""));
  });

  asio::co_spawn(
      io,
      [&]() -> actors::awaitable<void> {
        auto r = co_await sys.register_global(engine::coordinator::registered_name, coord,
                                              std::chrono::seconds(5));
        if (!r.ok()) {
          fail("cannot register the coordinator: " + r.err().message);
          co_return;
        }
        const std::string head = fmt::format("{}:{}", job.host, link.port());
        if (slurm) {
          try {
            step = start_slurm_step(job, self, head, token, worker_injections);
            children[step->pid()] = 0;
          } catch (const std::exception& e) {
            fail(e.what());
          }
          co_return;
        }
        for (int n = 1; n <= nworkers; ++n) {
          std::vector<std::string> args{"worker",
                                        "--head",
                                        head,
                                        "--node",
                                        std::to_string(n),
                                        "--host",
                                        job.host,
                                        "--heartbeat-ms",
                                        std::to_string(job.heartbeat_ms),
                                        "--failure-timeout-ms",
                                        std::to_string(job.failure_timeout_ms)};
          for (const auto& spec : worker_injections) {
            args.push_back("--inject");
            args.push_back(spec);
          }
          try {
            children[start_worker(self, args, token)] = transport::node_id(n);
          } catch (const std::exception& e) {
            fail(e.what());
            co_return;
          }
        }
      },
      asio::detached);

  io.run();
  end_line();
  log_link_refusals(log, link.counters());
  // What the head was to inject and did not (the run ended first, or nth recoveries never
  // started); phase=... injections are the workers' and not known here.
  for (const auto& inj : injections) {
    if (!inj.done && !inj.phase &&
        (inj.what == injection::kind::kill || inj.what == injection::kind::hang)) {
      std::cout << "inject: " << inj.text() << " did not fire before the job ended\n";
    }
  }
  if (schedule_next < schedule.size()) {
    std::cout << fmt::format(
        "inject: {} of {} scheduled failure(s) did not fall due before "
        "training ended\n",
        schedule.size() - schedule_next, schedule.size());
  }

  // Every worker goes: those that did not exit after Shutdown get SIGTERM, then SIGKILL. One
  // that ends badly on its own after a good run (a crash while shutting down) fails the launch.
  std::vector<std::string> bad_exits;
  bool graceful = true;
  auto reap = [&](std::chrono::milliseconds within) {
    const auto until = std::chrono::steady_clock::now() + within;
    while (!children.empty() && std::chrono::steady_clock::now() < until) {
      int status = 0;
      const pid_t pid = ::waitpid(-1, &status, WNOHANG);
      if (pid > 0) {
        const auto it = children.find(pid);
        if (graceful && it != children.end() && it->second != 0 &&
            !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
          bad_exits.push_back(fmt::format("worker {} (pid {}) {} while shutting down", it->second,
                                          pid, exit_text(status)));
        }
        children.erase(pid);
      } else if (pid < 0 && errno == ECHILD) {
        children.clear();
      } else {
        ::usleep(10000);
      }
    }
  };
  std::string step_end;
  if (step) {  // srun goes first: the workers are its tasks
    children.erase(step->pid());
    step_end = step->stop(srun_grace_ms);
  }
  reap(std::chrono::milliseconds(outcome.ok ? 3000 : 200));
  graceful = false;
  for (const auto& [pid, n] : children) ::kill(pid, SIGTERM);
  reap(std::chrono::milliseconds(2000));
  for (const auto& [pid, n] : children) ::kill(pid, SIGKILL);
  reap(std::chrono::milliseconds(2000));

  if (outcome.ok && !bad_exits.empty()) {
    outcome.ok = false;
    outcome.message = bad_exits.front();
    for (std::size_t i = 1; i < bad_exits.size(); ++i) outcome.message += "; " + bad_exits[i];
    outcome.message += " (the job itself finished: see that worker's output above)";
  }
  if (!outcome.ok) {
    std::cerr << "moevement launch: " << outcome.message << "\n";
    std::cerr << "run log: " << job.run_log << "\n";
    if (step) {
      std::cerr << "Slurm step output (each task's stdout and stderr): " << step->output_path()
                << " (" << step_end << ")\n";
    }
    return interrupted ? 130 : 1;
  }
  std::cout << fmt::format(
      "final: loss {:.4f}  val_loss {:.4f}  tokens/s {:.0f}  ({} iterations, {:.2f} s)  "
      "ETTR {:.3f}\n",
      outcome.final_loss, outcome.val_loss, outcome.tokens_per_s, outcome.iterations,
      outcome.seconds, outcome.ettr);
  std::cout << "run log: " << job.run_log << "\n";
  if (step) {
    std::cout << "Slurm step output (each task's stdout and stderr): " << step->output_path()
              << "\n";
  }
  std::cout << "state_hash=" << hex16(outcome.state_hash) << "\n";
  return 0;
}

}  // namespace moevement::launcher
