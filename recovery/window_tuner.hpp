// Policy moevement's W_sparse, re-chosen from what capturing really costs (issue: Algorithm 1
// takes the snapshot copy as free while it fits in the iteration, true where a GPU's copy
// engine moves the bytes; on shared or busy host cores nothing checked that it was).
//
// Algorithm 1's W is the start. The head then measures, over each window, what the stages'
// checkpoints cost the iterations: the time each step waited for the capture before it (the
// stall), the upstream log's time on the compute thread, and, where the stages compute on the
// CPU, the capture threads' CPU time (the slots' copies and the log copies made there) and the
// actor threads' CPU time replicating the slots (offers and answers, maps: per offer, not per
// byte, and on a small model more than the copies) as a share of the hosts' cores. The
// capture thread runs
// at the lowest priority, yet on CPU stages it still slows the compute by about its share of
// the cores (measured: a capture using 6.6% of two cores, the stages' compute 6% slower;
// docs/benchmarks.md), through the caches and memory it shares with them. The iteration time
// itself cannot tell: on a shared host it varies by tens of percent from one iteration to the
// next without any checkpoint. At a window's start the tuner decides:
//   cost over max_overhead of the capture-free time: a larger W (fewer bytes per step, at
//     least W + 1, at most 4 x W at once), up to the ceiling (one operator per slot);
//   cost under a quarter of it in two decisions in a row: half the W (a recovery replays up
//     to 2 x W iterations, so W stays no larger than it must; the two decisions keep a
//     window's one-off costs, such as the first touch of new slot memory, from see-sawing W);
//   else the same W.
// With checkpoint.window_rule = "ettr" the rule is the predicted ETTR under checkpoint.mtbf_s
// instead (paper 2.4, appendix C):
//   ETTR(W) = 1 / (1 + o(W)) x 1 / (1 + E[R](W) / MTBF), where o(W) = o_measured x W_measured / W
//   (a step's slot holds 1/W of the state) and E[R](W) = restart_s + 1.5 W T (a failure finds
//   the persisted window one to two windows back; the replay of an iteration taken as the
//   capture-free iteration time T, an upper bound); the W in [W/2, 4 x W] (and the ceiling)
//   that maximises it, where it predicts over min_ettr_gain more than the current W.
// Each decision measures a whole window of the current W (its slots differ in size) and at
// least min_iterations iterations, less the one that cost the most (a one-off hiccup, such as
// a 26 ms log copy in a 9 ms iteration, once made three iterations look 84% slower and W four
// times larger); a recovery clears what was measured. An iteration whose captures wrote more
// than warm_up_share of their bytes into memory never written before (the job's first
// windows, those after W changed: slots of other sizes, and a window that began while
// persisting lagged more than usual) is a warm-up and no sample: on first touch the kernel
// makes each page, which costs a fresh slot ten to twenty times its copy here
// (docs/benchmarks.md), once. (Whole windows were left out at first: under load, at W 1, one
// fresh slot in every few made every window a warm-up and W was never re-chosen.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>

#include "engine/head_recovery.hpp"

namespace moevement::recovery {

struct tuner_config {
  double max_overhead = 0.01;  // checkpoint.max_overhead (0: W stays Algorithm 1's)
  double mtbf_s = 0.0;         // > 0: the ETTR rule under this MTBF (checkpoint.window_rule)
  double restart_s = 0.0;      // a failure's cost besides the replay (its detection, at least)
  double cores = 0;            // the hosts' cores where the stages compute on the CPU; 0: GPU
  int ceiling = 0;             // the most operators any stage has (one per slot); 0: unknown
};

class window_tuner {
 public:
  static constexpr int min_iterations = 8;
  static constexpr double grow_at_most = 4.0;
  static constexpr int calm_decisions = 2;  // under a quarter of the bound, in a row, to halve
  static constexpr double warm_up_share = 0.05;
  static constexpr double min_ettr_gain = 1e-3;  // the ETTR rule moves W for more than this

  explicit window_tuner(tuner_config c) : c_(c) {}

  // One stepped iteration (not one of a recovery).
  void add(const engine::iteration_cost& c);
  void clear() { m_ = {}; }
  // The most operators any stage has, as the workers report them: a resumed job's stages
  // report theirs only once restored, after the tuner was made. It only rises.
  void raise_ceiling(int ops) { c_.ceiling = std::max(c_.ceiling, ops); }

  struct decision {
    int w = 1;              // the W for the window that starts
    int previous = 1;       // the W measured
    double overhead = 0.0;  // cost / (wall - cost) over what was measured
    int iterations = 0;     // how many
    double seconds = 0.0, stall_s = 0.0, log_s = 0.0, capture_cpu_s = 0.0;  // their sums
    double replication_cpu_s = 0.0;                                         // and this one's
    double cpu_share_s = 0.0;  // (capture_cpu_s + replication_cpu_s) / the cores, when it counts
    bool ettr_rule = false;    // chosen by the predicted ETTR (checkpoint.mtbf_s)
    double predicted_ettr = 0.0, previous_ettr = 0.0;  // at w, and at the W measured
    bool capped = false;  // w is the ceiling, below what the rule chose (or the W measured)
  };
  // The ETTR rule's prediction for window size w, from overhead o measured at w_measured and
  // the capture-free iteration time t.
  double predicted_ettr(int w, double o, int w_measured, double t) const;
  // At a window's start, the current W being w: the decision, or nullopt while too little of
  // this W is measured (warm-ups are not counted), or tuning is off.
  std::optional<decision> decide(int w);
  std::int64_t warm_ups() const { return warm_ups_; }

 private:
  struct measured {
    int iterations = 0;
    double seconds = 0.0, stall_s = 0.0, log_s = 0.0, capture_cpu_s = 0.0;
    double replication_cpu_s = 0.0;
    double cost = 0.0;                          // cost_of summed
    double worst_cost = -1, worst_seconds = 0;  // the iteration that cost the most
  };
  double cost_of(const engine::iteration_cost& c) const;
  tuner_config c_;
  measured m_;
  int calm_ = 0;  // decisions in a row under a quarter of the bound
  std::int64_t warm_ups_ = 0;
};

}  // namespace moevement::recovery
