// The `moevement` command. Each subcommand lives in its own file of launcher/.
#include <fmt/format.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <iostream>
#include <string>
#include <string_view>
#include <vector>

#include "bench_usage.hpp"
#include "build_config.hpp"
#include "engine/stage_registry.hpp"
#include "launcher/check.hpp"
#include "launcher/launch.hpp"
#include "launcher/report.hpp"
#include "launcher/simulate.hpp"
#include "launcher/slurm_env_cmd.hpp"
#include "launcher/train.hpp"

namespace {

constexpr std::string_view usage = R"(usage: moevement <command> [args]

commands:
  check      verify this machine: UCX, wire format, BLIS determinism, CUDA
  launch CONFIG [--set k=v] train on a local cluster of worker processes (pp x dp stage
             actors over UCX); shows progress, writes the run log, prints state_hash=
  worker     one worker process of a job (started by launch, or by Slurm)
  train CONFIG [--set k=v]  train in this process (no actors); prints state_hash=;
             --checkpoint-dir DIR [--resume] checkpoints it and goes on after a kill
  bench NAME run benchmark NAME (bench/NAME_bench.cpp) against its competitor
  slurm-env  print what this task learned from Slurm's environment (run under srun), as JSON
  simulate   estimate ETTR per checkpoint policy (moevement simulate --help)
  report RUN.jsonl [MORE.jsonl] [-o FILE.html]  a run's story as one HTML file: throughput
             with the failures and recoveries, loss, checkpoint costs, the recoveries
  version    print the version
  help       print this text
)";

// The benchmarks and what each runs against, in the same run (bench/NAME_bench.cpp; the
// cli test checks this list against bench/meson.build).
struct bench_entry {
  const char* name;
  const char* compares;
};
constexpr bench_entry benchmarks[] = {
    {"transport", "ucx_link's latency, message rate and pulls against ucx_perftest"},
    {"actors", "local actor messaging against CAF"},
    {"model", "a training step on the CPU against BLIS on its GEMMs (--device cuda: cuBLAS)"},
    {"engine", "`moevement launch` against `moevement train` on the same config"},
    {"baselines", "dense-memory, dense-disk and pec against moevement, in one process"},
    {"policies", "policy moevement under `launch` against none, then with one failure"},
    {"recovery", "moevement's recovery against the baselines' rollbacks (--dp: per dp)"},
    {"simvalidate", "the ETTR simulator against measured `launch` runs"},
    {"collectives", "GPU stages' gradient sum through NCCL against the host path"},
    {"resume", "a killed job's --resume against dense-disk's reload of the same state"},
    {"network", "a job on a lossy or rate-limited loopback against a clean one (root, nft, tc)"},
};

void list_benchmarks(std::ostream& out) {
  out << "usage: moevement bench NAME [args]   (NAME --help: its options)\nbenchmarks:\n";
  for (const auto& b : benchmarks) out << fmt::format("  {:<12} {}\n", b.name, b.compares);
}

// `moevement bench NAME --help`: the opening comment of its source (what it compares, its
// options), nothing run.
int bench_help(const std::string& name) {
  // Benchmarks that share a source with another: their text is that source's.
  const std::string_view source = name == "simvalidate" ? "sim_validation"
                                  : name == "recovery"  ? "policies"
                                                        : std::string_view(name);
  for (const auto& [n, text] : bench_usages) {
    if (n == source) {
      std::cout << text;
      return 0;
    }
  }
  std::cout << "moevement bench " << name << ": see docs/benchmarks.md\n";
  return 0;
}

// Benchmarks are separate executables (bench/bench_NAME) so that their competitors' libraries
// (CAF, ...) never link into the runtime; `moevement bench NAME` runs the one beside us.
int run_bench(int argc, char** argv) {
  if (argc < 3) {
    list_benchmarks(std::cerr);
    return 2;
  }
  const std::string name = argv[2];
  if (name == "--help" || name == "-h" || name == "help") {
    list_benchmarks(std::cout);
    return 0;
  }
  if (name.find_first_not_of("abcdefghijklmnopqrstuvwxyz_") != std::string::npos) {
    std::cerr << "moevement bench: bad benchmark name '" << name << "'\n";
    return 2;
  }
  const auto self = std::filesystem::read_symlink("/proc/self/exe");
  const auto bench = self.parent_path().parent_path() / "bench" / ("bench_" + name);
  if (!std::filesystem::exists(bench)) {
    std::cerr << fmt::format(
        "moevement bench: no benchmark '{}' (looked for {}; build it with "
        "ninja -C build)\n",
        name, bench.string());
    return 2;
  }
  for (int i = 3; i < argc; ++i) {
    if (std::string_view(argv[i]) == "--help" || std::string_view(argv[i]) == "-h") {
      return bench_help(name);
    }
  }
  std::vector<char*> args{const_cast<char*>(bench.c_str())};
  for (int i = 3; i < argc; ++i) args.push_back(argv[i]);
  args.push_back(nullptr);
  ::execv(bench.c_str(), args.data());
  std::cerr << "moevement bench: cannot run " << bench << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string_view command = argc > 1 ? argv[1] : "help";
    if (command == "check") {
      if (argc > 2) {
        std::cerr << fmt::format("moevement check: unexpected argument '{}' (it takes none)\n",
                                 argv[2]);
        return 2;
      }
      return moevement::launcher::run_check(std::cout);
    }
    if (command == "bench") return run_bench(argc, argv);
    if (command == "slurm-env") return moevement::launcher::run_slurm_env(std::cout);
    if (command == "simulate")
      return moevement::launcher::run_simulate(argc, argv, std::cout, std::cerr);
    if (command == "train") {
      std::setvbuf(stdout, nullptr, _IOLBF, 0);  // as launch's: a killed run's lines are there
      return moevement::launcher::run_train(argc, argv);
    }
    if (command == "report") return moevement::launcher::run_report(argc, argv);
    if (command == "launch" || command == "worker") {
      // Line by line into a file or pipe too: what a killed or hung job printed last is there.
      std::setvbuf(stdout, nullptr, _IOLBF, 0);
      const auto registry = moevement::engine::stage_registry::with_builtins();
      return command == "launch" ? moevement::launcher::run_launch(argc, argv, registry)
                                 : moevement::launcher::run_worker(argc, argv, registry);
    }
    if (command == "version" || command == "--version") {
      std::cout << "moevement " << MOEVEMENT_VERSION << "\n";
      return 0;
    }
    if (command == "help" || command == "--help" || command == "-h") {
      std::cout << usage;
      return 0;
    }
    std::cerr << fmt::format("moevement: unknown command '{}'\n\n{}", command, usage);
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "moevement: " << e.what() << "\n";
    return 1;
  }
}
