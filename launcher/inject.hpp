// Failure injection for `moevement launch` (docs/recovery.md "Failure injection"): repeatable
// `--inject SPEC` options and `[[inject]]` tables of the job config, which combine.
//
//   kill:stage=S,replica=D,iter=T      the head SIGKILLs the worker of (S, D) as iteration T
//                                      (>= 1) begins
//   kill:stage=S,replica=D,iter=T,phase=forward|backward|step|snapshot
//                                      the worker kills itself at that point of iteration T
//                                      (engine::fault_point); only a process that was given the
//                                      role at the start, or a replacement past the iteration it
//                                      started at, never a replacement re-running T
//   kill:stage=S,replica=D,during=recovery[,nth=K][,delay_ms=M]
//                                      the head kills the worker that holds (S, D) M ms after
//                                      the K-th recovery started (K >= 1; default 1, 0 ms)
//   kill:...,scope=host                every worker and spare on the host (failure domain: the
//                                      Slurm node, else the host) of the one that holds (S, D)
//   hang:...                           the same with SIGSTOP (heartbeats stop)
//   mtbf:SECONDS[,seed=N][,max=K]      Poisson failures: exponential gaps of mean SECONDS of
//                                      training, each killing a uniformly chosen (S, D); all
//                                      from seed N (default 1); at most K (default
//                                      cluster.spares)
//   trace:FILE                         failure times from a file (read_trace)
//   flip:stage=S,replica=D,iter=T[,operator=NAME][,word=I][,bit=K][,target=weight]
//                                      silent corruption: the worker of (S, D) flips bit K
//                                      (default 22, kept by 2-byte compute weights) of word I
//                                      (default 0) of operator NAME's FP32 master weights
//                                      (default: the stage's first operator) right after the
//                                      step of iteration T; never in a replacement
//   flip:stage=S,replica=D,iter=T,target=activation[,word=I][,bit=K]
//                                      the activation of micro-batch 0 that (S, D) computes in
//                                      T has bit K of its word I flipped before it is logged
//                                      and sent (a miscomputed tensor; found at a replay)
//   flip:stage=S,replica=D,iter=T,target=slot[,bit=K]
//                                      the first holder of the snapshot copy of the slot
//                                      (S, D) captures after T's step flips bit K % 8 of its
//                                      middle byte once stored
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "engine/hooks.hpp"
#include "engine/job_config.hpp"
#include "models/config.hpp"

namespace moevement::launcher {

enum class failure_kind : std::uint8_t { kill, hang };

struct injection {
  // stall: with phase only; the worker's compute thread blocks there for ever, its process and
  // heartbeats going on (a hung kernel or collective: cluster.iteration_timeout_ms finds it)
  enum class kind : std::uint8_t { kill, hang, mtbf, trace, flip, stall };
  kind what = kind::kill;
  // kill, hang, stall
  int stage = 0, replica = 0;
  std::int64_t iteration = 0;  // iter=T (>= 1); 0 with during=recovery
  std::optional<engine::fault_point> phase;
  bool whole_host = false;  // scope=host: every process in the failure domain of (stage, replica)
  bool during_recovery = false;
  // during=start: as every worker was given its role, before training starts (its stage is
  // being built)
  bool during_start = false;
  int nth = 1;                // during=recovery: the nth recovery to start (1-based)
  std::int64_t delay_ms = 0;  // during=recovery|start: after it started
  // mtbf
  double mtbf_s = 0.0;
  std::uint64_t seed = 1;
  int max_failures = -1;  // -1: cluster.spares
  // trace
  std::string file;
  // flip: the operator (empty: the stage's first), the word of its master weights, the bit;
  // slot_copy: a snapshot copy's byte instead (target=slot)
  std::string op;
  std::int64_t word = 0;
  int bit = 22;
  bool slot_copy = false;
  bool activation = false;  // target=activation

  std::string source;  // where it came from, for messages: "--inject SPEC" or "[[inject]] #2 ..."
  bool done = false;   // the head's bookkeeping

  failure_kind failure() const {
    return what == kind::hang ? failure_kind::hang : failure_kind::kill;
  }
  // The canonical spec: parse_injection(text()) gives this injection back.
  std::string text() const;
};

// Throws std::invalid_argument naming the spec (or `source`, when given) and what is expected.
injection parse_injection(const std::string& spec, const std::string& source = "");

// The [[inject]] tables of a config (load_config_file flattens the k-th one to inject.k.KEY):
// removes every inject.* key from `raw` and returns the tables in order. A relative trace
// file is relative to the config file's directory. Throws std::invalid_argument.
std::vector<injection> take_inject_tables(models::config_map& raw, const std::string& config_path);
// The keys an [[inject]] table may have (docs/configuration.md lists each; a test checks).
std::vector<std::string> inject_table_keys();

// One failure of a schedule (mtbf, trace): at `at_s` seconds of training.
struct scheduled_failure {
  double at_s = 0.0;
  failure_kind what = failure_kind::kill;
  int stage = 0, replica = 0;
  std::string origin;  // "trace FILE line N" or "mtbf:..."
  std::string text() const;
};

// A trace file: one failure per line, `<seconds> kill|hang stage=S replica=D`, seconds of
// training (>= 0, not decreasing), `#` starts a comment, blank lines are skipped. Throws
// std::invalid_argument naming the file and line.
std::vector<scheduled_failure> read_trace(const std::string& path);
// The failures of an mtbf injection over pp x dp roles: the same seed, the same schedule.
std::vector<scheduled_failure> mtbf_schedule(const injection& inj, int pp, int dp, int spares);

// Checks an injection against the resolved job (roles exist, iterations run, phase=snapshot
// needs policy moevement, phases need the local backend; a trace is read and checked) and
// returns its schedule (empty for kill and hang). Throws std::invalid_argument.
std::vector<scheduled_failure> check_injection(const injection& inj, const engine::job_config& job);

}  // namespace moevement::launcher
