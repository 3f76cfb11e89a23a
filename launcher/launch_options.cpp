#include "launcher/launch_options.hpp"

#include <fmt/format.h>

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <stdexcept>

#include "launcher/config.hpp"

namespace moevement::launcher {

const char* const launch_usage =
    "usage: moevement launch CONFIG [--set key=value ...] [--inject SPEC ...] [--dry-run]\n"
    "                        [--resume] [--requeue] [--report FILE.html]\n"
    "                        [--sbatch [-- SBATCH_OPTION ...]]\n"
    "  CONFIG: a TOML file (examples/configs/demo.toml); keys in docs/configuration.md\n"
    "  SPEC: kill|hang:stage=S,replica=D,iter=T[,phase=forward|backward|step|snapshot],\n"
    "        kill|hang:stage=S,replica=D,during=recovery[,nth=K][,delay_ms=M],\n"
    "        stall:stage=S,replica=D,iter=T,phase=P, flip:stage=S,replica=D,iter=T[,...],\n"
    "        mtbf:SECONDS[,seed=N][,max=K] or trace:FILE (docs/recovery.md); they add to the\n"
    "        config's [[inject]] tables\n"
    "  --dry-run: check the config and the injections, print the failure schedules, start "
    "nothing\n"
    "  --resume: start where a killed run of the same job left off: the newest durable window\n"
    "        of checkpoint.dir (policy moevement with its durable tier: checkpoint.durable, on\n"
    "        by default on the local backend)\n"
    "  --sbatch: (cluster.backend = \"slurm\") submit this launch as a Slurm batch job and "
    "return\n"
    "  --report: when the job ends, draw its run log as one HTML file (moevement report)\n"
    "  SIGUSR1 stops the job once its next durable window is on disk (exit status 75);\n"
    "  --requeue: then requeue this Slurm batch job, which resumes on its own when it starts\n"
    "        again (--sbatch adds it, with sbatch --requeue --signal=B:USR1@180)\n";

std::optional<launch_options> parse_launch_options(int argc, char** argv) {
  if (argc < 3) {
    std::cerr << launch_usage;
    return std::nullopt;
  }
  if (const std::string first = argv[2]; first.starts_with("--")) {
    std::cerr << "moevement launch: the config file comes first, then " << first << "\n"
              << launch_usage;
    return std::nullopt;
  }
  launch_options o;
  o.config_path = argv[2];
  o.raw = load_config_file(o.config_path);
  for (int i = 3; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--set" && i + 1 < argc) {
      o.overrides.emplace_back(argv[++i]);
      apply_override(o.raw, o.overrides.back());
    } else if (a.starts_with("--set=")) {
      o.overrides.push_back(a.substr(6));
      apply_override(o.raw, o.overrides.back());
    } else if (a == "--inject" && i + 1 < argc) {
      o.injections.push_back(parse_injection(argv[++i]));
    } else if (a.starts_with("--inject=")) {
      o.injections.push_back(parse_injection(a.substr(9)));
    } else if (a == "--dry-run") {
      o.dry_run = true;
    } else if (a == "--resume") {
      o.resume = true;
    } else if (a == "--requeue") {
      o.requeue = true;
    } else if (a == "--report" && i + 1 < argc) {
      o.report = argv[++i];
    } else if (a == "--standby-of" && i + 1 < argc) {
      o.standby_of = argv[++i];
    } else if (a == "--locks" && i + 1 < argc) {
      o.standby_locks = int(std::strtol(argv[++i], nullptr, 10));
    } else if (a == "--node" && i + 1 < argc) {
      o.standby_node = std::uint32_t(std::strtoul(argv[++i], nullptr, 10));
    } else if (a == "--sbatch") {
      o.sbatch = true;
      if (i + 1 < argc && std::string(argv[i + 1]) == "--") {
        o.sbatch_args.assign(argv + i + 2, argv + argc);
        break;
      }
    } else {
      std::cerr << "moevement launch: unexpected argument '" << a << "'\n" << launch_usage;
      return std::nullopt;
    }
  }
  if (o.sbatch && o.resume) {
    throw std::invalid_argument(
        "--resume does not go with --sbatch: submit a batch script that runs `moevement launch "
        "CONFIG --resume` instead");
  }
  if (!o.report.empty() && (o.sbatch || o.dry_run)) {
    throw std::invalid_argument(
        "--report draws the job's run log when the job ends here: it does not go with --sbatch "
        "or --dry-run (run `moevement report RUN.jsonl` once the batch job ended)");
  }
  if (const auto dir = std::filesystem::path(o.report).parent_path();
      !o.report.empty() && !dir.empty() && !std::filesystem::is_directory(dir)) {
    throw std::invalid_argument(fmt::format(
        "--report {}: there is no directory {} to write it in (checked before the job runs)",
        o.report, dir.string()));
  }
  if (o.sbatch && !o.injections.empty()) {
    throw std::invalid_argument(
        "--inject does not go with --sbatch (the batch job runs the launch from CONFIG and "
        "--set only): write the injections as [[inject]] tables in CONFIG "
        "(docs/configuration.md)");
  }
  if (o.standby_locks < 0 || o.standby_locks > 2 || (o.standby_locks > 0 && o.standby_of.empty())) {
    throw std::invalid_argument("--locks N (0 to 2) goes with --standby-of only");
  }
  if (!o.standby_of.empty() && (o.standby_node == 0 || o.resume || o.sbatch || o.dry_run)) {
    throw std::invalid_argument(
        "--standby-of HOST:PORT goes with --node N only (launch starts the standby head itself "
        "under cluster.standby_head = true)");
  }
  if (o.requeue) {
    const char* restarts = std::getenv("SLURM_RESTART_COUNT");
    o.requeued = restarts != nullptr && std::atoi(restarts) > 0;
  }
  // The config's [[inject]] tables first, then the command line's (--set may edit tables).
  auto tables = take_inject_tables(o.raw, o.config_path);
  o.injections.insert(o.injections.begin(), tables.begin(), tables.end());
  if (!o.standby_of.empty()) o.injections.clear();  // the head injected them already
  return o;
}

engine::job_config checked_job(const launch_options& o) {
  engine::job_config job = engine::resolve_job(o.raw);
  check_host_memory(job.model, job.train);
  if (auto fits = engine::fits_the_wire(o.raw); !fits.ok()) {
    throw std::runtime_error(fits.err().message +
                             " (the workers would refuse the config: shorten the value)");
  }
  return job;
}

}  // namespace moevement::launcher
