// `moevement bench network [options]`: the same `moevement launch` job on a clean loopback and
// on a faulty one, each inside a network namespace of its own (`unshare -n`: only its own
// loopback), with UCX on TCP (UCX_TLS=tcp, so that every byte crosses the faulty device):
//   clean  nothing done to `lo`;
//   loss   nftables drops --loss-permille of every 1000 TCP packets at random (default 5:
//          0.5%), both directions;
//   rate   `tc qdisc add dev lo root tbf rate --rate burst 64kb latency 50ms` (default
//          50mbit) with an Ethernet MTU (1500) on `lo`: a slow link that drops what overflows
//          its queue.
// In each, --repeats rounds (default 2) of three runs: fault-free, a kill of stage 1 replica 0
// at --kill-iter, and a hang of it (SIGSTOP: found by the heartbeats only). Per condition,
// medians, ours = under the fault, theirs = clean (ratio theirs/ours: 1 = the fault cost
// nothing):
//   wall_s      the fault-free run's wall time (the run log's job_end);
//   recoveries  recovery_start events of the fault-free runs, all of them added up (a false
//               suspicion costs one);
//   detect_s    worker_lost time_s - inject time_s, of the kill and of the hang;
//   plus whether every run ended with `moevement train`'s state_hash.
// Options: --config FILE (default examples/configs/tiny.toml), --set KEY=VALUE (repeatable),
// --iterations N (default 24), --repeats N, --kill-iter T (default iterations / 2),
// --loss-permille N, --rate R. The job: pp 2, dp 2, one spare, policy moevement, W 2.
// Needs root, unshare, ip, nft and tc (util-linux, iproute2, nftables); says so otherwise.
// Run from the source root.
#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/launch_job.hpp"
#include "bench/run_log_stats.hpp"

namespace {

namespace fs = std::filesystem;
using moevement::bench::number;

struct options {
  std::string config = "examples/configs/tiny.toml";
  std::vector<std::string> sets;
  int iterations = 24, repeats = 2, kill_iter = -1, loss_permille = 5;
  std::string rate = "50mbit";
};

options parse_options(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(f + " needs a value");
      return argv[++i];
    };
    if (f == "--config") {
      o.config = value();
    } else if (f == "--set") {
      o.sets.push_back(value());
    } else if (f == "--iterations") {
      o.iterations = std::atoi(value().c_str());
    } else if (f == "--repeats") {
      o.repeats = std::atoi(value().c_str());
    } else if (f == "--kill-iter") {
      o.kill_iter = std::atoi(value().c_str());
    } else if (f == "--loss-permille") {
      o.loss_permille = std::atoi(value().c_str());
    } else if (f == "--rate") {
      o.rate = value();
    } else {
      throw std::runtime_error("unknown option " + f + " (see bench/network_bench.cpp)");
    }
  }
  if (o.iterations < 4 || o.repeats < 1 || o.loss_permille < 0 || o.loss_permille > 1000) {
    throw std::runtime_error("--iterations >= 4, --repeats >= 1, --loss-permille 0..1000");
  }
  if (o.kill_iter < 0) o.kill_iter = o.iterations / 2;
  if (o.kill_iter < 1 || o.kill_iter >= o.iterations) {
    throw std::runtime_error("--kill-iter: between 1 and --iterations - 1");
  }
  for (const char c : o.rate) {
    if (!std::isalnum(static_cast<unsigned char>(c)))
      throw std::runtime_error("--rate: e.g. 50mbit");
  }
  return o;
}

struct shell_result {
  int exit_code = -1;
  std::string output;
};

shell_result shell(const std::string& cmd) {
  std::FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) return {};
  std::string out;
  char buf[4096];
  for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
  const int status = ::pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

