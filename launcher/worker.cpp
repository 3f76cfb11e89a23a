// `moevement worker --head HOST:PORT --node N [--host H] [--heartbeat-ms X]
//  [--failure-timeout-ms Y]`, with the job token in MOEVEMENT_JOB_TOKEN (never on the command
// line, where other users could read it). Started by `moevement launch` (or by Slurm:
// `moevement worker --slurm ...`, launcher/slurm_backend.hpp).
#include <fmt/format.h>
#include <unistd.h>
#include <asio/co_spawn.hpp>
#include <asio/detached.hpp>
#include <asio/io_context.hpp>
#include <asio/signal_set.hpp>
#include <asio/steady_timer.hpp>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "actors/system.hpp"
#include "engine/coordinator.hpp"
#include "engine/worker_agent.hpp"
#include "launcher/config.hpp"
#include "launcher/fault_hooks.hpp"
#include "launcher/inject.hpp"
#include "launcher/launch.hpp"
#include "launcher/slurm_backend.hpp"
#include "recovery/baseline_policy.hpp"
#include "transport/ucx_link.hpp"

namespace moevement::launcher {

namespace {

constexpr const char* worker_usage =
    "usage: moevement worker --head HOST:PORT --node N [--host H] [--domain NODE] "
    "[--heartbeat-ms X] [--failure-timeout-ms Y] [--inject SPEC ...]\n"
    "  started by `moevement launch`; the job token comes in MOEVEMENT_JOB_TOKEN; --inject: the\n"
    "  job's phase=... and flip injections, which the worker of that role carries out itself\n";

struct worker_args {
  std::string head_host;
  std::uint16_t head_port = 0;
  transport::node_id node = 0;
  std::string host = "127.0.0.1";
  std::string domain;  // failure domain (the Slurm node); empty: the host
  long heartbeat_ms = engine::job_config{}.heartbeat_ms;  // (the launcher passes both)
  long failure_timeout_ms = engine::job_config{}.failure_timeout_ms;
  std::vector<injection> injections;  // phase=... and flip (launcher/inject.hpp)
};

// The policy's limits; a replicator takes a StoreSlot's flip only where the job injects one.
recovery::policy_limits limits_of(const std::vector<injection>& injections) {
  recovery::policy_limits limits;
  limits.accept_copy_flips = std::any_of(injections.begin(), injections.end(), [](const auto& i) {
    return i.what == injection::kind::flip && i.slot_copy;
  });
  return limits;
}

worker_args parse(int argc, char** argv) {
  worker_args a;
  for (int i = 2; i < argc; ++i) {
    const std::string f = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(f + ": missing value\n" + worker_usage);
    const std::string v = argv[++i];
    if (f == "--head") {
      const auto colon = v.rfind(':');
      if (colon == std::string::npos) throw std::invalid_argument("--head: expected HOST:PORT");
      a.head_host = v.substr(0, colon);
      a.head_port = std::uint16_t(flag_number("--head", v.substr(colon + 1), 1, 65535));
    } else if (f == "--node") {
      a.node = transport::node_id(flag_number(f, v, 1, 1 << 20));
    } else if (f == "--host") {
      a.host = v;
    } else if (f == "--domain") {
      if (v.empty() || v.size() > 255) throw std::invalid_argument("--domain: 1 to 255 bytes");
      a.domain = v;
    } else if (f == "--heartbeat-ms") {
      a.heartbeat_ms = flag_number(f, v, 1, engine::max_heartbeat_ms);
    } else if (f == "--failure-timeout-ms") {
      a.failure_timeout_ms = flag_number(f, v, 1, engine::max_failure_timeout_ms);
    } else if (f == "--inject") {
      injection inj = parse_injection(v);
      if (!inj.phase && inj.what != injection::kind::flip) {
        throw std::invalid_argument("--inject " + v + ": a worker takes phase=... and flip only");
      }
      a.injections.push_back(std::move(inj));
    } else {
      throw std::invalid_argument("unexpected argument '" + f + "'\n" + worker_usage);
    }
  }
  if (a.head_host.empty() || a.node == 0) {
    throw std::invalid_argument(std::string("--head and --node are required\n") + worker_usage);
  }
  return a;
}

// Tearing down waits for the stage's compute thread: one stuck in a kernel (a stalled stage,
// fenced) never returns, and under Slurm no head is there to kill the process. (Not after a
// good run: its teardown has nothing stuck, and a disk write may be finishing.)
void exit_if_stuck(int status) {
  std::thread([status] {
    std::this_thread::sleep_for(std::chrono::seconds(30));
    std::fflush(stdout);
    ::_exit(status);
  }).detach();
}

}  // namespace

int run_worker(int argc, char** argv, const engine::stage_registry& registry) {
  // The head's output is this worker's (the local backend): closed (`launch ... | head`), a
  // line printed here must not end the worker as a lost one; the head stops the job.
  std::signal(SIGPIPE, SIG_IGN);
  // Nor a hang-up: the terminal's goes to the head, which stops the job; the kernel's, sent to
  // a process group left orphaned with a stopped member (the head died), must not end the
  // workers a standby head goes on with (UCX's own handler turned its log to debug level).
  std::signal(SIGHUP, SIG_IGN);
  if (argc > 2 && std::string(argv[2]) == "--slurm") return run_slurm_worker(argc, argv, registry);
  const worker_args args = parse(argc, argv);
  const char* token = std::getenv("MOEVEMENT_JOB_TOKEN");
  if (token == nullptr || *token == '\0') {
    std::cerr << "moevement worker: MOEVEMENT_JOB_TOKEN is not set (workers are started by "
                 "`moevement launch`, which sets it)\n";
    return 2;
  }
  auto say = [&](const std::string& what) {
    std::cerr << fmt::format("worker {} (pid {}): {}\n", args.node, ::getpid(), what);
  };
  asio::io_context io(1);
  transport::ucx_link_options opt;
  opt.self = args.node;
  opt.job_token = token;
  opt.listen_host = args.host;
  transport::ucx_link link(io, opt);
  link.add_peer(0, args.head_host, args.head_port);
  actors::system_config cfg;
  cfg.head = 0;
  cfg.heartbeat_interval = std::chrono::milliseconds(args.heartbeat_ms);
  cfg.heartbeat_timeout = std::chrono::milliseconds(args.failure_timeout_ms);
  actors::actor_system sys(io, link, cfg);

  int status = 1;
  bool stopping = false;
  asio::steady_timer linger(io);
  asio::steady_timer admission(io);
  asio::signal_set signals(io, SIGTERM, SIGINT);
  // Shuts the system down (goodbye to the peers), then lets the loop flush for a moment.
  auto stop = [&](int s, const std::string& why) {
    if (stopping) return;
    stopping = true;
    status = s;
    if (s != 0) {
      const auto& st = sys.stats();
      say(fmt::format("{} (reconnects {}{}, peers reported silent {})", why, st.reconnects,
                      st.reconnects > 0 ? ", the last " + sys.last_reconnect() : std::string(),
                      st.suspicions));
    }
    signals.cancel();
    admission.cancel();
    sys.shutdown();
    linger.expires_after(std::chrono::milliseconds(100));
    linger.async_wait([&](const std::error_code&) { io.stop(); });
  };
  signals.async_wait([&](const std::error_code& ec, int sig) {
    if (!ec) stop(128 + sig, fmt::format("stopped by signal {}", sig));
  });
  actors::actor_ref agent;
  const std::string host = args.host, domain = args.domain;
  // Finds the coordinator at the head (a standby that took over registers its own a moment
  // later: looked for again until `within`) and says hello to it.
  auto hello = [&, host, domain](std::chrono::seconds ask,
                                 std::chrono::seconds within) -> actors::awaitable<void> {
    const auto until = std::chrono::steady_clock::now() + within;
    for (;;) {
      auto coord = co_await sys.whereis_global(engine::coordinator::registered_name, ask);
      if (coord.ok() && coord->valid()) {
        if (auto* a = sys.local_actor<engine::worker_agent>(agent))
          a->say_hello(*coord, host, domain);
        co_return;
      }
      if (std::chrono::steady_clock::now() >= until || stopping) {
        stop(1, "cannot find the coordinator at the head: " +
                    (coord.ok() ? std::string("not registered") : coord.err().message));
        co_return;
      }
      co_await sys.sleep_for(std::chrono::milliseconds(100));
    }
  };
  bool followed_standby = false;  // (its loss is then named as the standby's, not the head's)
  sys.on_membership([&](transport::node_id n, actors::member_event e) {
    if (e == actors::member_event::head_changed) {  // a standby took the lost head's place
      followed_standby = true;
      say(fmt::format("the head was lost; the standby head (node {}) takes over", n));
      // A worker that followed the standby at once (its redial to the head refused) may wait
      // out a hung member's failure timeout before the standby takes over and registers.
      const auto within = std::chrono::seconds(60 + 2 * args.failure_timeout_ms / 1000);
      asio::co_spawn(io, hello(std::chrono::seconds(5), within), asio::detached);
      return;
    }
    // (Where a standby takes over, the lost head is no longer sys.head() here.)
    if (n == sys.head() && e != actors::member_event::up) {
      const std::string why = sys.why_lost(n);
      stop(1, fmt::format("lost the {}{}: stopping",
                          followed_standby ? fmt::format("standby head (node {}) that took over", n)
                                           : std::string("head"),
                          why.empty() ? "" : " (" + why + ")"));
    }
    if (n == args.node && e == actors::member_event::lost) {
      // The head's reason where it gave one (a fence for silent corruption), else the usual.
      const std::string why = sys.why_lost(args.node);
      stop(1, why.starts_with("fenced")
                  ? fmt::format("the head {}: stopping", why)
                  : std::string("the head declared this worker lost (its peers could not reach "
                                "it): stopping"));
    }
  });
  // Its peers judge a silence past the failure timeout: one of this process's own is named here.
  sys.on_stall([&](actors::clock::duration gap) {
    say(fmt::format("this worker did not run for {:.1f} s (stopped, or starved of CPU)",
                    std::chrono::duration<double>(gap).count()));
  });
  agent = sys.spawn<engine::worker_agent>(
      link, registry, [&](int s, const std::string& why) { stop(s, why); },
      recovery::any_policy_factory(limits_of(args.injections)),
      worker_fault_factory(args.injections,
                           fmt::format("worker {}, pid {}", args.node, ::getpid())));
  // Before it joins, a worker is no member and cannot see the head die: bound the wait.
  admission.expires_after(std::chrono::seconds(120));
  admission.async_wait([&](const std::error_code& ec) {
    auto* a = sys.local_actor<engine::worker_agent>(agent);
    if (!ec && (a == nullptr || !a->assigned())) stop(1, "no role from the head in 120 s");
  });
  asio::co_spawn(io, hello(std::chrono::seconds(30), std::chrono::seconds(0)), asio::detached);
  io.run();
  if (status != 0) exit_if_stuck(status);
  return status;
}

}  // namespace moevement::launcher
