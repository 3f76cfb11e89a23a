// What a job needs, beside its stages' durable windows, to start again from them after the
// whole job was killed (`moevement launch --resume`): the head's share of a durable window.
// The coordinator makes one each time a window is on disk everywhere; recovery/resume_journal
// writes it beside the windows and reads it back.
#pragma once

#include <cstdint>
#include <map>

#include "models/model.hpp"

namespace moevement::engine {

// One iteration's optimizer step as the coordinator planned it (a replay applies the same).
struct planned_step {
  float loss_scale = 1.0f;
  models::step_plan plan;
  bool operator==(const planned_step& o) const {
    return loss_scale == o.loss_scale && plan.apply == o.plan.apply &&
           plan.grad_mul == o.plan.grad_mul && plan.grad_norm == o.plan.grad_norm;
  }
};

struct resume_point {
  std::uint64_t window = 0;           // the newest durable window on disk everywhere
  int w_sparse = 0;                   // iterations per window
  std::int64_t target_iteration = 0;  // the iteration training continues at
  models::loss_scaler scaler;         // before target_iteration
  // The layout the windows were written at (a resume may run at another: operators are the
  // unit of state, so the pipeline depth changes no bit; dp changes the global batch).
  int pp = 1, dp = 1;
  int ep = 1;  // and its expert parallelism (each replica's files hold its block of experts)
  // The durable windows the stages may still hold (id -> the first iteration it replays),
  // oldest first; `window` is the newest. A resume takes the newest every stage verifies.
  std::map<std::uint64_t, std::int64_t> windows;
  // Their sizes (W_sparse changes at a window's start; one not here has w_sparse's).
  std::map<std::uint64_t, int> window_sizes;
  // Every step from the oldest window's first iteration to target_iteration - 1.
  std::map<std::int64_t, planned_step> steps;
  // Not journaled: the journal drops its entries of windows newer than `window` as it writes
  // this one (a rollback past silent corruption left the timeline they belong to).
  bool drop_newer = false;
};

}  // namespace moevement::engine
