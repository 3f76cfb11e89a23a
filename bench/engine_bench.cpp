// `moevement bench engine [--config FILE] [--iterations N] [--repeats R]`: what the actor
// machinery costs, against the same training in one process, in the same run.
//   iteration_s_pp1_dp1: ours = `moevement launch` (one worker process, stage actor, UCX to
//                        the coordinator) s/iteration; theirs = `moevement train` on the same
//                        config; ratio = theirs / ours (goal >= 0.95)
//   pipeline_efficiency_ppP_mM: ours = 1 - measured bubble, the mean stage's forward+backward
//                        time over the iteration time; theirs = 1 - (P-1)/(M+P-1), 1F1B's
//                        ideal; ratio = ours / theirs
// Best of R interleaved repeats (the machine may be shared). Run from the source root (the
// default config is examples/configs/small.toml). On a machine with fewer cores than
// pipeline stages the stages share cores and the measured bubble says so.
#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

std::string run(const std::string& cmd) {
  std::FILE* p = ::popen((cmd + " 2>&1").c_str(), "r");
  if (p == nullptr) throw std::runtime_error("popen failed: " + cmd);
  std::string out;
  std::array<char, 4096> buf;
  std::size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) out.append(buf.data(), n);
  if (::pclose(p) != 0) throw std::runtime_error("failed: " + cmd + "\n" + out);
  return out;
}

// Seconds per iteration from a final line "... (N iterations, S s)".
double per_iteration(const std::string& out) {
  const auto at = out.rfind(" iterations, ");
  const auto open = out.rfind('(', at);
  if (at == std::string::npos || open == std::string::npos) {
    throw std::runtime_error("no final line in:\n" + out);
  }
  const double n = std::strtod(out.c_str() + open + 1, nullptr);
  const double s = std::strtod(out.c_str() + at + 13, nullptr);
  return s / n;
}

double field(const std::string& line, const std::string& key) {
  const auto at = line.find("\"" + key + "\":");
  return at == std::string::npos ? 0.0 : std::strtod(line.c_str() + at + key.size() + 3, nullptr);
}

// Mean over the run log's iterations (the first one, warming up, left out) of
// mean_stage_compute_s / iteration_s.
double busy_fraction(const std::string& log) {
  std::ifstream in(log);
  double sum = 0.0;
  int n = 0, seen = 0;
  for (std::string l; std::getline(in, l);) {
    if (l.find("\"kind\":\"iteration\"") == std::string::npos) continue;
    if (seen++ == 0) continue;
    sum += field(l, "mean_stage_compute_s") / field(l, "iteration_s");
    ++n;
  }
  return n > 0 ? sum / n : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "examples/configs/small.toml";
  int iterations = 6, repeats = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    if (f == "--config") config = argv[i + 1];
    if (f == "--iterations") iterations = std::atoi(argv[i + 1]);
    if (f == "--repeats") repeats = std::atoi(argv[i + 1]);
  }
  try {
    const auto self = std::filesystem::read_symlink("/proc/self/exe");
    const auto bin = (self.parent_path().parent_path() / "launcher" / "moevement").string();
    const auto log = (std::filesystem::temp_directory_path() /
                      ("bench_engine_" + std::to_string(::getpid()) + ".jsonl"))
                         .string();
    const std::string common = fmt::format(
        " {} --set train.iterations={} --set train.val_batches=0 --set train.log_every=1000000",
        config, iterations);
    double ours = 1e30, theirs = 1e30;
    for (int r = 0; r < repeats; ++r) {
      theirs = std::min(theirs, per_iteration(run(bin + " train" + common)));
      ours = std::min(
          ours, per_iteration(run(bin + " launch" + common + " --set engine.run_log=" + log)));
    }
    std::printf("iteration_s_pp1_dp1: ours=%.4f theirs=%.4f ratio=%.3f\n", ours, theirs,
                theirs / ours);
    for (const auto& [pp, m] : std::vector<std::pair<int, int>>{{2, 4}, {2, 8}, {4, 8}}) {
      double best = 0.0;
      for (int r = 0; r < repeats; ++r) {
        run(
            fmt::format("{} launch{} --set parallel.pp={} --set train.micro_batches={} --set "
                        "engine.run_log={}",
                        bin, common, pp, m, log));
        best = std::max(best, busy_fraction(log));
      }
      const double ideal = 1.0 - double(pp - 1) / double(m + pp - 1);
      std::printf("pipeline_efficiency_pp%d_m%d: ours=%.3f theirs=%.3f ratio=%.3f\n", pp, m, best,
                  ideal, best / ideal);
    }
    std::filesystem::remove(log);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench engine: %s\n", e.what());
    return 1;
  }
  return 0;
}
