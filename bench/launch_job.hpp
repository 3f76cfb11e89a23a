// Running one `moevement launch` job as a subprocess for the benchmarks, with its run log read
// back as it is written (the run log has no timestamps on most records, so the bench polls it
// every 2 ms and stamps each line as it appears). Used by bench/policies_bench.cpp and
// bench/sim_validation_bench.cpp.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/run_log_stats.hpp"

extern char** environ;

namespace moevement::bench {

// The `moevement` binary of this build (beside bench/, in launcher/), as a benchmark finds it.
inline std::string moevement_binary() {
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  return (self.parent_path().parent_path() / "launcher" / "moevement").string();
}

// A run log path private to this benchmark process: TMPDIR/bench_NAME_PID.jsonl.
inline std::filesystem::path bench_log(const std::string& name) {
  return std::filesystem::temp_directory_path() /
         ("bench_" + name + "_" + std::to_string(::getpid()) + ".jsonl");
}

// The host's load averages (1, 5, 15 minutes), printed beside every figure.
inline std::string loadavg() {
  std::ifstream in("/proc/loadavg");
  std::string a, b, c;
  in >> a >> b >> c;
  return a + " " + b + " " + c;
}

// The shape of a benchmark's `moevement launch` run.
struct launch_shape {
  std::string config;
  int iterations = 40, pp = 2, dp = 1, spares = 0;
};

// `launch CONFIG` with the shape, no validation and a quiet console, then `sets` in order (a
// later one wins), the run log, and `injects` (each an --inject spec).
inline std::vector<std::string> launch_args(const launch_shape& shape,
                                            const std::vector<std::string>& sets,
                                            const std::filesystem::path& log,
                                            const std::vector<std::string>& injects = {}) {
  std::vector<std::string> a{"launch", shape.config};
  auto set = [&](const std::string& kv) {
    a.push_back("--set");
    a.push_back(kv);
  };
  set("train.iterations=" + std::to_string(shape.iterations));
  set("train.val_batches=0");
  set("train.log_every=1000000");
  set("parallel.pp=" + std::to_string(shape.pp));
  set("parallel.dp=" + std::to_string(shape.dp));
  set("cluster.spares=" + std::to_string(shape.spares));
  // On a loaded 2-core machine the default heartbeat silence was taken for a lost worker (a
  // false failure ends a `none` run); an injected kill is detected by the process's exit, not
  // by this timeout. A later --set overrides it.
  set("cluster.failure_timeout_ms=10000");
  for (const auto& s : sets) set(s);
  set("engine.run_log=" + log.string());
  for (const auto& inject : injects) {
    a.push_back("--inject");
    a.push_back(inject);
  }
  return a;
}

struct job_outcome {
  bool ok = false;
  bool killed = false;         // kill_when said so, and the process got SIGKILL
  double killed_at = 0;        // when (the run log's clock)
  std::string output;          // the job's stdout and stderr (kept when it failed)
  std::vector<stamped> lines;  // the run log, stamped
};

// Runs `bin args...` with its output in a file beside `log`; `log` must be the job's run log
// (engine.run_log). `on_poll` (optional) is called after each poll with its time stamp, to watch
// something else on the same clock; `kill_when` (optional), with the run log so far, says when to
// kill the process (SIGKILL, once); outlived: after that kill, the run log is read on until it
// ends (job_end, job_stopped or job_failed: another process, a standby head, carried the job on; at
// most 10 minutes). Throws only when the process cannot be started.
inline job_outcome launch_job(
    const std::string& bin, const std::vector<std::string>& args, const std::filesystem::path& log,
    const std::function<void(double)>& on_poll = {},
    const std::function<bool(const std::vector<stamped>&)>& kill_when = {}, bool outlived = false) {
  namespace fs = std::filesystem;
  using sclock = std::chrono::steady_clock;
  fs::remove(log);
  const fs::path out = fs::path(log).replace_extension(".out");
  std::vector<std::string> all{bin};
  all.insert(all.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : all) argv.push_back(a.data());
  argv.push_back(nullptr);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_addopen(&fa, 1, out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  posix_spawn_file_actions_adddup2(&fa, 1, 2);
  pid_t pid = 0;
  const int rc = ::posix_spawn(&pid, bin.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw std::runtime_error("cannot run " + bin);

  const auto t0 = sclock::now();
  job_outcome o;
  std::string partial;
  std::streamoff read = 0;
  auto poll = [&] {
    std::ifstream in(log, std::ios::binary);
    if (!in) return;
    in.seekg(read);
    std::string chunk((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    read += std::streamoff(chunk.size());
    const double t = std::chrono::duration<double>(sclock::now() - t0).count();
    partial += chunk;
    for (std::size_t nl; (nl = partial.find('\n')) != std::string::npos;) {
      o.lines.push_back({t, partial.substr(0, nl)});
      partial.erase(0, nl + 1);
    }
    if (on_poll) on_poll(t);
    if (kill_when && !o.killed && kill_when(o.lines)) {
      ::kill(pid, SIGKILL);
      o.killed = true;
      o.killed_at = t;
    }
  };
  auto ended = [&] {
    for (const auto& [t, l] : o.lines) {
      if (l.find("\"event\":\"job_end\"") != std::string::npos ||
          l.find("\"event\":\"job_failed\"") != std::string::npos ||
          l.find("\"event\":\"job_stopped\"") != std::string::npos) {
        return true;
      }
    }
    return false;
  };
  int status = 0;
  for (;;) {
    poll();
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid) break;
    if (w < 0) throw std::runtime_error("waitpid failed");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  poll();
  o.ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
  if (outlived && o.killed) {
    const auto until = sclock::now() + std::chrono::minutes(10);
    while (!ended() && sclock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      poll();
    }
    o.ok = ended();
    std::this_thread::sleep_for(std::chrono::milliseconds(500));  // its last lines of output
  }
  std::ifstream in(out);
  std::stringstream s;
  s << in.rdbuf();
  o.output = s.str();
  fs::remove(out);
  return o;
}

// The same, for a job that must succeed: its stamped run log, or an exception with the command
// line and the job's output.
inline std::vector<stamped> launch_or_throw(const std::string& bin,
                                            const std::vector<std::string>& args,
                                            const std::filesystem::path& log) {
  job_outcome o = launch_job(bin, args, log);
  if (!o.ok) {
    std::string cmd = bin;
    for (const auto& a : args) cmd += " " + a;
    throw std::runtime_error("failed: " + cmd + "\n" + o.output);
  }
  return std::move(o.lines);
}

}  // namespace moevement::bench