std::string unavailable() {
  if (::geteuid() != 0) return "needs root (network namespaces with nftables and tc)";
  if (std::system("{ command -v unshare && command -v ip && command -v nft && command -v tc; } "
                  "> /dev/null 2>&1") != 0) {
    return "needs unshare, ip, nft and tc (util-linux, iproute2, nftables)";
  }
  if (std::system("unshare -n sh -c 'ip link set lo up && nft add table inet probe && tc qdisc "
                  "add dev lo root tbf rate 50mbit burst 64kb latency 50ms' > /dev/null 2>&1") !=
      0) {
    return "cannot make a network namespace with nftables rules and tc here";
  }
  return "";
}

// The shell lines that make `lo` faulty in `condition`.
std::string fault_setup(const options& o, const std::string& condition, const fs::path& base) {
  if (condition == "loss") {
    const fs::path rules = fs::path(base).replace_extension(".nft");
    std::ofstream(rules) << "table inet fault {\n  chain in {\n"
                         << "    type filter hook input priority 0;\n"
                         << "    meta l4proto tcp numgen random mod 1000 < " << o.loss_permille
                         << " counter drop\n  }\n}\n";
    return "nft -f " + rules.string() + " || exit 91\n";
  }
  if (condition == "rate") {
    // An Ethernet MTU: on lo's own (64 KiB) every full-size segment is larger than the 64 kB
    // burst, and tbf drops it every time it is sent again: a black hole, not a slow link.
    return "ip link set lo mtu 1500 || exit 92\ntc qdisc add dev lo root tbf rate " + o.rate +
           " burst 64kb latency 50ms || exit 92\n";
  }
  return "";
}

struct run {
  bool ok = false;
  std::string hash, output;
  std::vector<std::string> log;
  double wall = 0, detect = -1;
  int recoveries = 0;
};

