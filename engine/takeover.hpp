// A standby head taking over from the live stages (cluster.standby_head, docs/recovery.md
// "Head failover"): every stage keeps running when the head is lost. The new coordinator asks
// each where it is (StageState: the iteration in flight dropped, the last one stepped, the
// step plans it keeps) and training goes on at the next iteration: only the iteration in
// flight is lost. A head lost while its Steps went out left some stages stepped and the
// others holding that iteration's reduced gradients: those are sent the same Step (the
// stepped ones kept its plan, place and popularity), and nothing is lost. Where the stages
// cannot agree (a rebuilt stage that never iterated, a gap in the step plans), every stage
// goes back to the durable tier's newest window instead, as a --resume does.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "base/result.hpp"
#include "engine/engine.capnp.h"
#include "engine/hooks.hpp"
#include "engine/resume_point.hpp"
#include "models/model.hpp"

namespace moevement::engine {

// One stage replica's answer (StageState), decoded.
struct stage_state {
  std::uint64_t epoch = 0;
  std::optional<std::int64_t> stepped;  // unknown: a rebuilt stage that has not iterated
  bool dropped = false;
  bool reduced = false;  // holds stepped + 1's reduced gradients, waiting for its Step
  std::uint64_t wiring = 0;
  checkpoint_place place;          // its last step's
  std::vector<double> popularity;  // its last Step's
  // The newest window the job persisted that it holds: id, first iteration.
  std::optional<std::pair<std::uint64_t, std::int64_t>> persisted;
  std::map<std::int64_t, planned_step> steps;
};
// Throws std::invalid_argument on a malformed answer (steps out of order or repeated).
stage_state read_stage_state(wire::StageState::Reader m);

// Where training goes on after a live takeover.
struct live_takeover {
  std::int64_t target = 0;     // the first iteration run under the new head
  models::loss_scaler scaler;  // before it
  // The journal's steps and the stages' since, from the journal's oldest window to target - 1.
  std::map<std::int64_t, planned_step> steps;
  std::uint64_t epoch = 0;        // the newest any stage saw (the next Iterate goes past it)
  std::uint64_t wiring = 0;       // likewise for the wiring
  std::uint64_t next_window = 0;  // the first window the new head places (past every stage's)
  int w_sparse = 0;               // the stages' window size (the journal's where none)
  bool dropped = false;           // an iteration was in flight (it runs again)
  // The newest window the lost head persisted, as the stages hold it (id, first iteration): a
  // window is persisted only once every stage replicated it, so the newest any stage was told
  // of is whole on every stage's replicators. None: the journal's window on disk is the newest.
  std::optional<std::pair<std::uint64_t, std::int64_t>> persisted;
  // Stages (index d * pp + s) holding reduced gradients no Step will come for: aborted, each
  // at its epoch.
  std::vector<std::pair<std::size_t, std::uint64_t>> drop;
  // The Step some stages lack (target - 1's): sent to each of `stages` at `epoch`, with the
  // popularity the stepped replicas of its stage got (empty where none did: all of that
  // stage's replicas then count nothing this step, alike).
  struct unfinished_step {
    std::int64_t iteration = 0;
    std::uint64_t epoch = 0;
    planned_step step;
    checkpoint_place place;
    std::vector<std::size_t> stages;
    std::vector<std::vector<double>> popularity;  // [stages.size()]
  };
  std::optional<unfinished_step> unfinished;
};

// The takeover from `states` (every stage replica's, index d * pp + s) on top of the
// journal's point `journal`, or why it cannot be live (the message says what disagrees).
result<live_takeover> plan_live_takeover(const std::vector<stage_state>& states,
                                         const resume_point& journal, int pp);

}  // namespace moevement::engine
