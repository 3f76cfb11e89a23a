// `moevement bench simvalidate`'s options (the opening comment of sim_validation_bench.cpp lists
// them) and their parsing.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace moevement::bench::simvalidate {

namespace fs = std::filesystem;

struct kill_at {
  int stage = 0;
  long iteration = 1;
};

struct options {
  std::string config = "examples/configs/pipeline_tiny.toml";
  std::vector<std::string> sets;
  int iterations = 48, pp = 3, dp = 1, spares = 2, repeats = 3;
  // Faulty runs per --failures SPEC and policy: one recovery in several takes 5-10x the others
  // on a loaded machine, so the comparison is also made on the medians over the repeats.
  int faulty_repeats = 3;
  std::string preset = "tiny";
  int micro_batches = 4, micro_batch_size = 4, seq_len = 32;
  std::vector<std::vector<kill_at>> failures;
  std::vector<std::string> policies{"moevement", "dense-memory", "dense-disk", "pec"};
  // The baselines' checkpoint.interval (0: the engine's Young choice). 10 puts every default
  // kill (iterations N/3, N/2, 2N/3 of 48 or 192) 2 or more iterations after a checkpoint, so
  // that which checkpoint a rollback finds depends on the persist lag, not on a race with it.
  int interval = 10;
  std::string profile_out, trace_out, keep_logs;
};

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string part; std::getline(in, part, sep);) {
    if (!part.empty()) out.push_back(part);
  }
  return out;
}

inline std::vector<kill_at> parse_failures(const std::string& spec) {
  std::vector<kill_at> out;
  for (const auto& one : split(spec, ',')) {
    const auto at = one.find('@');
    if (at == std::string::npos) throw std::runtime_error("--failures: expected STAGE@ITERATION");
    out.push_back({std::atoi(one.substr(0, at).c_str()), std::atol(one.substr(at + 1).c_str())});
  }
  if (out.empty()) throw std::runtime_error("--failures: empty");
  return out;
}

inline options parse_options(int argc, char** argv) {
  options o;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(f + " needs a value");
      return argv[++i];
    };
    auto count = [&] { return std::atoi(value().c_str()); };
    if (f == "--config")
      o.config = value();
    else if (f == "--set")
      o.sets.push_back(value());
    else if (f == "--iterations")
      o.iterations = count();
    else if (f == "--pp")
      o.pp = count();
    else if (f == "--dp")
      o.dp = count();
    else if (f == "--spares")
      o.spares = count();
    else if (f == "--repeats")
      o.repeats = count();
    else if (f == "--faulty-repeats")
      o.faulty_repeats = count();
    else if (f == "--preset")
      o.preset = value();
    else if (f == "--micro-batches")
      o.micro_batches = count();
    else if (f == "--micro-batch-size")
      o.micro_batch_size = count();
    else if (f == "--seq-len")
      o.seq_len = count();
    else if (f == "--failures")
      o.failures.push_back(parse_failures(value()));
    else if (f == "--policies")
      o.policies = split(value(), ',');
    else if (f == "--interval")
      o.interval = count();
    else if (f == "--profile-out")
      o.profile_out = value();
    else if (f == "--trace-out")
      o.trace_out = value();
    else if (f == "--keep-logs")
      o.keep_logs = value();
    else
      throw std::runtime_error("unknown option " + f + " (see bench/sim_validation_bench.cpp)");
  }
  if (o.iterations < 6 || o.pp < 1 || o.dp < 1 || o.repeats < 1 || o.spares < 0 || o.interval < 0) {
    throw std::runtime_error(
        "--iterations >= 6, --pp >= 1, --dp >= 1, --repeats >= 1, --interval >= 0");
  }
  if (o.failures.empty()) {
    const int s1 = std::min(1, o.pp - 1), s2 = std::min(2, o.pp - 1);
    o.failures.push_back({{s1, 2L * o.iterations / 3}});
    o.failures.push_back({{s1, long(o.iterations) / 3}, {s2, 2L * o.iterations / 3}});
    o.failures.push_back({{0, long(o.iterations) / 2}});
  }
  for (const auto& spec : o.failures) {
    if (int(spec.size()) > o.spares)
      throw std::runtime_error("a --failures SPEC kills more workers than --spares");
  }
  return o;
}

}  // namespace moevement::bench::simvalidate
