// `moevement bench engine [--config FILE] [--iterations N] [--repeats R] [--ep [--dp D]]`: what the
// actor machinery costs, against the same training in one process, in the same run.
//   iteration_s_pp1_dp1: ours = `moevement launch` (one worker process, stage actor, UCX to
//                        the coordinator) s/iteration; theirs = `moevement train` on the same
//                        config; ratio = theirs / ours (goal >= 0.95)
//   pipeline_efficiency_ppP_mM: ours = 1 - measured bubble, the mean stage's forward+backward
//                        time over the iteration time; theirs = 1 - (P-1)/(M+P-1), 1F1B's
//                        ideal; ratio = ours / theirs
// With --ep [--dp D] (D = 2 by default), expert parallelism instead, at parallel.dp = D and
// policy none, ep = D against ep = 1 (every replica holding every expert):
//   tokens_per_s_dpD: ours = ep = D, theirs = ep = 1 (median iteration); ratio = ours / theirs
//   peak_worker_rss_mb_dpD: the largest worker's peak resident memory; ratio = theirs / ours
//   expert_params_per_worker_dpD: expert parameters a worker holds (from the model's shapes);
//                        ratio = theirs / ours (= D)
//   expert_wait_share_epD: the stages' mean wait for their EP peers over the iteration time
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

// The iterations of a run log (the first one, warming up, left out): median of `key`, and
// the last record's `last_key`.
struct log_figures {
  double median = 0.0, last = 0.0;
};
log_figures figures(const std::string& log, const std::string& key, const std::string& last_key) {
  std::ifstream in(log);
  std::vector<double> v;
  log_figures f;
  int seen = 0;
  for (std::string l; std::getline(in, l);) {
    if (l.find("\"kind\":\"iteration\"") == std::string::npos) continue;
    f.last = field(l, last_key);
    if (seen++ == 0) continue;
    v.push_back(field(l, key));
  }
  if (v.empty()) throw std::runtime_error("no iterations in " + log);
  std::sort(v.begin(), v.end());
  f.median = v[v.size() / 2];
  return f;
}

// A field of the run log's job_start event.
double job_start_field(const std::string& log, const std::string& key) {
  std::ifstream in(log);
  for (std::string l; std::getline(in, l);) {
    if (l.find("\"event\":\"job_start\"") != std::string::npos) return field(l, key);
  }
  throw std::runtime_error("no job_start in " + log);
}

int bench_ep(const std::string& bin, const std::string& config, int iterations, int repeats, int dp,
             const std::string& log) {
  const std::string common = fmt::format(
      " {} --set train.iterations={} --set train.val_batches=0 --set train.log_every=1000000 "
      "--set checkpoint.policy=none --set parallel.dp={} --set engine.run_log={}",
      config, iterations, dp, log);
  double tok[2] = {0, 0}, rss[2] = {1e30, 1e30}, params[2] = {0, 0}, share = 1e30;
  for (int r = 0; r < repeats; ++r) {
    for (int i = 0; i < 2; ++i) {  // 0: ep = dp (ours), 1: ep = 1
      const int ep = i == 0 ? dp : 1;
      run(fmt::format("{} launch{} --set parallel.ep={}", bin, common, ep));
      const auto t = figures(log, "tokens_per_s", "peak_worker_rss_bytes");
      params[i] = job_start_field(log, "expert_params_per_worker");
      tok[i] = std::max(tok[i], t.median);
      rss[i] = std::min(rss[i], t.last / 1e6);
      if (i == 0) {
        const auto w = figures(log, "mean_expert_wait_s", "iteration_s");
        const auto it = figures(log, "iteration_s", "iteration_s");
        share = std::min(share, w.median / it.median);
      }
    }
  }
  const double ours_p = params[0], theirs_p = params[1];
  std::printf("tokens_per_s_dp%d: ours=%.0f theirs=%.0f ratio=%.3f\n", dp, tok[0], tok[1],
              tok[0] / tok[1]);
  std::printf("peak_worker_rss_mb_dp%d: ours=%.1f theirs=%.1f ratio=%.3f\n", dp, rss[0], rss[1],
              rss[1] / rss[0]);
  std::printf("expert_params_per_worker_dp%d: ours=%.0f theirs=%.0f ratio=%.3f\n", dp, ours_p,
              theirs_p, theirs_p / ours_p);
  std::printf("expert_wait_share_ep%d: %.3f of the iteration\n", dp, share);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string config = "examples/configs/small.toml";
  int iterations = 6, repeats = 2, dp = 2;
  bool ep = false;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--ep") {
      ep = true;
      continue;
    }
    const bool known = f == "--config" || f == "--iterations" || f == "--repeats" || f == "--dp";
    if (!known || i + 1 >= argc) {
      std::fprintf(stderr,
                   "bench engine: %s %s (options: --config FILE --iterations N --repeats R --ep "
                   "--dp D)\n",
                   known ? "no value for" : "unknown option", f.c_str());
      return 2;
    }
    if (f == "--config") config = argv[i + 1];
    if (f == "--iterations") iterations = std::atoi(argv[i + 1]);
    if (f == "--repeats") repeats = std::atoi(argv[i + 1]);
    if (f == "--dp") dp = std::atoi(argv[i + 1]);
    ++i;
  }
  if (iterations < 1 || repeats < 1 || dp < 1) {
    std::fprintf(stderr,
                 "bench engine: --iterations, --repeats and --dp take whole numbers >= 1\n");
    return 2;
  }
  try {
    const auto self = std::filesystem::read_symlink("/proc/self/exe");
    const auto bin = (self.parent_path().parent_path() / "launcher" / "moevement").string();
    const auto log = (std::filesystem::temp_directory_path() /
                      ("bench_engine_" + std::to_string(::getpid()) + ".jsonl"))
                         .string();
    if (ep) {
      const int rc = bench_ep(bin, config, iterations, repeats, dp, log);
      std::filesystem::remove(log);
      return rc;
    }
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
