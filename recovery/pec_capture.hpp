// MoC-System's partial experts checkpointing (PEC, seed 002 section 3), in process:
// every k iterations a checkpoint of one stage replica holding every non-expert operator in
// full and K experts of each MoE layer in full (the other experts are not in it at all).
// Which K: sequential (round robin over the layer's experts, offset by the layer's ordinal in
// the stage so that layers take turns: MoC's interleaving) or load-aware (the K experts with
// the most routed tokens since their own last save; ties by the sequential order).
//
// - pec_schedule (one per stage, shared by its replicas, like sparse_capture's
//   stage_schedule): the selection of each checkpoint (fixed once asked for, the same for
//   every replica), when each operator was last saved, and the routed-token counts per
//   expert and iteration summed over replicas (what load-aware selection and PLT need).
// - pec_capture (engine::stage_hooks of one (stage, replica)): writes each checkpoint in the
//   snapshot.hpp format (window = checkpoint number, slot 0) into host buffers, and keeps
//   every checkpoint that is still some operator's latest save (as of the newest checkpoint
//   or the one before it); buffers of dropped checkpoints are reused.
//
// Checkpoint points as for the dense policies: after the step of iteration i when
// (i + 1) % k == 0, holding the state at the start of i + 1. An expert never saved is at its
// initial state (iteration 0): a recovery takes it from freshly built stages.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/hooks.hpp"
#include "models/expert_exchange.hpp"
#include "recovery/policy_config.hpp"
#include "recovery/snapshot.hpp"

namespace moevement::recovery {

// One MoE layer of a stage: its gate and the routed experts this worker holds (operator
// indices). Under expert parallelism a worker holds a block of the layer's experts: held
// expert j is the layer's expert first + j of total.
struct moe_layer {
  std::size_t gate = 0;
  std::string name;  // the gate's name, e.g. "layer3.gate"
  std::vector<std::size_t> experts;
  std::size_t first = 0;  // the layer's index of experts[0]
  std::size_t total = 0;  // the layer's experts (the gate's routed_tokens().size())
};

// The MoE layers of a stage's operators: each gate followed by the next expert operators it
// routes to that `split` holds (all routed_tokens().size() of them without EP; the models/
// layout).
std::vector<moe_layer> find_moe_layers(std::span<const models::operator_state* const> ops,
                                       models::expert_split split = {});

class pec_schedule {
 public:
  // experts: K per layer (>= 1; more than a layer has saves all of them). interval >= 1.
  // split: the block of experts this worker holds (expert parallelism): the selection is the
  // layer's, the same on every EP rank, and each rank saves the selected experts it holds, so
  // that the job's checkpoints are those of ep = 1. Load-aware selection ranks every expert
  // of a layer, which a rank does not count: refused with EP.
  pec_schedule(int experts, pec_selection order, int interval,
               std::span<models::operator_state* const> ops, models::expert_split split = {});

  int interval() const { return interval_; }
  int experts_per_checkpoint() const { return k_; }
  pec_selection order() const { return order_; }
  std::size_t operators() const { return n_; }
  const std::vector<moe_layer>& layers() const { return layers_; }
  bool is_checkpoint(std::int64_t iteration) const { return (iteration + 1) % interval_ == 0; }

  // One replica's routed-token counters after the step of `iteration` (the gates' counts).
  void add_counts(std::int64_t iteration, std::span<models::operator_state* const> ops);
  // The same from per-operator counts (engine::operator_popularity, e.g. summed over the
  // stage's replicas by the coordinator, so that every replica keeps the same counts).
  void add_popularity(std::int64_t iteration, std::span<const double> popularity);
  // Per operator: tokens routed to it since its newest save, up to iteration `to` (0 for
  // non-experts): what a rollback to `to` loses of each stale expert.
  std::vector<std::int64_t> unsaved_tokens(std::int64_t to) const;
  // After a global rollback to state iteration c: each operator's newest save (<= c) and the
  // tokens routed to it since (unsaved_tokens(c) as it was), so that later checkpoints and
  // counts go on from c.
  void restart(std::int64_t c, std::span<const std::int64_t> saved_at,
               std::span<const std::int64_t> unsaved);