// One `moevement launch` in a fresh namespace under `condition`, with `inject` (may be empty).
run launch(const options& o, const std::string& bin, const std::string& condition,
           const std::string& inject) {
  const fs::path log = moevement::bench::bench_log("network");
  fs::remove(log);
  std::string cmd = bin + " launch " + o.config +
                    fmt::format(
                        " --set train.iterations={} --set "
                        "train.seq_len=16 --set parallel.pp=2 --set "
                        "parallel.dp=2 --set cluster.spares=1 --set "
                        "checkpoint.policy=moevement --set "
                        "checkpoint.w_sparse=2 --set train.val_batches=0",
                        o.iterations);
  for (const auto& s : o.sets) cmd += " --set '" + s + "'";
  cmd += " --set engine.run_log=" + log.string();
  if (!inject.empty()) cmd += " --inject " + inject;
  const fs::path script = fs::path(log).replace_extension(".sh");
  std::ofstream(script) << "ip link set lo up || exit 90\n"
                        << fault_setup(o, condition, log) << "UCX_TLS=tcp exec " << cmd << "\n";
  const shell_result r = shell("unshare -n sh " + script.string());
  run out;
  out.output = r.output;
  out.ok = r.exit_code == 0;
  const auto at = r.output.rfind("state_hash=");
  if (at != std::string::npos) out.hash = r.output.substr(at + 11, 16);
  std::ifstream in(log);
  double injected = -1, lost = -1;
  for (std::string l; std::getline(in, l);) {
    const auto is = [&](const char* ev) {
      return l.find(fmt::format("\"event\":\"{}\"", ev)) != std::string::npos;
    };
    if (is("job_end")) out.wall = number(l, "wall_s");
    if (is("inject") && injected < 0) injected = number(l, "time_s");
    if (is("worker_lost") && lost < 0) lost = number(l, "time_s");
    if (is("recovery_start")) ++out.recoveries;
  }
  if (injected >= 0 && lost >= injected) out.detect = lost - injected;
  fs::remove(log);
  fs::remove(script);
  fs::remove(fs::path(log).replace_extension(".nft"));
  fs::remove_all(fs::path(log).replace_extension(".checkpoints"));
  return out;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

struct figures {
  std::vector<double> wall, recoveries, kill_detect, hang_detect;
  int runs = 0, equal = 0, failed = 0;
};

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse_options(argc, argv);
    if (const auto why = unavailable(); !why.empty()) {
      std::printf("# bench network skipped: %s\n", why.c_str());
      return 0;
    }
    const std::string bin = moevement::bench::moevement_binary();
    std::string args = o.config + fmt::format(
                                      " --set train.iterations={} --set train.seq_len=16 "
                                      "--set parallel.dp=2 --set train.val_batches=0",
                                      o.iterations);
    for (const auto& s : o.sets) args += " --set '" + s + "'";
    const shell_result ref = shell(bin + " train " + args);
    const auto at = ref.output.rfind("state_hash=");
    if (ref.exit_code != 0 || at == std::string::npos) {
      throw std::runtime_error("moevement train failed: " + ref.output);
    }
    const std::string want = ref.output.substr(at + 11, 16);
    std::printf(
        "# config %s pp=2 dp=2 spares=1 moevement W 2, %d iterations, UCX_TLS=tcp; loss "
        "%d/1000 TCP packets; rate %s; %d rounds; kill and hang of stage 1 replica 0 at "
        "iteration %d\n",
        o.config.c_str(), o.iterations, o.loss_permille, o.rate.c_str(), o.repeats, o.kill_iter);
    const std::vector<std::string> conditions{"clean", "loss", "rate"};
    std::map<std::string, figures> by;
    const std::string kill = fmt::format("kill:stage=1,replica=0,iter={}", o.kill_iter);
    const std::string hang = fmt::format("hang:stage=1,replica=0,iter={}", o.kill_iter);
    for (int r = 0; r < o.repeats; ++r) {
      for (const auto& c : conditions) {  // interleaved: the host's load drifts
        figures& f = by[c];
        for (const std::string& inject : {std::string(), kill, hang}) {
          const run x = launch(o, bin, c, inject);
          ++f.runs;
          f.equal += x.ok && x.hash == want;
          if (!x.ok) {
            ++f.failed;
            std::printf("# %s %s failed:\n%s\n", c.c_str(),
                        inject.empty() ? "fault-free" : inject.c_str(), x.output.c_str());
            continue;
          }
          if (inject.empty()) {
            f.wall.push_back(x.wall);
            f.recoveries.push_back(x.recoveries);
          } else if (x.detect >= 0) {
            (inject == kill ? f.kill_detect : f.hang_detect).push_back(x.detect);
          }
        }
      }
    }
    const figures& clean = by["clean"];
    for (const auto& c : conditions) {
      const figures& f = by[c];
      std::printf(
          "# %s: %d runs, %d failed, %d ended with train's state_hash; recoveries in the "
          "fault-free runs: %.0f\n",
          c.c_str(), f.runs, f.failed, f.equal,
          std::accumulate(f.recoveries.begin(), f.recoveries.end(), 0.0));
      if (c == "clean") continue;
      auto line = [&](const char* metric, const std::vector<double>& ours,
                      const std::vector<double>& theirs) {
        if (ours.empty() || theirs.empty()) {  // no run measured it (its event never came)
          std::printf("%s[%s]: n/a (%zu and %zu samples)\n", metric, c.c_str(), ours.size(),
                      theirs.size());
          return;
        }
        const double a = median(ours), b = median(theirs);
        std::printf("%s[%s]: ours=%.4f theirs=%.4f ratio=%.3f\n", metric, c.c_str(), a, b,
                    a > 0 ? b / a : 0.0);
      };
      line("wall_s", f.wall, clean.wall);
      line("kill_detect_s", f.kill_detect, clean.kill_detect);
      line("hang_detect_s", f.hang_detect, clean.hang_detect);
    }
    std::printf("clean: wall_s %.4f, kill_detect_s %.4f, hang_detect_s %.4f\n", median(clean.wall),
                median(clean.kill_detect), median(clean.hang_detect));
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench network: %s\n", e.what());
    return 1;
  }
}
