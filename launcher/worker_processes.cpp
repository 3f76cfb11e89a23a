#include "launcher/worker_processes.hpp"

#include <fmt/format.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <fstream>
#include <iterator>
#include <stdexcept>

#include "launcher/exec_child.hpp"

namespace moevement::launcher {

std::string exit_text(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with status {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    return fmt::format("was killed by signal {} ({})", sig, ::strsignal(sig));
  }
  return "stopped";
}

// Starts `self worker ...` in its own process group, dying with us.
void worker_processes::start(const std::string& self, const std::vector<std::string>& args,
                             transport::node_id node, bool outlive_head,
                             const std::vector<int>& keep) {
  std::vector<char*> argv;
  argv.push_back(const_cast<char*>(self.c_str()));
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  child_environment env("MOEVEMENT_JOB_TOKEN", token_);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error(std::string("fork failed: ") + std::strerror(errno));
  if (pid == 0) {
    ::setpgid(0, 0);  // Ctrl-C goes to the head only; the head stops the workers
    if (!outlive_head) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != parent) ::_exit(1);  // the head died before prctl took effect
    }
    // The kept ones to 3, 4, ... (through copies above any of them: one may be where another
    // goes), open across exec; every other one closed.
    for (std::size_t i = 0; i < keep.size(); ++i) {
      if (::dup2(keep[i], 1000 + int(i)) < 0) ::_exit(126);
    }
    for (std::size_t i = 0; i < keep.size(); ++i) ::dup2(1000 + int(i), 3 + int(i));
    close_inherited_fds(3 + int(keep.size()));  // not the head's listeners (UCX opens them
                                                // without close-on-exec)
    ::execve(self.c_str(), argv.data(), env.get());
    ::_exit(127);
  }
  children_[pid] = node;
  ended_.erase(node);
}

void worker_processes::reap_exited(
    const std::function<void(transport::node_id, pid_t, int)>& on_exit) {
  int status = 0;
  pid_t pid;
  while ((pid = ::waitpid(-1, &status, WNOHANG)) > 0) {
    auto it = children_.find(pid);
    if (it == children_.end()) continue;
    const transport::node_id n = it->second;
    children_.erase(it);
    killed_.erase(pid);  // a pid the system may give another child later
    ended_[n] = status;
    on_exit(n, pid, status);
  }
}

worker_processes::child_end worker_processes::end_of(transport::node_id node) {
  if (auto e = ended_.find(node); e != ended_.end()) return {true, e->second};
  for (const auto& [pid, n] : children_) {
    if (n != node) continue;
    // Looked at, not reaped (WNOWAIT): reap_exited still hears of it, and says so.
    siginfo_t info{};
    if (::waitid(P_PID, id_t(pid), &info, WEXITED | WNOHANG | WNOWAIT) != 0 || info.si_pid != pid) {
      return {true, std::nullopt};
    }
    const int code = info.si_status & 0xff;
    const int status = info.si_code == CLD_EXITED   ? code << 8
                       : info.si_code == CLD_DUMPED ? code | 0x80
                                                    : code;
    return {true, status};
  }
  return {};
}

void worker_processes::kill_node(transport::node_id node, int pid) {
  for (const auto& [p, n] : children_) {
    if (n == node && p == pid) {
      ::kill(pid, SIGKILL);
      killed_.insert(pid);
    }
  }
}

void worker_processes::kill_child_of(transport::node_id node) {
  for (const auto& [p, n] : children_) {
    if (n == node) kill_node(node, p);
  }
}

void worker_processes::kill_worker(transport::node_id node, int pid, const std::string& head) {
  if (pid <= 1) return;
  std::ifstream in("/proc/" + std::to_string(pid) + "/cmdline", std::ios::binary);
  const std::string cmd((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // argv is NUL-separated: "...\0worker\0...\0--node\0N\0..."
  const std::string node_arg = std::string("\0--node\0", 8) + std::to_string(node) + '\0';
  const std::string head_arg = std::string("\0--head\0", 8) + head + '\0';
  if (cmd.find(std::string("\0worker\0", 8)) == std::string::npos ||
      cmd.find(node_arg) == std::string::npos || cmd.find(head_arg) == std::string::npos) {
    return;
  }
  ::kill(pid, SIGKILL);
}

void worker_processes::reap(std::chrono::milliseconds within, std::vector<std::string>* bad) {
  const auto until = std::chrono::steady_clock::now() + within;
  while (!children_.empty() && std::chrono::steady_clock::now() < until) {
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      const auto it = children_.find(pid);
      if (bad != nullptr && it != children_.end() && it->second != 0 && !killed_.contains(pid) &&
          !(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
        bad->push_back(fmt::format("worker {} (pid {}) {} while shutting down", it->second, pid,
                                   exit_text(status)));
      }
      children_.erase(pid);
      killed_.erase(pid);
    } else if (pid < 0 && errno == ECHILD) {
      children_.clear();
    } else {
      ::usleep(10000);
    }
  }
}

std::vector<std::string> worker_processes::end_all(std::chrono::milliseconds grace) {
  std::vector<std::string> bad;
  reap(grace, &bad);
  for (const auto& [pid, n] : children_) ::kill(pid, SIGTERM);
  reap(std::chrono::milliseconds(2000), nullptr);
  for (const auto& [pid, n] : children_) ::kill(pid, SIGKILL);
  reap(std::chrono::milliseconds(2000), nullptr);
  return bad;
}

}  // namespace moevement::launcher
