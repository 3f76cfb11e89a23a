#include "launcher/slurm_backend.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <netdb.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <random>
#include <thread>

#include "launcher/config.hpp"
#include "launcher/exec_child.hpp"
#include "launcher/launch.hpp"

namespace moevement::launcher {

namespace {

constexpr const char* slurm_worker_usage =
    "usage: moevement worker --slurm --head HOST:PORT --pp P --dp D --spares S [--host H] "
    "[--heartbeat-ms X] [--failure-timeout-ms Y] [--inject SPEC ...]\n"
    "  a task of the srun step that `moevement launch` starts (cluster.backend = \"slurm\"); the "
    "job token comes in MOEVEMENT_JOB_TOKEN\n";

// The first address `name` resolves to (IPv4 preferred: what UCX's sockaddr listener and the
// head most likely share).
std::optional<std::string> resolve(const std::string& name) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(name.c_str(), nullptr, &hints, &res) != 0 || res == nullptr) {
    return std::nullopt;
  }
  std::optional<std::string> out;
  for (int pass = 0; pass < 2 && !out; ++pass) {
    for (addrinfo* a = res; a != nullptr; a = a->ai_next) {
      if (pass == 0 && a->ai_family != AF_INET) continue;
      char host[NI_MAXHOST];
      if (::getnameinfo(a->ai_addr, a->ai_addrlen, host, sizeof host, nullptr, 0, NI_NUMERICHOST) ==
          0) {
        out = host;
        break;
      }
    }
  }
  ::freeaddrinfo(res);
  return out;
}

bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  if (path == nullptr) return false;
  const std::string p = path;
  for (std::size_t start = 0; start <= p.size();) {
    const auto colon = std::min(p.find(':', start), p.size());
    const auto dir = p.substr(start, colon - start);
    if (!dir.empty() && ::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    start = colon + 1;
  }
  return false;
}

// 'text' for bash, whatever it contains.
std::string shell_quote(const std::string& text) {
  std::string out = "'";
  for (char c : text) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

// Runs argv (no shell) and returns its exit status (-1: did not exit normally) and its
// stdout and stderr together.
std::pair<int, std::string> run_capturing(std::vector<std::string> argv) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  std::vector<char*> c_args;
  for (auto& a : argv) c_args.push_back(a.data());
  c_args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    close_inherited_fds();
    ::execvp(c_args[0], c_args.data());
    std::fprintf(stderr, "cannot run %s: %s\n", c_args[0], std::strerror(errno));
    ::_exit(127);
  }
  ::close(fds[1]);
  std::string out;
  char buf[4096];
  for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    out.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string run_log_base(const std::string& run_log) {
  std::string base = run_log;
  if (base.ends_with(".jsonl")) base.resize(base.size() - 6);
  return base;
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host == "::1" || host.starts_with("127.");
}

// The tasks spread evenly over cluster.slurm_nodes (at most this many per node): by default
// Slurm fills the first node's CPUs, so one node would hold most tasks and its loss most roles
// and every spare; spread, a lost node takes about 1/N of them and the spares elsewhere survive
// it. (--spread-job spreads the allocation, not the tasks.)
std::string spread_tasks(const engine::job_config& job) {
  const int ntasks = job.workers() + job.spares;
  return fmt::format("--ntasks-per-node={}", (ntasks + job.slurm_nodes - 1) / job.slurm_nodes);
}

}  // namespace

int spares_filling_nodes(const engine::job_config& job) {
  if (job.slurm_nodes <= 0) return job.spares;
  const int ntasks = job.workers() + job.spares;
  const int per_node = (ntasks + job.slurm_nodes - 1) / job.slurm_nodes;
  return per_node * job.slurm_nodes - job.workers();
}

std::string slurm_output_path(const std::string& run_log) {
  return run_log_base(run_log) + ".slurm.log";
}

