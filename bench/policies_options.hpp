// `moevement bench policies`' (and `bench recovery`'s) options (the opening comment of
// policies_bench.cpp lists them) and their parsing.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace moevement::bench::policies {

namespace fs = std::filesystem;

struct options {
  std::string config = "examples/configs/pipeline_tiny.toml";
  std::vector<std::string> sets;
  int repeats = 3, iterations = 40, pp = 3, dp = 1, spares = 1, w_sparse = 0;
  int kill_iter = -1, kill_stage = -1;
  std::vector<int> kill_iters;  // bench recovery --kill-iters: a trace of several kills
  std::vector<int> dps;         // bench recovery --dp 1,2,4: the same kill at each dp
  int joint = 0;                // bench recovery --joint K: K contiguous stages killed together
  bool spread = false;          // bench recovery --spread: spread_replay true against false
  bool matrix = false;          // bench policies --matrix: the fault-free part per placement
  bool verify = false;          // bench policies --verify: the silent-corruption checks' cost
  int load = 0;                 // --load N: N busy processes beside the job
  bool recovery = true, fault_free_compare = true, durable = false;
  double mtbf = 0;  // bench recovery: checkpoint.mtbf_s of the baselines (0: the run's wall time)
  std::string profile_out;
};

// "1,2,4": positive integers, comma-separated; anything else throws `what`.
inline std::vector<int> positive_list(const std::string& list, const char* what) {
  std::vector<int> out;
  for (std::size_t at = 0; at <= list.size();) {
    const std::size_t end = std::min(list.find(',', at), list.size());
    const int v = std::atoi(list.substr(at, end - at).c_str());
    if (v < 1) throw std::runtime_error(what);
    out.push_back(v);
    at = end + 1;
  }
  return out;
}

inline options parse_options(int argc, char** argv) {
  options o;
  const std::string self = fs::path(argv[0]).filename().string();
  if (self == "bench_recovery") o.fault_free_compare = false;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(f + " needs a value");
      return argv[++i];
    };
    if (f == "--config")
      o.config = value();
    else if (f == "--set")
      o.sets.push_back(value());
    else if (f == "--repeats")
      o.repeats = std::atoi(value().c_str());
    else if (f == "--iterations")
      o.iterations = std::atoi(value().c_str());
    else if (f == "--pp")
      o.pp = std::atoi(value().c_str());
    else if (f == "--dp") {
      o.dps = positive_list(value(), "--dp: replicas >= 1, comma-separated");
      o.dp = o.dps.front();
    } else if (f == "--spares")
      o.spares = std::atoi(value().c_str());
    else if (f == "--w-sparse")
      o.w_sparse = std::atoi(value().c_str());
    else if (f == "--kill-iter")
      o.kill_iter = std::atoi(value().c_str());
    else if (f == "--kill-iters") {
      o.kill_iters = positive_list(value(), "--kill-iters: iterations >= 1, comma-separated");
    } else if (f == "--kill-stage")
      o.kill_stage = std::atoi(value().c_str());
    else if (f == "--joint")
      o.joint = std::atoi(value().c_str());
    else if (f == "--spread")
      o.spread = true;
    else if (f == "--matrix")
      o.matrix = true;
    else if (f == "--verify")
      o.verify = true;
    else if (f == "--load")
      o.load = std::atoi(value().c_str());
    else if (f == "--no-recovery")
      o.recovery = false;
    else if (f == "--durable")
      o.durable = true;
    else if (f == "--mtbf")
      o.mtbf = std::atof(value().c_str());
    else if (f == "--profile-out")
      o.profile_out = value();
    else
      throw std::runtime_error("unknown option " + f + " (see bench/policies_bench.cpp)");
  }
  if (o.load < 0 || o.load > 64) throw std::runtime_error("--load N: 0 <= N <= 64");
  if (o.matrix && !o.fault_free_compare)
    throw std::runtime_error("--matrix is for `bench policies`");
  if (o.repeats < 1 || o.iterations < 2 || o.pp < 1 || o.dp < 1) {
    throw std::runtime_error("--repeats >= 1, --iterations >= 2, --pp >= 1, --dp >= 1");
  }
  if (o.dps.size() > 1 && (o.fault_free_compare || !o.kill_iters.empty())) {
    throw std::runtime_error("--dp with several values is for `bench recovery` with one kill");
  }
  if (o.kill_iter < 0) o.kill_iter = std::max(1, 2 * o.iterations / 3);
  if (o.kill_stage < 0) o.kill_stage = o.pp / 2;
  if (o.joint != 0) {
    if (o.fault_free_compare || o.dps.size() > 1 || !o.kill_iters.empty()) {
      throw std::runtime_error("--joint is for `bench recovery` with one dp and one kill");
    }
    if (o.joint < 2) throw std::runtime_error("--joint K: K >= 2 contiguous stages");
    o.kill_stage = std::min(o.kill_stage, o.pp - o.joint);
    if (o.kill_stage < 0) throw std::runtime_error("--joint K: K stages need --pp >= K");
    o.spares = std::max(o.spares, o.joint);
  }
  if (o.spread && (o.fault_free_compare || o.dps.size() > 1 || !o.kill_iters.empty() ||
                   o.joint != 0 || o.dp < 2)) {
    throw std::runtime_error("--spread is for `bench recovery` with one dp > 1 and one kill");
  }
  std::sort(o.kill_iters.begin(), o.kill_iters.end());
  if (!o.kill_iters.empty() && o.kill_iters.back() >= o.iterations) {
    throw std::runtime_error("--kill-iters: every iteration below --iterations");
  }
  // Every kill takes a spare (the replacement of the previous kill is the next one's victim).
  o.spares = std::max(o.spares, int(o.kill_iters.size()));
  if (o.recovery && o.spares < 1) throw std::runtime_error("the recovery part needs --spares >= 1");
  return o;
}

}  // namespace moevement::bench::policies
