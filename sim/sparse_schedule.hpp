// The sparse checkpoint schedule of MoEvement (paper: Algorithm 1, sections 3.2 and 3.5).
//
// Standalone on purpose: it depends only on the standard library so that it can move to
// recovery/sparse_schedule.{hpp,cpp} (issue 7) unchanged; the simulator uses it to predict
// W_sparse and replay costs, the recovery layer will use it to drive real snapshots.
//
// Definitions, as in the paper:
// - An operator is an independently snapshottable unit: each expert, each gate, each non-expert
//   block. Its state is FP32 master weights, optimizer state (Adam m and v) and 2-byte compute
//   weights derived from the master.
// - A window of W_sparse iterations has one slot per iteration. Slot i snapshots the FP32 state
//   (master + optimizer) of its `active` operators and the compute weights of the operators of
//   all later slots (`frozen`); operators of earlier slots are not in slot i at all.
// - FindWindowSize starts with every operator active and makes one fewer active per step until
//   the first slot's bytes / snapshot bandwidth fit in the iteration time, or only 2 are left.
// - Operators are ordered by ascending popularity (activation count), ties by index, so that
//   popular experts stay frozen longest during sparse-to-dense conversion.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace moevement::sim {

// One operator's state sizes in bytes and its popularity score (any of the orderings below).
struct sparse_op {
  std::uint64_t compute_bytes = 0;  // FP16/BF16 weights used by forward and backward
  std::uint64_t master_bytes = 0;   // FP32 master weights
  std::uint64_t optim_bytes = 0;    // optimizer state (Adam m + v)
  double popularity = 0;            // larger = more popular = snapshotted later
};

struct window_size {
  int w_sparse = 1;         // iterations per window: ceil(O_total / O_active)
  int o_active = 0;         // operators whose FP32 state each slot snapshots
  bool fits = true;         // false when even 2 active operators exceed the iteration time
  double slot_bytes = 0;    // bytes of the largest slot under the chosen O_active
  double slot_seconds = 0;  // slot_bytes / bandwidth
};

// Algorithm 1's FindWindowSize exactly as printed: every operator has the same sizes.
// Throws std::invalid_argument when an input is out of range (o_total 0, bandwidth <= 0, ...).
window_size find_window_size(std::size_t o_total, double t_iter_s, double s_compute,
                             double s_master, double s_optim, double bandwidth_bytes_per_s);

// The same search for operators of different sizes: for each candidate O_active the largest
// slot of the schedule over `ordered` (already in snapshot order) must fit. With equal sizes the
// largest slot is slot 0 and this returns exactly what the uniform version returns.
window_size find_window_size(std::span<const sparse_op> ordered, double t_iter_s,
                             double bandwidth_bytes_per_s);

// OrderOperators: indices of `ops` sorted by ascending popularity, ties by ascending index.
std::vector<std::size_t> order_by_popularity(std::span<const sparse_op> ops);

// Popularity scores of appendix B, for callers that keep counts per expert.
double time_decayed_popularity(double previous, double count_this_batch, double alpha);
double capacity_normalized_popularity(double count, double capacity);

struct schedule_slot {
  std::vector<std::size_t> active;  // FP32 master + optimizer snapshotted in this slot
  std::vector<std::size_t> frozen;  // compute weights snapshotted in this slot
};

// GenerateSchedule: slot i is active = order[i*A, min((i+1)*A, n)), frozen = order[end, n).
std::vector<schedule_slot> generate_schedule(std::span<const std::size_t> order, int w_sparse,
                                             int o_active);

// Bytes one slot snapshots.
double slot_bytes(const schedule_slot& slot, std::span<const sparse_op> ops);

// Empty when every operator in [0, n) is active in exactly one slot and frozen exactly in the
// slots before it; otherwise says what is wrong.
std::string check_schedule(std::span<const schedule_slot> schedule, std::size_t n);

// Which operators are active after loading slots 0..j during sparse-to-dense conversion
// (result[op] true when active); the rest replay forward and input gradients only.
std::vector<bool> active_after_slot(std::span<const schedule_slot> schedule, std::size_t n, int j);

// Section 3.5: reorder when the popularity of at least `fraction_threshold` of the operators
// changed by more than `change_threshold` relative to the old value (default 10% and 25%).
struct reorder_thresholds {
  double change_threshold = 0.10;
  double fraction_threshold = 0.25;
};
bool should_reorder(std::span<const double> old_popularity, std::span<const double> new_popularity,
                    reorder_thresholds thresholds = {});

}  // namespace moevement::sim