std::vector<std::string> srun_command(const engine::job_config& job, const std::string& self,
                                      const slurm_task_args& args, const std::string& step_name,
                                      bool in_allocation) {
  const int ntasks = job.workers() + job.spares;
  std::vector<std::string> c{"srun", "--job-name=" + step_name, fmt::format("--ntasks={}", ntasks)};
  if (job.slurm_nodes > 0) c.push_back(fmt::format("--nodes={}", job.slurm_nodes));
  if (!job.slurm_partition.empty()) c.push_back("--partition=" + job.slurm_partition);
  if (job.slurm_nodes > 0 && !in_allocation) c.push_back(spread_tasks(job));
  if (!in_allocation) {
    // Outside an allocation srun would queue for ever when the cluster cannot run the step.
    // It gives up a little before the head's start timeout, so that its reason (too few
    // nodes, say) and the hint that names the key come out rather than "0 of N said hello".
    c.push_back(
        fmt::format("--immediate={}", std::max<std::int64_t>(1, job.start_timeout_ms * 3 / 4000)));
  }
  // One task dying must not end the step (recovery moves its stage to a spare): never -K1,
  // and say so explicitly in case the cluster's slurm.conf sets KillOnBadExit. --no-kill:
  // the loss of a node does not end the step either.
  c.insert(c.end(), {"--kill-on-bad-exit=0", "--no-kill",
                     // place_workers() numbers tasks as the block distribution does.
                     "--distribution=block",
                     // The token and the rest of our environment go with the tasks.
                     "--export=ALL", "--input=none", "--label", "--unbuffered"});
  c.insert(c.end(),
           {self, "worker", "--slurm", "--head", args.head, "--pp", std::to_string(args.pp), "--dp",
            std::to_string(args.dp), "--spares", std::to_string(args.spares), "--heartbeat-ms",
            std::to_string(args.heartbeat_ms), "--failure-timeout-ms",
            std::to_string(args.failure_timeout_ms)});
  if (!args.worker_host.empty()) c.insert(c.end(), {"--host", args.worker_host});
  for (const auto& spec : args.injections) c.insert(c.end(), {"--inject", spec});
  return c;
}

slurm_role slurm_role_of(const slurm_env& env, int pp, int dp, int spares) {
  const int needed = pp * dp + spares;
  if (env.ntasks != needed) {
    throw slurm_env_error(fmt::format(
        "the step has {} tasks (SLURM_NTASKS) but pp={} x dp={} workers + {} spares need "
        "exactly {}: start it with `moevement launch` (cluster.backend = \"slurm\")",
        env.ntasks, pp, dp, spares, needed));
  }
  if (env.tasks_per_node.empty()) {
    throw slurm_env_error(
        "SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE) is not set: run this inside the "
        "srun step that `moevement launch` starts");
  }
  placement_request req;
  req.tasks_per_node = env.tasks_per_node;
  req.pp = pp;
  req.dp = dp;
  req.spares = spares;
  const placement p = place_workers(req);
  slurm_role r;
  r.task = env.proc_id;
  r.ntasks = env.ntasks;
  r.node_name = env.node_name;
  r.node_index = env.node_index();
  if (env.proc_id >= static_cast<int>(p.node_of_task.size()) ||
      p.node_of_task[static_cast<std::size_t>(env.proc_id)] != r.node_index) {
    throw slurm_env_error(fmt::format(
        "task {} runs on node {} ({}) but the block distribution puts it on node {}: the step "
        "must use --distribution=block (as `moevement launch` starts it)",
        env.proc_id, r.node_index, env.node_name,
        env.proc_id < static_cast<int>(p.node_of_task.size())
            ? p.node_of_task[static_cast<std::size_t>(env.proc_id)]
            : -1));
  }
  if (const worker_slot* w = p.worker_on_task(env.proc_id)) {
    r.stage = w->stage;
    r.replica = w->replica;
    r.node_id = static_cast<std::uint32_t>(w->replica * pp + w->stage + 1);
  } else {
    const auto it = std::find(p.spare_tasks.begin(), p.spare_tasks.end(), env.proc_id);
    r.node_id = static_cast<std::uint32_t>(pp * dp + 1 + (it - p.spare_tasks.begin()));
  }
  return r;
}

std::optional<std::string> launched_by_many_tasks() {
  const char* n = std::getenv("SLURM_STEP_NUM_TASKS");  // set by srun only, not in a batch script
  if (n == nullptr || std::strtol(n, nullptr, 10) <= 1) return std::nullopt;
  const char* id = std::getenv("SLURM_PROCID");
  return fmt::format(
      "this is task {} of {} of a Slurm step (SLURM_STEP_NUM_TASKS = {}), but `moevement launch` "
      "is the job's head and runs once: it starts its workers itself (with srun, under "
      "cluster.backend = \"slurm\"). Run it once, in the batch script or the salloc shell, not "
      "under `srun -n N`",
      id != nullptr ? id : "?", n, n);
}

