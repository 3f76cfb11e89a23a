// moevement bench resume: what a whole-job restart costs with policy moevement's durable tier
// (`moevement launch CONFIG --resume`), against the iteration time, and its reload of the state
// from disk against dense-disk's reload of the same state. Each round (interleaved, --repeats):
//   ours    `moevement launch` (moevement, durable tier on) whose head gets SIGKILL once
//           iteration --kill-at is trained (its workers go with it), then the same command with
//           --resume. Measured: the resume's restore (its recovery_end seconds: the newest
//           journaled window read from disk on every stage and replayed to the journal's
//           iteration), the time from the resume's start until it has trained again what the
//           killed run had (time lost, also in iterations), and the final state_hash against
//           `moevement train`'s.
//   theirs  the same job under dense-disk (CheckFreq-like: full checkpoints on disk every k
//           iterations) with stage 0's worker killed at --kill-at: the rollback's load_s, every
//           stage reading and loading its full checkpoint from disk. dense-disk has no --resume,
//           so its reload inside the job is the nearest like for like.
//   standby the same moevement job with a standby head (cluster.standby_head): the head gets
//           SIGKILL at the same point and the standby carries the job on (its workers stay).
//           Measured: the time from the kill until the first iteration past the killed run's
//           last is trained, less that iteration's own time (the standby goes on from the
//           running stages; where it cannot, from the journal's window, retraining), against
//           the resume's time lost (which counts from the resume's start, so leaves out the
//           operator's reaction and the kill's own detection: favourable to the resume).
// Prints
//   reload_s: ours=<resume restore> theirs=<dense-disk load_s> ratio=<theirs/ours>
//   head_loss_s: ours=<standby's time lost> theirs=<resume's time lost> ratio=<theirs/ours>
// and, as comments, the time lost in iterations, the iteration time and the hashes.
#include <fmt/format.h>
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "bench/launch_job.hpp"
#include "bench/run_log_stats.hpp"

namespace {

namespace fs = std::filesystem;
using namespace moevement::bench;

struct options {
  std::string config = "examples/configs/tiny.toml";
  std::vector<std::string> sets;
  int iterations = 120, kill_at = -1, repeats = 3, pp = 2;
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
    } else if (f == "--kill-at") {
      o.kill_at = std::atoi(value().c_str());
    } else if (f == "--repeats") {
      o.repeats = std::atoi(value().c_str());
    } else if (f == "--pp") {
      o.pp = std::atoi(value().c_str());
    } else {
      throw std::runtime_error("unknown option " + f + " (see bench/resume_bench.cpp)");
    }
  }
  if (o.kill_at < 0) o.kill_at = o.iterations * 2 / 3;
  if (o.iterations < 8 || o.repeats < 1 || o.pp < 1 || o.kill_at < 4 ||
      o.kill_at >= o.iterations - 1) {
    throw std::runtime_error(
        "--iterations >= 8, --repeats >= 1, --pp >= 1, --kill-at between 4 and --iterations - 2");
  }
  return o;
}

std::vector<std::string> job_args(const options& o, const std::string& policy,
                                  const fs::path& log) {
  std::vector<std::string> a{"launch", o.config};
  auto set = [&](const std::string& kv) {
    a.push_back("--set");
    a.push_back(kv);
  };
  set(fmt::format("train.iterations={}", o.iterations));
  set(fmt::format("parallel.pp={}", o.pp));
  set("checkpoint.policy=" + policy);
  set("checkpoint.dir=" + fs::path(log).replace_extension(".ckpt").string());
  set("engine.run_log=" + log.string());
  for (const auto& s : o.sets) set(s);
  return a;
}

