// `moevement launch` as tests drive it: a job in the background whose workers are found
// through its run log, and readers of its output and run log.
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace moevement::test_support {

using namespace std::chrono_literals;

// A run log path private to this test process.
inline std::string log_path(const std::string& name) {
  return ::testing::TempDir() + "launch_" + std::to_string(::getpid()) + "_" + name + ".jsonl";
}

inline std::string hash_of(const std::string& out) {
  const std::string tag = "state_hash=";
  const auto at = out.rfind(tag);
  if (at == std::string::npos || (at != 0 && out[at - 1] != '\n')) return "";
  const std::string rest = out.substr(at + tag.size());
  if (rest.size() != 17 || rest.back() != '\n') return "";
  return rest.substr(0, 16);
}

inline std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// The number after "key": in a JSON line (our run log writes flat objects).
inline double number_field(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":");
  if (at == std::string::npos) return -1;
  return std::strtod(line.c_str() + at + key.size() + 3, nullptr);
}

// Every process of the tree under `root` (its children through /proc/PID/task/TID/children).
inline std::vector<pid_t> process_tree(pid_t root) {
  std::vector<pid_t> out{root};
  for (std::size_t i = 0; i < out.size(); ++i) {
    std::error_code ec;
    const std::string tasks = "/proc/" + std::to_string(out[i]) + "/task";
    for (const auto& t : std::filesystem::directory_iterator(tasks, ec)) {
      std::ifstream in(t.path() / "children");
      for (pid_t c; in >> c;) out.push_back(c);
    }
  }
  return out;
}

// What a hung job's processes were doing, on stderr (the test's log); then they are killed. For
// each: its command line, its threads' kernel wait channels, and their stacks through gdb where
// it is installed. Every process is stopped first: one held by the debugger would otherwise be
// lost to its peers' heartbeats, and the others would move on.
inline std::string stacks_of(pid_t root) {
  std::cerr << "---- the job hung; its processes:\n";
  auto tree = process_tree(root);
  std::vector<std::string> wchans;
  for (pid_t p : tree) {
    std::string w;
    std::error_code ec;
    const std::string tasks = "/proc/" + std::to_string(p) + "/task";
    for (const auto& t : std::filesystem::directory_iterator(tasks, ec)) {
      std::string one;
      std::ifstream(t.path() / "wchan") >> one;
      w += " " + t.path().filename().string() + ":" + (one.empty() ? "running" : one);
    }
    wchans.push_back(w);
  }
  for (pid_t p : tree) ::kill(p, SIGSTOP);
  // Workers first, the head last; each printed as it is read (a test's time limit may come
  // first), and stopped again after gdb (which may let it run on when it detaches).
  for (std::size_t i = tree.size(); i-- > 0;) {
    const std::string pid = std::to_string(tree[i]);
    std::ifstream cmd("/proc/" + pid + "/cmdline");
    std::string out, args, arg;
    while (std::getline(cmd, arg, '\0')) args += " " + arg;
    out += "pid " + pid + ":" + args + "\n  threads waiting in:" + wchans[i] + "\n";
    const std::string gdb =
        "timeout 30 gdb -p " + pid + " -batch -ex 'thread apply all bt 12' 2>&1";
    if (std::FILE* f = ::popen(gdb.c_str(), "r")) {
      std::array<char, 1024> buf;
      while (std::fgets(buf.data(), int(buf.size()), f) != nullptr) {
        std::string l = buf.data();
        if (l.starts_with("Thread ")) out += l.substr(0, l.find(" (")) + "\n";
        if (!l.starts_with("#")) continue;
        // "#3  0x... in name (arguments) at file:line": the frame's number and name only
        const auto in = l.find(" in ");
        const auto name = in != std::string::npos ? in + 4 : l.find_first_not_of(' ', 2);
        out += "  " + l.substr(0, l.find(' ')) + " " + l.substr(name, l.find(" (", name) - name) +
               "\n";
      }
      ::pclose(f);
    }
    ::kill(tree[i], SIGSTOP);
    std::cerr << out << std::flush;
  }
  for (pid_t p : tree) ::kill(p, SIGKILL);
  return "(the stacks are above)\n";
}

struct background_launch {
  pid_t pid = -1;
  std::string out_path, log;