std::optional<std::string> slurm_precheck(const engine::job_config& job) {
  if (!on_path("srun")) {
    return "cluster.backend = \"slurm\" but srun is not on PATH: run this on a Slurm login node "
           "or inside an allocation (salloc/sbatch), or use cluster.backend = \"local\"";
  }
  const int needed = job.workers() + job.spares;
  if (std::getenv("SLURM_JOB_ID") != nullptr) {
    if (const char* n = std::getenv("SLURM_NTASKS")) {
      char* end = nullptr;
      const long have = std::strtol(n, &end, 10);
      if (*n != '\0' && *end == '\0' && have < needed) {
        return fmt::format(
            "too few Slurm tasks: this allocation has {} (SLURM_NTASKS) but pp={} x dp={} "
            "workers + {} spare(s) need {}; ask sbatch/salloc for -n {} (or lower "
            "cluster.spares{})",
            have, job.pp, job.dp, job.spares, needed, needed,
            job.slurm_nodes > 0 ? "; cluster.slurm_nodes raises the spares to fill its nodes: "
                                  "inside an allocation leave it at 0, the step uses the "
                                  "allocation's nodes"
                                : "");
      }
    }
  }
  return std::nullopt;
}

int run_slurm_worker(int argc, char** argv, const engine::stage_registry& registry) {
  std::string head, host;
  int pp = 0, dp = 0, spares = -1;
  long heartbeat_ms = engine::job_config{}.heartbeat_ms;
  long failure_timeout_ms = engine::job_config{}.failure_timeout_ms;
  std::vector<std::string> injections;
  for (int i = 3; i < argc; ++i) {  // argv: moevement worker --slurm ...
    const std::string f = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(f + ": missing value\n" + slurm_worker_usage);
    const std::string v = argv[++i];
    if (f == "--head") {
      head = v;
    } else if (f == "--host") {
      host = v;
    } else if (f == "--pp") {
      pp = int(flag_number(f, v, 1, engine::max_job_workers));
    } else if (f == "--dp") {
      dp = int(flag_number(f, v, 1, engine::max_job_workers));
    } else if (f == "--spares") {
      spares = int(flag_number(f, v, 0, engine::max_job_workers));
    } else if (f == "--heartbeat-ms") {
      heartbeat_ms = flag_number(f, v, 1, engine::max_heartbeat_ms);
    } else if (f == "--failure-timeout-ms") {
      failure_timeout_ms = flag_number(f, v, 1, engine::max_failure_timeout_ms);
    } else if (f == "--inject") {
      injections.push_back(v);  // run_worker checks it
    } else {
      throw std::invalid_argument("unexpected argument '" + f + "'\n" + slurm_worker_usage);
    }
  }
  if (head.empty() || pp == 0 || dp == 0 || spares < 0) {
    throw std::invalid_argument(std::string("--head, --pp, --dp and --spares are required\n") +
                                slurm_worker_usage);
  }
  const slurm_env env = slurm_env_from_process();
  const slurm_role role = slurm_role_of(env, pp, dp, spares);
  if (host.empty()) {
    const auto addr = resolve(role.node_name);
    if (!addr) {
      throw slurm_env_error(fmt::format(
          "cannot resolve this task's node name '{}' (SLURMD_NODENAME) to an address: make the "
          "node names resolve (DNS or /etc/hosts), or run the whole job on one host with "
          "cluster.host = 127.0.0.1",
          role.node_name));
    }
    host = *addr;
  }
  // One line per task in the step's output: which task became which node (docs/slurm.md).
  std::cerr << fmt::format("worker {} (pid {}): Slurm task {} of {} on node {}: {}\n", role.node_id,
                           ::getpid(), role.task, role.ntasks, role.node_name,
                           role.stage >= 0
                               ? fmt::format("stage {} replica {}", role.stage, role.replica)
                               : std::string("spare"))
            << std::flush;
  std::vector<std::string> args{argv[0],
                                "worker",
                                "--head",
                                head,
                                "--node",
                                std::to_string(role.node_id),
                                "--host",
                                host,
                                "--domain",
                                role.node_name,
                                "--heartbeat-ms",
                                std::to_string(heartbeat_ms),
                                "--failure-timeout-ms",
                                std::to_string(failure_timeout_ms)};
  for (const auto& spec : injections) args.insert(args.end(), {"--inject", spec});
  std::vector<char*> c_args;
  for (auto& a : args) c_args.push_back(a.data());
  c_args.push_back(nullptr);
  return run_worker(static_cast<int>(args.size()), c_args.data(), registry);
}