// The pids of the job's workers (worker_up), gone within `limit` or an error.
void wait_for_workers_gone(const std::vector<stamped>& log) {
  for (const auto& [t, l] : log) {
    if (!is_event(l, "worker_up")) continue;
    const pid_t pid = pid_t(number(l, "pid"));
    for (int i = 0; i < 1000 && ::kill(pid, 0) == 0; ++i) {
      std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
      std::string s;
      std::getline(stat, s);
      if (const auto c = s.rfind(')');
          c != std::string::npos && c + 2 < s.size() && s[c + 2] == 'Z')
        break;  // a zombie: gone, waiting for a reaper that is not ours
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
}

long last_iteration(const std::vector<stamped>& log) {
  long last = -1;
  for (const auto& [t, l] : log) {
    if (l.find("\"kind\":\"iteration\"") != std::string::npos) {
      last = std::max(last, long(number(l, "iteration")));
    }
  }
  return last;
}

struct ours_round {
  double restore_s = 0, time_lost_s = 0, iteration_s = 0;
  double pull_s = 0, replay_s = 0;  // the resume's parts: windows read from disk, replay
  long killed_after = -1, resumed_at = -1, replayed = 0;
  std::string hash;
};

ours_round run_ours(const options& o, const std::string& bin) {
  const fs::path log = bench_log("resume");
  const fs::path dir = fs::path(log).replace_extension(".ckpt");
  fs::remove_all(dir);
  ours_round r;
  const auto first =
      launch_job(bin, job_args(o, "moevement", log), log, {},
                 [&](const std::vector<stamped>& l) { return last_iteration(l) >= o.kill_at; });
  if (!first.killed) throw std::runtime_error("the job ended before the kill:\n" + first.output);
  wait_for_workers_gone(first.lines);
  r.killed_after = last_iteration(first.lines);
  std::vector<double> its;
  for (const auto& [t, l] : first.lines) {
    if (l.find("\"kind\":\"iteration\"") != std::string::npos)
      its.push_back(number(l, "iteration_s"));
  }
  r.iteration_s = median(its);
  auto args = job_args(o, "moevement", log);
  args.push_back("--resume");
  // launch_job truncates the run log: the resume's own records are what it reads back.
  const auto second = launch_job(bin, args, log);
  if (!second.ok) throw std::runtime_error("the resume failed:\n" + second.output);
  for (const auto& [t, l] : second.lines) {
    if (is_event(l, "recovery_end") && text(l, "recovery") == "resume") {
      r.restore_s = number(l, "seconds");
      r.resumed_at = long(number(l, "target_iteration"));
      r.replayed = long(number(l, "iterations_replayed"));
      r.pull_s = number(l, "pull_s");
      r.replay_s = number(l, "replay_s");
    }
    if (l.find("\"kind\":\"iteration\"") != std::string::npos &&
        long(number(l, "iteration")) == r.killed_after && r.time_lost_s == 0) {
      r.time_lost_s = t;
    }
    if (is_event(l, "job_end")) r.hash = text(l, "state_hash");
  }
  fs::remove(log);
  fs::remove_all(dir);
  return r;
}

struct standby_round {
  double time_lost_s = 0, restore_s = 0;
  long killed_after = -1, resumed_at = -1;
  bool live = false;  // went on from the running stages (else back to disk)
  std::string hash;
};

standby_round run_standby(const options& o, const std::string& bin) {
  const fs::path log = bench_log("resume_standby");
  const fs::path dir = fs::path(log).replace_extension(".ckpt");
  fs::remove_all(dir);
  auto args = job_args(o, "moevement", log);
  args.insert(args.end(), {"--set", "cluster.standby_head=true"});
  const auto r = launch_job(
      bin, args, log, {},
      [&](const std::vector<stamped>& l) { return last_iteration(l) >= o.kill_at; }, true);
  if (!r.killed || !r.ok) throw std::runtime_error("the standby did not finish:\n" + r.output);
  standby_round out;
  bool after_kill = false;
  for (const auto& [t, l] : r.lines) {
    const bool iteration = l.find("\"kind\":\"iteration\"") != std::string::npos;
    if (!after_kill && iteration) out.killed_after = long(number(l, "iteration"));
    if (t > r.killed_at) after_kill = true;
    if (after_kill && is_event(l, "job_start")) {  // the standby's
      out.resumed_at = long(number(l, "resume_iteration"));
      out.live = text(l, "takeover") == "live";
    }
    if (after_kill && is_event(l, "recovery_end") && text(l, "recovery") == "resume") {
      out.restore_s = number(l, "seconds");
    }
    // Lost: from the kill until the first iteration past the killed run's last is trained,
    // less that iteration's own time (what the job did nothing useful for, whether it went
    // on from the running stages or went back to disk and trained iterations again).
    if (after_kill && iteration && long(number(l, "iteration")) > out.killed_after &&
        out.time_lost_s == 0 && out.resumed_at >= 0) {
      out.time_lost_s = t - r.killed_at - number(l, "iteration_s");
    }
    if (is_event(l, "job_end")) out.hash = text(l, "state_hash");
  }
  wait_for_workers_gone(r.lines);
  fs::remove(log);
  fs::remove_all(dir);
  return out;
}

struct theirs_round {
  double load_s = 0;
  long recomputed = -1;
  std::string hash;
};

theirs_round run_theirs(const options& o, const std::string& bin) {
  const fs::path log = bench_log("resume_dense");
  const fs::path dir = fs::path(log).replace_extension(".ckpt");
  fs::remove_all(dir);
  auto args = job_args(o, "dense-disk", log);
  for (const std::string& a :
       {std::string("--set"), std::string("cluster.spares=1"), std::string("--inject"),
        fmt::format("kill:stage=0,replica=0,iter={}", o.kill_at)}) {
    args.push_back(a);
  }
  const run_result r = parse(launch_or_throw(bin, args, log));
  theirs_round out;
  if (r.recoveries.empty()) throw std::runtime_error("the dense-disk run did not recover");
  out.load_s = r.recoveries.back().load_s;
  out.recomputed = r.recomputed;
  out.hash = r.state_hash;
  fs::remove(log);
  fs::remove_all(dir);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const options o = parse_options(argc, argv);
    const std::string bin = moevement_binary();
    // The uninterrupted run's hash: `moevement train` of the same settings.
    std::vector<std::string> train{"train", o.config, "--set",
                                   fmt::format("train.iterations={}", o.iterations)};
    for (const auto& s : o.sets) {
      train.push_back("--set");
      train.push_back(s);
    }
    const auto ref = launch_job(bin, train, bench_log("resume_train"));
    const auto at = ref.output.rfind("state_hash=");
    if (!ref.ok || at == std::string::npos) throw std::runtime_error("train: " + ref.output);
    const std::string want = ref.output.substr(at + 11, 16);
    std::printf(
        "# config %s, pp %d, %d iterations; the head killed after iteration %d; %d rounds\n",
        o.config.c_str(), o.pp, o.iterations, o.kill_at, o.repeats);
    std::vector<double> restore, load, lost, lost_its, iteration, standby_lost;
    int ours_equal = 0, theirs_equal = 0, standby_equal = 0;
    for (int i = 0; i < o.repeats; ++i) {  // interleaved: the host's load drifts
      const ours_round a = run_ours(o, bin);
      const theirs_round b = run_theirs(o, bin);
      const standby_round c = run_standby(o, bin);
      ours_equal += a.hash == want;
      theirs_equal += b.hash == want;
      standby_equal += c.hash == want;
      if (c.hash == want) standby_lost.push_back(c.time_lost_s);  // a round that failed: none
      std::printf(
          "# round %d, standby: killed after iteration %ld, went on at %ld %s (restore %.3f s); "
          "%.3f s lost (the kill until iteration %ld was trained, less its own time)\n",
          i, c.killed_after, c.resumed_at,
          c.live ? "from the running stages" : "from the journal's window on disk", c.restore_s,
          c.time_lost_s, c.killed_after + 1);
      restore.push_back(a.restore_s);
      load.push_back(b.load_s);
      lost.push_back(a.time_lost_s);
      iteration.push_back(a.iteration_s);
      lost_its.push_back(a.iteration_s > 0 ? a.time_lost_s / a.iteration_s : 0);
      std::printf(
          "# round %d: killed after iteration %ld, resumed at %ld (%ld replayed) in %.3f s (disk "
          "%.3f s, replay %.3f s); "
          "trained again what was lost after %.3f s (%.1f iterations of %.4f s); dense-disk "
          "reload %.3f s, %ld recomputed\n",
          i, a.killed_after, a.resumed_at, a.replayed, a.restore_s, a.pull_s, a.replay_s,
          a.time_lost_s, lost_its.back(), a.iteration_s, b.load_s, b.recomputed);
    }
    std::printf(
        "# state_hash equal to train's: ours %d of %d, dense-disk %d of %d, standby %d of %d\n",
        ours_equal, o.repeats, theirs_equal, o.repeats, standby_equal, o.repeats);
    std::printf(
        "# time lost to the kill (resume start to the killed run's last iteration): "
        "%.3f s median, %.1f iterations; iteration %.4f s\n",
        median(lost), median(lost_its), median(iteration));
    const double ours = median(restore), theirs = median(load);
    std::printf("reload_s: ours=%.4f theirs=%.4f ratio=%.3f\n", ours, theirs,
                ours > 0 ? theirs / ours : 0.0);
    if (standby_lost.empty()) {
      std::printf("# no standby round ended with train's hash: no time lost to report\n");
    } else {
      const double standby = median(standby_lost), resume = median(lost);
      std::printf(
          "# time lost to the head kill with a standby (the %zu rounds that ended right): %.3f s "
          "median, %.1f iterations\n",
          standby_lost.size(), standby, median(iteration) > 0 ? standby / median(iteration) : 0.0);
      std::printf("head_loss_s: ours=%.4f theirs=%.4f ratio=%.3f\n", standby, resume,
                  standby > 0 ? resume / standby : 0.0);
    }
    return ours_equal == o.repeats && theirs_equal == o.repeats && standby_equal == o.repeats ? 0
                                                                                              : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench resume: %s\n", e.what());
    return 1;
  }
}
