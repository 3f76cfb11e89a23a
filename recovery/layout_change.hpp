// A durable window written at one layout (pp, dp, ep) restored into a stage of another (`moevement
// launch --resume` on another placement). Operators are the unit of state: every stage replica
// of the window's layout is loaded from its files, verified, and the whole old pipeline is
// replayed up to the target (the sparse-to-dense conversion, at the old dp: those iterations
// were trained so); the new stage then takes each of its operators, by name, from the old
// stage that had it (an expert from the replica whose block held it: the old EP groups compute
// each other's expert rows in the replay). The pipeline depth and the EP degree change no bit;
// a new dp changes the global batch from the target on.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>

#include "engine/resume_point.hpp"
#include "engine/stage_model.hpp"
#include "engine/stage_registry.hpp"

namespace moevement::recovery {

struct window_layout {
  int stages = 1, replicas = 1;
  int ep = 1;  // expert parallelism: each replica's files hold its block of experts
};

struct layout_restore {
  window_layout from;                // the window's layout
  std::filesystem::path root;        // checkpoint.dir (every stage replica's files under it)
  std::uint64_t window = 0;          // the durable window
  std::int64_t first_iteration = 0;  // w0: the window's first iteration
  int w_sparse = 0;                  // its slots
  std::int64_t target_iteration = 0;
  // The planned steps of w0 .. target - 1, as the coordinator sent them.
  std::map<std::int64_t, engine::planned_step> steps;
};

// Builds stage `setup` (this job's layout) at the start of in.target_iteration. Throws naming
// the stage replica, window or operator that is missing or does not verify. Runs on the
// calling thread (heavy: call it off the actor thread).
std::unique_ptr<engine::stage_model> restore_across_layouts(const layout_restore& in,
                                                            const engine::stage_factory& factory,
                                                            const engine::stage_setup& setup);

}  // namespace moevement::recovery