  // What the checkpoint after the step of `iteration` holds of each operator (full or skip).
  // Fixed at the first call for that iteration; load-aware ranks by the counts of the
  // iterations before `iteration` (every replica has reported those by then). Checkpoints
  // must be asked for in increasing iteration order.
  const std::vector<capture_kind>& checkpoint_kinds(std::int64_t iteration);

  // The state iteration of operator i's newest full save (0: never saved, initial state).
  std::int64_t saved_at(std::size_t op) const { return saved_at_.at(op); }
  // Tokens routed to expert operator `op` in iterations [from, to), over every replica.
  // Throws std::out_of_range when counts of that range were already dropped.
  std::int64_t routed_tokens(std::size_t op, std::int64_t from, std::int64_t to) const;

 private:
  int k_;
  pec_selection order_;
  int interval_;
  std::size_t n_;
  std::vector<moe_layer> layers_;
  std::vector<int> layer_of_;  // [op]: layer index, -1 for non-experts
  std::map<std::int64_t, std::vector<std::int64_t>> counts_;  // [iteration][op]
  std::map<std::int64_t, std::vector<capture_kind>> selections_;
  std::vector<std::int64_t> saved_at_, prev_saved_at_;
  std::int64_t first_count_kept_ = 0;
};

struct pec_checkpoint_view {
  std::int64_t iteration = 0;  // state at the start of this iteration
  std::span<const std::byte> bytes;
};

class pec_capture : public engine::stage_hooks {
 public:
  // schedule: the stage's (shared by its replicas, outlives this). scaler: the job's loss
  // scaler, read at each checkpoint (nullptr: disabled, scale 1).
  pec_capture(pec_schedule& schedule, int stage, int replica,
              const models::loss_scaler* scaler = nullptr);

  void after_step(std::int64_t iteration, std::span<models::operator_state* const> ops) override;
  // Counts the next after_step gives the schedule (add_popularity) instead of this replica's
  // own gates' (empty: the gates').
  void set_popularity(std::span<const double> popularity) {
    popularity_.assign(popularity.begin(), popularity.end());
  }
  // After a global rollback to state iteration c: the checkpoints (<= c) still held, and per
  // operator the state iteration of the checkpoint holding its newest save (0: initial).
  void restart(std::map<std::int64_t, std::vector<std::byte>> held,
               std::vector<std::int64_t> latest);

  int stage() const { return stage_; }
  int replica() const { return replica_; }
  const pec_schedule& schedule() const { return schedule_; }
  // Checkpoints held, oldest first (views valid until the next after_step).
  std::vector<pec_checkpoint_view> held() const;
  std::optional<std::int64_t> newest() const;

  std::uint64_t checkpoints() const { return checkpoints_; }
  std::size_t last_checkpoint_bytes() const { return last_bytes_; }
  double last_checkpoint_seconds() const { return last_seconds_; }
  std::size_t bytes_held() const;

 private:
  pec_schedule& schedule_;
  int stage_, replica_;
  const models::loss_scaler* scaler_;
  std::vector<double> popularity_;
  std::map<std::int64_t, std::vector<std::byte>> held_;  // [state iteration]
  std::vector<std::vector<std::byte>> spare_;
  std::vector<std::int64_t> latest_, prev_latest_;  // [op]: checkpoint holding its newest save
  std::uint64_t checkpoints_ = 0;
  std::size_t last_bytes_ = 0;
  double last_seconds_ = 0;
};

// pec's trailer after each checkpoint's snapshot bytes: per operator, the state iteration of
// its newest save at this checkpoint (0: never saved) and the tokens routed to it since
// (summed over the stage's replicas). What a rollback to this checkpoint restores and loses.
struct pec_meta {
  std::vector<std::int64_t> saved_at, unsaved;
};
std::vector<std::byte> encode_pec_meta(const pec_meta& meta);
// Throws snapshot_error when the bytes are not a trailer of `ops` operators.
pec_meta decode_pec_meta(std::span<const std::byte> bytes, std::size_t ops);

}  // namespace moevement::recovery
