// A real local Slurm cluster for tests: scripts/slurm-local brings up munged, slurmctld and
// N slurmd (nodes n1..nN) under a temporary directory, and takes them down again. A watchdog
// owned by this process takes them down if the test dies without doing it (crash, timeout).
// Commands run in their own process group with a deadline, so a hung srun fails the test
// instead of hanging it.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace moevement::testing {

struct command_result {
  int exit_code = -1;  // -1 when it did not exit normally
  int signal = 0;      // the signal that ended it, if any
  bool timed_out = false;
  double seconds = 0;  // wall-clock time it ran
  std::string output;  // stdout and stderr together
};

// Runs `bash -c command` in a new process group; kills the group with SIGKILL at the
// deadline. `env` entries are NAME=VALUE pairs added to (or replacing in) our environment.
inline command_result run_command(const std::string& command, double timeout_s,
                                  const std::vector<std::string>& env = {}) {
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
  const auto start = std::chrono::steady_clock::now();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::setpgid(0, 0);
    ::dup2(fds[1], 1);
    ::dup2(fds[1], 2);
    const int null = ::open("/dev/null", O_RDONLY);
    if (null >= 0) ::dup2(null, 0);
    for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
    ::execl("/bin/bash", "bash", "-c", command.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also here: no race with the kill below
  ::close(fds[1]);
  command_result r;
  const auto deadline = start + std::chrono::duration<double>(timeout_s);
  char buf[4096];
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                          deadline - std::chrono::steady_clock::now())
                          .count();
    if (left <= 0) {
      r.timed_out = true;
      ::kill(-pid, SIGKILL);
      break;
    }
    pollfd p{fds[0], POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::min<long long>(left, 200))) <= 0) continue;
    const ssize_t n = ::read(fds[0], buf, sizeof buf);
    if (n <= 0) break;  // EOF: everything that held the pipe is gone
    r.output.append(buf, static_cast<std::size_t>(n));
  }
  ::close(fds[0]);
  int status = 0;
  // The leader may have exited while background children kept the pipe; reap it either way.
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  return r;
}

inline bool on_path(const std::string& program) {
  const char* path = std::getenv("PATH");
  std::string p = path ? path : "/usr/bin:/bin";
  p += ":/usr/sbin:/sbin";  // daemons live in sbin, which a user's PATH may lack
  std::size_t start = 0;
  while (start <= p.size()) {
    const auto colon = std::min(p.find(':', start), p.size());
    const auto dir = p.substr(start, colon - start);
    if (!dir.empty() && ::access((dir + "/" + program).c_str(), X_OK) == 0) return true;
    start = colon + 1;
  }
  return false;
}

class local_slurm {
 public:
  // Why Slurm tests cannot run here, or "" when they can.
  static std::string unavailable_reason() {
    for (const char* tool :
         {"srun", "sbatch", "sinfo", "munged", "mungekey", "slurmctld", "slurmd"}) {
      if (!on_path(tool)) {
        return std::string("'") + tool +
               "' is not installed (scripts/install-deps installs slurm-wlm and munge)";
      }
    }
    if (script().empty()) return "SLURM_LOCAL is not set (run the tests through meson test)";
    return "";
  }

  explicit local_slurm(int nodes) : nodes_(nodes) {
    const auto base = std::filesystem::temp_directory_path() / "moev-slurm-XXXXXX";
    std::string tmpl = base.string();
    if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
    dir_ = tmpl;
    const auto r = run_command(script() + " up " + dir_ + " " + std::to_string(nodes) +
                                   " --owner " + std::to_string(::getpid()),
                               90);
    if (r.exit_code != 0) {
      run_command(script() + " down " + dir_, 30);
      throw std::runtime_error("scripts/slurm-local up failed (exit " +
                               std::to_string(r.exit_code) + "):\n" + r.output);
    }
    conf_ = dir_ + "/slurm.conf";
    if (r.output.find("export SLURM_CONF=" + conf_) == std::string::npos) {
      throw std::runtime_error("slurm-local printed an unexpected environment:\n" + r.output);
    }
    for (const auto& entry : std::filesystem::directory_iterator(dir_ + "/run")) {
      if (entry.path().extension() != ".pid" || entry.path().stem() == "watchdog") continue;
      std::ifstream in(entry.path());
      int pid = 0;
      if (in >> pid && pid > 1) daemons_.push_back(pid);
    }
  }

  local_slurm(const local_slurm&) = delete;
  local_slurm& operator=(const local_slurm&) = delete;

  ~local_slurm() {
    try {
      stop();
    } catch (...) {
      // Destructors must not throw; the watchdog still takes the cluster down.
    }
    if (!keep_) {
      std::error_code ec;
      std::filesystem::remove_all(dir_, ec);
    }
  }

  // Takes the cluster down; returns slurm-local's output. Idempotent.
  std::string stop() {
    if (stopped_) return "";
    stopped_ = true;
    const auto r = run_command(script() + " down " + dir_, 60);
    if (r.exit_code != 0) throw std::runtime_error("slurm-local down failed:\n" + r.output);
    return r.output;
  }

  // Runs a command against this cluster: SLURM_CONF set, every other inherited SLURM_*
  // variable removed (the tests may themselves run inside a Slurm job).
  command_result run(const std::string& command, double timeout_s) const {
    return run_command(
        "unset $(compgen -e | grep '^SLURM_'); export SLURM_CONF=" + conf_ + "; " + command,
        timeout_s);
  }

  // Processes of this cluster still alive: its daemons as started, and any process whose
  // environment names its SLURM_CONF (slurmstepd, srun, tasks). Excludes this process.
  std::vector<int> processes() const {
    std::set<int> out;
    for (int pid : daemons_) {
      if (alive(pid)) out.insert(pid);
    }
    const std::string needle = "SLURM_CONF=" + conf_;
    for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
      const auto name = entry.path().filename().string();
      if (name.find_first_not_of("0123456789") != std::string::npos) continue;
      const int pid = std::stoi(name);
      if (pid == ::getpid()) continue;
      std::ifstream in(entry.path() / "environ", std::ios::binary);
      std::string env((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      std::size_t start = 0;
      while (start < env.size()) {
        auto end = env.find('\0', start);
        if (end == std::string::npos) end = env.size();
        if (env.compare(start, end - start, needle) == 0) {
          if (alive(pid)) out.insert(pid);
          break;
        }
        start = end + 1;
      }
    }
    return {out.begin(), out.end()};
  }

  // Whether pid is a live process (a zombie waiting for PID 1 to reap it is not).
  static bool alive(int pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
    std::string stat((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    const auto paren = stat.rfind(')');
    return paren != std::string::npos && paren + 2 < stat.size() && stat[paren + 2] != 'Z';
  }

  // The command name of a pid ("" if gone), for messages.
  static std::string comm(int pid) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/comm");
    std::string c;
    std::getline(in, c);
    return c;
  }

  // The last lines of the daemons' logs, for failure messages.
  std::string logs() const {
    return run_command("tail -n 20 " + dir_ + "/log/*.log 2>&1", 10).output;
  }

  const std::string& dir() const { return dir_; }
  const std::string& conf() const { return conf_; }
  int nodes() const { return nodes_; }
  const std::vector<int>& daemons() const { return daemons_; }
  void keep_directory() { keep_ = true; }

 private:
  static std::string script() {
    const char* s = std::getenv("SLURM_LOCAL");
    return s ? s : "";
  }

  int nodes_;
  std::string dir_, conf_;
  std::vector<int> daemons_;
  bool stopped_ = false;
  bool keep_ = false;
};

}  // namespace moevement::testing