slurm_step::slurm_step(std::vector<std::string> command, const std::string& token,
                       std::string output_path, std::string step_name, bool outlive_head,
                       bool append)
    : output_(std::move(output_path)), name_(std::move(step_name)) {
  const int out =
      ::open(output_.c_str(), O_WRONLY | O_CREAT | (append ? O_APPEND : O_TRUNC) | O_CLOEXEC, 0644);
  if (out < 0) {
    throw std::runtime_error(fmt::format("cannot create the Slurm step's output file {}: {}",
                                         output_, std::strerror(errno)));
  }
  std::vector<char*> argv;
  for (auto& a : command) argv.push_back(a.data());
  argv.push_back(nullptr);
  child_environment env("MOEVEMENT_JOB_TOKEN", token);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    ::close(out);
    throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  }
  if (pid == 0) {
    ::setpgid(0, 0);  // Ctrl-C goes to the head only; the head ends the step
    // If the head dies, srun ends the step (SIGTERM: srun cancels it; SIGKILL would orphan it),
    // unless a standby head takes the step over.
    if (!outlive_head) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(1);
    }
    ::dup2(out, 1);
    ::dup2(out, 2);
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    close_inherited_fds();  // srun may outlive the head: it must not keep the head's port
    ::execvpe("srun", argv.data(), env.get());
    // (a write(2) of a fixed text: fprintf may take a lock another thread held at the fork)
    const char why[] = "moevement launch: cannot run srun (not on PATH, or not executable)\n";
    (void)!::write(2, why, sizeof why - 1);
    ::_exit(127);
  }
  ::close(out);
  pid_ = pid;
}

slurm_step::~slurm_step() {
  if (running()) (void)stop(0);
}

std::string slurm_step::output_tail(std::size_t max_lines) const {
  std::ifstream in(output_);
  std::deque<std::string> lines;
  for (std::string l; std::getline(in, l);) {
    if (l.empty()) continue;
    if (l.size() > 300) {  // (not substr() + "...": a g++ 12 -Warray-bounds false positive)
      l.resize(300);
      l += "...";
    }
    lines.push_back(l);
    if (lines.size() > max_lines) lines.pop_front();
  }
  std::string out;
  for (const auto& l : lines) out += "  " + l + "\n";
  return out;
}

void slurm_step::exited(int status) {
  exited_ = true;
  status_ = status;
}