  // args: what follows `moevement launch` (config, --set, --inject); the run log is added.
  background_launch(const std::string& name, const std::string& args) {
    out_path = log_path(name) + ".out";
    log = log_path(name);
    ::unlink(log.c_str());
    const std::string bin = std::getenv("MOEVEMENT_BIN");
    const std::string cmd = "exec " + bin + " launch " + args + " --set engine.run_log=" + log +
                            " > " + out_path + " 2>&1";
    pid = ::fork();
    if (pid == 0) {
      ::execl("/bin/sh", "sh", "-c", cmd.c_str(), nullptr);
      ::_exit(127);
    }
  }
  // Worker pids from the run log's worker_up events, once all `n` are up and training runs.
  // It waits past cluster.start_timeout_ms (30 s), so that a job that cannot start says why.
  std::vector<pid_t> wait_for_workers(std::size_t n) {
    const auto until = std::chrono::steady_clock::now() + 40s;
    while (std::chrono::steady_clock::now() < until) {
      std::vector<pid_t> pids;
      bool training = false;
      for (const auto& l : lines_of(log)) {
        if (l.find("\"event\":\"worker_up\"") != std::string::npos) {
          pids.push_back(pid_t(number_field(l, "pid")));
        }
        if (l.find("\"kind\":\"iteration\"") != std::string::npos) training = true;
      }
      if (pids.size() == n && training) return pids;
      if (::waitpid(pid, nullptr, WNOHANG) == pid) {  // the launch ended early
        pid = -1;
        return {};
      }
      std::this_thread::sleep_for(50ms);
    }
    std::cerr << stacks_of(pid) << last_words();
    return {};
  }
  // Exit status, or -1 if it had to be killed after `limit` (a hang: the test fails).
  int wait(std::chrono::seconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    int status = 0;
    while (std::chrono::steady_clock::now() < until) {
      if (::waitpid(pid, &status, WNOHANG) == pid) {
        pid = -1;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(20ms);
    }
    std::cerr << stacks_of(pid) << last_words();
    ::kill(pid, SIGKILL);
    ::waitpid(pid, &status, 0);
    pid = -1;
    return -1;
  }
  // A hung job's last output and run-log lines, printed after its stacks: meson shows only a
  // failed test's last 100 lines, and the test's own report of the output came before them.
  std::string last_words() const {
    const auto tail = [](const std::vector<std::string>& lines, std::size_t n) {
      std::string out;
      for (auto i = lines.size() > n ? lines.size() - n : 0; i < lines.size(); ++i) {
        out += "  " + lines[i].substr(0, 300) + "\n";
      }
      return out;
    };
    return "---- the job hung; the last of its output:\n" + tail(lines_of(out_path), 30) +
           "---- and of its run log:\n" + tail(lines_of(log), 15);
  }
  std::string output() const {
    std::ifstream in(out_path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  ~background_launch() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
    // The durable tier's default directory, beside the run log (checkpoint.dir unset).
    std::error_code ec;
    std::filesystem::remove_all(std::filesystem::path(log).replace_extension(".checkpoints"), ec);
  }
};

// Gone, or a zombie waiting for a reaper that is not ours.
inline bool process_gone(pid_t pid) {
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;
  std::string s;
  std::getline(stat, s);
  const auto close = s.rfind(')');
  return close != std::string::npos && close + 2 < s.size() && s[close + 2] == 'Z';
}

inline bool all_gone(const std::vector<pid_t>& pids) {
  // 30 s: a check that nothing hangs, not of speed (a worker notices its head's loss after
  // cluster.failure_timeout_ms, then shuts down, on a machine that may be loaded).
  for (int i = 0; i < 1500; ++i) {
    bool gone = true;
    for (pid_t p : pids) gone = gone && process_gone(p);
    if (gone) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

// A finished launch: its exit code, output, state_hash and run log, with readers of the run
// log's events.
struct launch_outcome {
  int exit_code = -1;
  std::string output, hash;
  std::vector<std::string> log;

  std::vector<const std::string*> events(const std::string& name) const {
    std::vector<const std::string*> out;
    for (const auto& l : log) {
      if (l.find("\"event\":\"" + name + "\"") != std::string::npos) out.push_back(&l);
    }
    return out;
  }
  const std::string* first(const std::string& name) const {
    const auto all = events(name);
    return all.empty() ? nullptr : all.front();
  }
  int count(const std::string& name) const { return int(events(name).size()); }
};

// Waits for the job (up to two minutes) and reads what it left.
inline launch_outcome finish(background_launch& j) {
  launch_outcome o;
  o.exit_code = j.wait(std::chrono::seconds(120));
  o.output = j.output();
  o.hash = hash_of(o.output);
  o.log = lines_of(j.log);
  return o;
}

inline launch_outcome launch(const std::string& name, const std::string& args) {
  background_launch j(name, args);
  return finish(j);
}

// Damages a file the job wrote: flips the bits of the byte at `offset` (false: not opened).
inline bool flip_byte(const std::string& path, std::streamoff offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  if (!f.good()) return false;
  f.seekg(offset);
  char c = 0;
  f.read(&c, 1);
  c = char(c ^ 0x5a);
  f.seekp(offset);
  f.write(&c, 1);
  return f.good();
}

}  // namespace moevement::test_support
