// `moevement bench collectives [--config FILE] [--presets tiny,small] [--dp D]
//                              [--iterations N] [--repeats R]`: the data-parallel gradient sum
// of GPU stages through NCCL against the host path, in the same run, on the same GPU.
//   iteration_s_PRESET: ours = `moevement launch` with train.collectives = auto (NCCL),
//                       theirs = the same with host; ratio = theirs / ours (better-is-higher);
//                       device_sum_s is NCCL's share (the run log's mean)
//   nccl_recovery_PRESET: a replica killed at iteration 6 (policy moevement): the survivors'
//                       group abort (recovery_end group_abort_s), the new group's forming
//                       (group_form_s of the re-run iteration), the first forming at the start
// Every run of a preset must end in the same state_hash, or the bench exits 1. Means over
// iterations 3.. of each run (the first ones form the groups and warm cuBLAS), medians over
// the repeats. Needs a GPU; exits 1 saying so without one.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/launch_job.hpp"
#include "bench/run_log_stats.hpp"

namespace fs = std::filesystem;
using namespace moevement::bench;

namespace {

struct options {
  std::string config = "examples/configs/tiny.toml";
  std::vector<std::string> presets = {"tiny", "small"};
  int dp = 2, iterations = 12, repeats = 3;
};

options parse_options(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
      return argv[++i];
    };
    if (a == "--config") {
      o.config = value();
    } else if (a == "--presets") {
      o.presets.clear();
      std::string list = value();
      for (std::size_t at = 0; at <= list.size();) {
        const auto comma = std::min(list.find(',', at), list.size());
        if (comma > at) o.presets.push_back(list.substr(at, comma - at));
        at = comma + 1;
      }
    } else if (a == "--dp") {
      o.dp = std::stoi(value());
    } else if (a == "--iterations") {
      o.iterations = std::stoi(value());
    } else if (a == "--repeats") {
      o.repeats = std::stoi(value());
    } else {
      throw std::invalid_argument("unknown option " + a +
                                  " (--config, --presets, --dp, --iterations, --repeats)");
    }
  }
  if (o.dp < 2 || o.iterations < 8 || o.repeats < 1 || o.presets.empty()) {
    throw std::invalid_argument("needs --dp >= 2, --iterations >= 8, --repeats >= 1, a preset");
  }
  return o;
}

struct measured {
  double iteration_s = 0, device_sum_s = 0, first_form_s = 0, reform_s = 0, abort_s = -1;
  std::string hash;
};

measured measure(const std::vector<stamped>& log) {
  measured m;
  std::vector<double> it, sum;
  for (const auto& l : log) {
    if (is_event(l.line, "recovery_end")) m.abort_s = number(l.line, "group_abort_s");
    if (l.line.find("\"kind\":\"iteration\"") == std::string::npos) continue;
    const long i = long(number(l.line, "iteration"));
    const double form = std::max(number(l.line, "group_form_s"), 0.0);
    if (i == 0) m.first_form_s = form;
    if (i > 0) m.reform_s = std::max(m.reform_s, form);
    if (i < 3) continue;
    it.push_back(number(l.line, "iteration_s"));
    sum.push_back(std::max(number(l.line, "device_sum_s"), 0.0));
  }
  m.iteration_s = mean(it);
  m.device_sum_s = mean(sum);
  m.hash = parse(log).state_hash;
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse_options(argc, argv);
    const auto bin = moevement_binary();
    const fs::path log = bench_log("collectives");
    auto run = [&](const std::string& preset, const std::string& collectives,
                   const std::string& inject) {
      std::vector<std::string> a{"launch", o.config};
      for (const std::string& kv :
           {fmt::format("model.preset={}", preset), std::string("train.device=cuda"),
            std::string("parallel.pp=1"), fmt::format("parallel.dp={}", o.dp),
            fmt::format("train.iterations={}", o.iterations), std::string("train.val_batches=0"),
            "train.collectives=" + collectives, "engine.run_log=" + log.string()}) {
        a.push_back("--set");
        a.push_back(kv);
      }
      if (!inject.empty()) {
        for (const char* kv : {"checkpoint.policy=moevement", "checkpoint.w_sparse=2",
                               "cluster.spares=1", "cluster.failure_timeout_ms=3000"}) {
          a.push_back("--set");
          a.push_back(kv);
        }
        a.push_back("--inject");
        a.push_back(inject);
      }
      return measure(launch_or_throw(bin, a, log));
    };
    std::printf("# collectives: dp=%d pp=1 on one GPU, %d iterations, medians of %d runs\n", o.dp,
                o.iterations, o.repeats);
    bool equal = true;
    for (const auto& preset : o.presets) {
      std::vector<double> nccl, host, sum;
      std::string fault_free;
      for (int r = 0; r < o.repeats; ++r) {  // interleaved: drift hits both alike
        const measured a = run(preset, "auto", "");
        fault_free = a.hash;
        const measured h = run(preset, "host", "");
        equal = equal && !a.hash.empty() && a.hash == h.hash;
        nccl.push_back(a.iteration_s);
        host.push_back(h.iteration_s);
        sum.push_back(a.device_sum_s);
      }
      std::printf("iteration_s_%s: ours=%.4f theirs=%.4f ratio=%.2f device_sum_s=%.4f\n",
                  preset.c_str(), median(nccl), median(host), median(host) / median(nccl),
                  median(sum));
      const measured k = run(preset, "auto", "kill:stage=0,replica=1,iter=6");
      equal = equal && k.hash == fault_free;
      std::printf(
          "nccl_recovery_%s: first_form_s=%.3f abort_s=%.3f reform_s=%.3f "
          "state_hash_equal=%s\n",
          preset.c_str(), k.first_form_s, k.abort_s, k.reform_s,
          k.hash == fault_free ? "yes" : "NO");
    }
    fs::remove(log);
    std::printf("state_hash NCCL == host == after the recovery: %s\n", equal ? "yes" : "NO");
    return equal ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "moevement bench collectives: %s\n", e.what());
    return 1;
  }
}