bool slurm_step::wait_for_exit(int ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  for (;;) {
    if (exited_) return true;
    int status = 0;
    const pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exited(status);
      return true;
    }
    if (r < 0 && errno == ECHILD) {  // reaped elsewhere
      exited(0);
      return true;
    }
    if (std::chrono::steady_clock::now() >= until) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

void slurm_step::scancel() {
  // The step's (or, outside an allocation, the job's) id by its unique name; scancel it.
  const std::string cmd = fmt::format(
      "timeout 10 squeue -h -s -o '%i %j' 2>/dev/null | awk '$2 == \"{}\" {{print $1}}' "
      "| xargs -r timeout 10 scancel 2>/dev/null",
      name_);
  (void)std::system(cmd.c_str());
}

std::string slurm_step::stop(int grace_ms) {
  if (pid_ <= 0) return "";
  std::string how = "srun ended on its own";
  if (!wait_for_exit(grace_ms)) {
    ::kill(pid_, SIGTERM);  // srun: "forcing job termination"
    how = "srun ended the step on SIGTERM";
    if (!wait_for_exit(srun_term_wait_ms)) {
      scancel();
      how = "the step was cancelled with scancel";
      if (!wait_for_exit(srun_term_wait_ms)) {
        ::kill(-pid_, SIGKILL);
        how = "srun was killed with SIGKILL after scancel";
        (void)wait_for_exit(5000);
      }
    }
  }
  return how;
}

// Backend slurm: starts the srun step of every worker and spare, and says where its output goes.
std::unique_ptr<slurm_step> start_slurm_step(const engine::job_config& job, const std::string& self,
                                             const std::string& head, const std::string& token,
                                             const std::vector<std::string>& injections,
                                             bool append) {
  slurm_task_args a;
  a.head = head;
  a.injections = injections;
  // One host (the tests' local Slurm): every task listens on the head's loopback address.
  // Otherwise each task listens on its own node's address (its node name, resolved).
  a.worker_host = is_loopback(job.host) ? job.host : "";
  a.pp = job.pp;
  a.dp = job.dp;
  a.spares = job.spares;
  a.heartbeat_ms = job.heartbeat_ms;
  a.failure_timeout_ms = job.failure_timeout_ms;
  std::random_device rd;
  const std::string name = fmt::format("moevement-{}-{:06x}", ::getpid(), rd() & 0xffffff);
  const bool in_allocation = std::getenv("SLURM_JOB_ID") != nullptr;
  auto command = srun_command(job, self, a, name, in_allocation);
  const std::string output = slurm_output_path(job.run_log);
  std::cout << fmt::format(
                   "Slurm step {}: {} tasks{}{}{}; its output: {}\n", name,
                   job.workers() + job.spares,
                   job.slurm_nodes > 0 ? fmt::format(" on {} nodes", job.slurm_nodes) : "",
                   job.slurm_partition.empty() ? "" : " in partition " + job.slurm_partition,
                   in_allocation ? " inside this allocation" : "", output)
            << std::flush;
  const char* job_nodes = std::getenv("SLURM_JOB_NUM_NODES");
  if (is_loopback(job.host) &&
      (job.slurm_nodes > 1 || (job_nodes != nullptr && std::atoi(job_nodes) > 1))) {
    std::cout << fmt::format(
        "note: cluster.host = {} (loopback): every task must run on this machine; on a cluster "
        "of several hosts set cluster.host to this machine's address (docs/slurm.md)\n",
        job.host);
  }
  return std::make_unique<slurm_step>(std::move(command), token, output, name, job.standby_head,
                                      append);
}

std::string batch_script_with_standby(const std::string& head, const std::string& run_log) {
  // The end of the batch script ends the job and every step in it (Slurm kills them within
  // seconds), the standby head's too: with the head exec'd as the script, a killed head took the
  // standby that was to take its place with it. So the head runs as a child; the script passes
  // Slurm's signals on to it (once it is gone, to the standby's step: SIGUSR1 before a time
  // limit is the standby's to act on then), waits while the standby's step runs (a standby that
  // took the job over ends it; a failed squeue is asked again, never taken for "no step"), and
  // ends as the job did: 0 where the run log's last end is a job_end.
  return "standby_step() { squeue -h -s -j \"$SLURM_JOB_ID\" -o '%i %j' | awk "
         "'/-standby-/ { print $1; exit }'; }\n"
         "pass_on() {\n"
         "  if kill -0 \"$head\" 2>/dev/null; then kill -\"$1\" \"$head\"\n"
         "  else s=$(standby_step) && [ -n \"$s\" ] && scancel --signal=\"$1\" \"$s\"; fi\n"
         "}\n"
         "head=\n"
         "trap 'pass_on USR1' USR1\n"
         "trap 'pass_on TERM' TERM\n"
         "trap 'pass_on INT' INT\n" +
         head +
         " &\n"
         "head=$!\n"
         "while kill -0 \"$head\" 2>/dev/null; do wait \"$head\"; done\n"
         "wait \"$head\"; status=$?\n"
         "while :; do\n"
         "  steps=$(squeue -h -s -j \"$SLURM_JOB_ID\" -o %j 2>/dev/null) || { sleep 5; continue; "
         "}\n"
         "  grep -q -- '-standby-' <<<\"$steps\" || break\n"
         "  sleep 1\n"
         "done\n"
         "last=$(grep -o '\"event\":\"job_[a-z]*\"' " +
         shell_quote(run_log) +
         " 2>/dev/null | tail -n 1)\n"
         "[ \"$last\" = '\"event\":\"job_end\"' ] && status=0\n"
         "exit $status\n";
}

std::string slurm_standby_output_path(const std::string& run_log) {
  return run_log_base(run_log) + ".standby.log";
}

std::unique_ptr<slurm_step> start_slurm_standby(const engine::job_config& job,
                                                const std::string& self,
                                                const std::vector<std::string>& standby_args,
                                                const std::string& token, bool append) {
  std::random_device rd;
  const std::string name = fmt::format("moevement-{}-standby-{:06x}", ::getpid(), rd() & 0xffffff);
  const bool in_allocation = std::getenv("SLURM_JOB_ID") != nullptr;
  std::vector<std::string> c{"srun", "--job-name=" + name, "--ntasks=1", "--nodes=1"};
  if (!job.slurm_partition.empty()) c.push_back("--partition=" + job.slurm_partition);
  if (in_allocation) {
    c.push_back("--overlap");  // beside the workers' step, on their CPUs: it idles until needed
  } else {
    c.push_back(
        fmt::format("--immediate={}", std::max<std::int64_t>(1, job.start_timeout_ms / 1000)));
  }
  c.insert(c.end(), {"--kill-on-bad-exit=0", "--export=ALL", "--input=none", "--unbuffered", self});
  c.insert(c.end(), standby_args.begin(), standby_args.end());
  const std::string output = slurm_standby_output_path(job.run_log);
  std::cout << fmt::format("Slurm step {}: the standby head; its output: {}\n", name, output)
            << std::flush;
  return std::make_unique<slurm_step>(std::move(c), token, output, name, true, append);
}

std::string slurm_task_host(const std::string& job_host) {
  const char* node = std::getenv("SLURMD_NODENAME");
  if (node == nullptr || is_loopback(job_host)) return job_host;
  const auto addr = resolve(node);
  if (!addr) {
    throw slurm_env_error(fmt::format(
        "cannot resolve this task's node name '{}' (SLURMD_NODENAME) to an address: make the "
        "node names resolve (DNS or /etc/hosts), or run the whole job on one host with "
        "cluster.host = 127.0.0.1",
        node));
  }
  return *addr;
}

// Why the job cannot go on once srun has ended before it: srun's own words, and a hint.
std::string slurm_step_ended_text(const engine::job_config& job, const slurm_step& step,
                                  const std::string& how) {
  const std::string tail = step.output_tail();
  std::string hint;
  if (tail.find("Invalid partition") != std::string::npos) {
    hint = job.slurm_partition.empty()
               ? std::string(
                     "the partition srun was given (SLURM_PARTITION, or the cluster's "
                     "default) is not one of this cluster (`sinfo -s` lists them)\n")
               : fmt::format(
                     "cluster.slurm_partition = '{}' is not a partition of this cluster "
                     "(`sinfo -s` lists them)\n",
                     job.slurm_partition);
  } else if (tail.find("More processors requested than permitted") != std::string::npos ||
             tail.find("Requested node configuration is not available") != std::string::npos ||
             tail.find("Unable to allocate resources") != std::string::npos) {
    hint = fmt::format(
        "too few Slurm tasks or nodes for pp={} x dp={} workers + {} spare(s) = {} "
        "tasks{}: ask sbatch/salloc for more (-n, -N), or lower cluster.spares or "
        "cluster.slurm_nodes\n",
        job.pp, job.dp, job.spares, job.workers() + job.spares,
        job.slurm_nodes > 0 ? fmt::format(" on {} nodes", job.slurm_nodes) : "");
  }
  return fmt::format("the Slurm step ended before the job did (srun {}); it said:\n{}{}", how, tail,
                     hint);
}

void requeue_slurm_job(std::uint64_t window) {
  const char* id = std::getenv("SLURM_JOB_ID");
  if (id == nullptr) {
    std::cerr << "moevement launch: --requeue: not inside a Slurm job (SLURM_JOB_ID is unset): "
                 "nothing requeued; `moevement launch CONFIG --resume` goes on\n";
    return;
  }
  // Slurm ends this job's processes as it requeues it: everything is said and flushed first.
  std::cout << fmt::format(
                   "moevement launch: requeueing Slurm job {}: when it starts again it resumes "
                   "from window {}\n",
                   id, window)
            << std::flush;
  const auto [status, said] = run_capturing({"scontrol", "requeue", id});
  if (status != 0) {
    std::cerr << fmt::format(
        "moevement launch: `scontrol requeue {}` failed: {}(submit the job with sbatch --requeue, "
        "as `moevement launch --sbatch` does; or run `moevement launch CONFIG --resume`)\n",
        id, said);
  }
}

int submit_with_sbatch(const engine::job_config& job, const std::string& config_path,
                       const std::vector<std::string>& overrides,
                       const std::vector<std::string>& sbatch_args) {
  namespace fs = std::filesystem;
  if (job.backend != "slurm") {
    std::cerr << "moevement launch: --sbatch needs cluster.backend = \"slurm\" (add --set "
                 "cluster.backend=slurm)\n";
    return 2;
  }
  if (!on_path("sbatch")) {
    std::cerr << "moevement launch: --sbatch but sbatch is not on PATH: run this on a Slurm "
                 "login node\n";
    return 1;
  }
  const std::string self = fs::read_symlink("/proc/self/exe").string();
  const std::string base = fs::absolute(run_log_base(job.run_log)).string();
  // With a durable journal to resume from, the job is requeued instead of lost at its time
  // limit (policy moevement with the durable tier).
  const bool requeueable =
      job.policy == engine::policy_kind::moevement && engine::durable_tier(job);
  const std::string script = base + ".sbatch.sh", output = base + ".sbatch.out";
  {
    std::string head = shell_quote(self) + " launch " + shell_quote(fs::absolute(config_path));
    for (const auto& o : overrides) head += " --set " + shell_quote(o);
    if (requeueable) head += " --requeue";
    std::ofstream out(script, std::ios::trunc);
    out << "#!/bin/bash\n"
           "# Written by `moevement launch --sbatch` (docs/slurm.md): the head of the job, inside "
           "its\n# allocation; it starts the workers as one srun step.\n"
        << (job.standby_head ? batch_script_with_standby(head, fs::absolute(job.run_log).string())
                             : "exec " + head + "\n");
    if (!out) {
      std::cerr << "moevement launch: cannot write the batch script " << script << "\n";
      return 1;
    }
  }
  std::vector<std::string> argv{"sbatch", "--parsable", "--job-name=moevement",
                                fmt::format("--ntasks={}", job.workers() + job.spares),
                                "--output=" + output};
  if (job.slurm_nodes > 0) {
    argv.push_back(fmt::format("--nodes={}", job.slurm_nodes));
    argv.push_back(spread_tasks(job));
  }
  if (requeueable) {
    // Before a time limit or a preemption Slurm signals the head, which stops at its next
    // durable window and requeues the job; the output of every run goes to the one file.
    argv.insert(argv.end(), {"--requeue", fmt::format("--signal=B:USR1@{}", requeue_signal_s),
                             "--open-mode=append"});
  }
  if (!job.slurm_partition.empty()) argv.push_back("--partition=" + job.slurm_partition);
  argv.insert(argv.end(), sbatch_args.begin(), sbatch_args.end());
  argv.push_back(script);
  const auto [status, said] = run_capturing(argv);
  std::string id = said;
  while (!id.empty() && (id.back() == '\n' || id.back() == '\r')) id.pop_back();
  if (status != 0 || id.empty() || id.find_first_not_of("0123456789;") != std::string::npos) {
    std::cerr << "moevement launch: sbatch failed (" << fmt::format("{}", fmt::join(argv, " "))
              << "):\n"
              << said;
    if (said.find("Invalid partition") != std::string::npos) {
      // The partition is the key's, or one given to sbatch after `--`.
      std::cerr << (job.slurm_partition.empty()
                        ? std::string("a partition given to sbatch is not one of this cluster")
                        : fmt::format("cluster.slurm_partition = '{}' is not a partition of this "
                                      "cluster",
                                      job.slurm_partition))
                << " (`sinfo -s` lists them)\n";
    }
    return 1;
  }
  id = id.substr(0, id.find(';'));  // "id;cluster" on federated clusters
  std::cout << fmt::format(
      "submitted Slurm job {} ({} tasks): the head's output (progress, state_hash): {}\n"
      "run log: {}\nSlurm step output (each task's stdout and stderr): {}\n"
      "batch script: {}\n",
      id, job.workers() + job.spares, output, job.run_log, slurm_output_path(job.run_log), script);
  return 0;
}

}  // namespace moevement::launcher
