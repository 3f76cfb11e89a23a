// What one pipeline stage computes. The engine (the stage actor, the in-process pipeline, the
// replay) drives a stage_model: it decides the order (1F1B), moves boundary tensors, reduces
// gradients across replicas and steps the optimizer over operators(). A stage_model only
// computes. All calls come from one thread, never concurrently.
//
// The built-in model is the MoE transformer of models/ (make_moe_stage); a custom stage is
// another stage_model registered by name (stage_registry.hpp).
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "models/config.hpp"
#include "models/expert_shard.hpp"
#include "models/model.hpp"
#include "models/operator_state.hpp"

namespace moevement::engine {

// Where a stage sits in the job and what it trains.
struct stage_setup {
  models::model_config model;
  models::train_config train;  // train.data_parallel == replicas
  int stage = 0, stages = 1;
  int replica = 0, replicas = 1;
  // false: the stage's operators are loaded right after construction (a recovery from a
  // window), so a stage may skip its random init. A hint: custom stages may ignore it.
  bool initialize = true;
  bool first() const { return stage == 0; }
  bool last() const { return stage == stages - 1; }
};

// The EP rank of a stage replica: replica % ep of ep (expert parallelism; {0, 1} without it).
inline models::expert_split expert_split_of(const stage_setup& setup) {
  const int ep = setup.train.expert_parallel;
  return ep > 1 ? models::expert_split{setup.replica % ep, ep} : models::expert_split{};
}

struct stage_output {
  std::span<const float> activation;  // [B,T,C] to the next stage (empty on the last stage)
  double loss = 0.0;                  // last stage: mean cross-entropy of the micro-batch
  double aux_loss = 0.0;              // this stage's share of the load-balancing loss
};

// The training state of a stage that keeps it in device memory too (the MoE stage with
// train.device = cuda): the engine steps the optimizer there, and policies copy snapshots from
// there without stopping the compute. The host operators (stage_model::operators()) stay the
// form recovery reads and writes:
// - state_on_device(): after a step() the device's master, m and v are newer than the host's
//   (steps, names and modes on the host are always current);
// - sync_to_host() before reading the host's master, m, v or compute weights then;
// - host_changed() after writing them (a restore, a rollback): the device reloads them before
//   it computes or steps again.
// The replicas of a GPU stage summing their gradients on the device (NCCL; models/cuda/
// collectives.hpp), with the host path's bits. Every call runs on the stage's compute thread
// except what `stop` is: a flag the actor thread sets to abort a wait (a peer was lost).
class device_reduction {
 public:
  virtual ~device_reduction() = default;
  // A new group's id (replica 0 makes one per wiring and sends it to the others).
  virtual std::vector<std::byte> new_group_id() = 0;
  // Leaves the group held (aborted, never waiting on a peer) and starts joining `id`.
  virtual void join(std::span<const std::byte> id) = 0;
  struct result {
    bool ok = false;
    bool stopped = false;  // `stop` was set: aborted, nothing to report
    std::string error;     // neither: what went wrong
    double form_s = 0.0;   // the group's forming, when this call waited for it (else 0)
    double sum_s = 0.0;    // the sum itself
  };
  // Sums this iteration's device gradients across the replicas: every replica's then holds
  // the total. Waits for the group to form until `form_deadline` first.
  virtual result sum(std::chrono::steady_clock::time_point form_deadline,
                     const std::atomic<bool>& stop) = 0;
  // Aborts the group (if any); its seconds.
  virtual double leave() = 0;
};

class device_state {
 public:
  virtual ~device_state() = default;
  // Non-null where the replicas sum their gradients on the device (train.collectives): the
  // gradients then stay there, as with one replica.
  virtual device_reduction* reduction() { return nullptr; }
  // The optimizer step on the device, apply_step()'s arithmetic bit for bit. grads_from_host:
  // the host operators' gradients were changed (reduced across replicas): they go up first.
  virtual void step(const models::step_plan& plan, const models::train_config& train,
                    bool grads_from_host) = 0;
  virtual bool state_on_device() const = 0;
  // Whether this iteration's weight gradients stay on the device (the state is there and there
  // is one replica: nothing to reduce on the host). The host operators' gradients are then not
  // filled, and grad_sq_sums() gives gradient_sq_sums()'s values (bit for bit) from the
  // device's.
  virtual bool grads_on_device() const = 0;
  virtual std::vector<double> grad_sq_sums() = 0;
  virtual void sync_to_host() = 0;
  virtual void host_changed() = 0;

  // Snapshot copies, on a side stream ordered after the last step: copy_out queues a copy of
  // operator i's (operators() order) tensor into host memory `dst` of exactly its size and
  // returns; wait_copies() returns once every queued copy landed. Only while
  // state_on_device(). compute: the compute weights' bytes as operator_state::compute_bytes.
  enum class tensor : std::uint8_t { master, adam_m, adam_v, compute };
  virtual void copy_out(std::size_t i, tensor t, std::span<std::byte> dst) = 0;
  virtual void wait_copies() = 0;
  // Page-locks host memory the copies go to (page-aligned, as an mmap'd region), for DMA;
  // unlocked when the handle goes. alloc_pinned: page-locked memory of its own.
  virtual std::shared_ptr<void> pin(std::span<std::byte> bytes) = 0;
  virtual std::shared_ptr<std::byte[]> alloc_pinned(std::size_t n) = 0;
  // Seconds the side stream takes to copy dst.size() bytes of device memory into dst
  // (Algorithm 1's snapshot bandwidth; the device is idle first).
  virtual double time_copy(std::span<std::byte> dst) = 0;
};

class stage_model {
 public:
  virtual ~stage_model() = default;

  // Floats in one boundary tensor (activation or its gradient), e.g. B*T*C.
  virtual std::size_t boundary_floats() const = 0;
  // The operators this stage owns, in canonical order (the unit of state: snapshots, digests,
  // the optimizer step, gradient reduction all walk this list).
  virtual std::vector<models::operator_state*> operators() = 0;

  // Start of an iteration: the data position of later forwards. The engine has already
  // zeroed gradients (unless they stay on the device: device_state::grads_on_device) and
  // popularity counters.
  virtual void begin_iteration(std::int64_t iteration) = 0;
  // Forward of micro-batch `mb` of the current iteration. x_in: the previous stage's
  // activation [B,T,C] (empty on the first stage, which reads its tokens from the data
  // loader; the last stage reads its targets the same way). The output is valid until the
  // next call.
  virtual stage_output forward(int mb, std::span<const float> x_in) = 0;
  // Backward of micro-batch `mb` (after its forward). grad_out: gradient of this stage's
  // output (empty on the last stage). loss_grad = loss_scale / (micro_batches * replicas).
  // Accumulates weight gradients of active operators; returns the gradient of x_in (empty on
  // the first stage), valid until the next call.
  virtual std::span<const float> backward(int mb, std::span<const float> grad_out,
                                          float loss_grad) = 0;
  // Drops every micro-batch in flight (an aborted iteration). Weights are untouched.
  virtual void abort_iteration() = 0;
  // Validation forward of held-out batch `index` (no state kept, counters untouched).
  virtual stage_output validate(int index, std::span<const float> x_in) = 0;
  // The device copy of the training state, when the stage has one (see device_state);
  // nullptr: the host operators are the only copy (CPU stages, custom stages).
  virtual device_state* device() { return nullptr; }

  // Expert parallelism (train.expert_parallel > 1; models/expert_exchange.hpp): the experts
  // this replica holds, which compute the rows of every replica of its EP group; nullptr for a
  // stage without it. operators() then lists the non-experts and these experts only.
  virtual models::expert_shard* experts() { return nullptr; }
  // Where this stage's routed rows go (not owned; set before the first forward).
  virtual void set_expert_exchange(models::expert_exchange* /*exchange*/) {}
  virtual models::expert_exchange* expert_exchange() const { return nullptr; }
};

// A scope in which a stage's host operators are written (a restore, a rollback): a stage with
// a device_state syncs them first and hands them to the device when the scope ends, also when
// the writing threw half-way (the stage then holds what a CPU stage would).
class host_write_scope {
 public:
  explicit host_write_scope(stage_model& model) : device_(model.device()) {
    if (device_ != nullptr) device_->sync_to_host();
  }
  ~host_write_scope() {
    if (device_ != nullptr) device_->host_changed();
  }
  host_write_scope(const host_write_scope&) = delete;
  host_write_scope& operator=(const host_write_scope&) = delete;

 private:
  device_state* device_;
};

// The MoE transformer's stage: layers partition(model, stages)[stage], its operators
// initialised from train.seed exactly as the whole model's (models/model.hpp), the corpus
// loaded when the stage is first or last. Throws config_error on a bad setup.
std::unique_ptr<stage_model> make_moe_stage(const stage_setup& setup);

// ---- what the engine does over operators() (shared by the actor, the in-process pipeline
// and the replay, so all three produce the same bits)

// Zero every gradient (unless zero_grads is false: a GPU stage whose gradients stay on the
// device) and reset popularity counters.
void begin_operators(std::span<models::operator_state* const> ops, bool zero_grads = true);
// Floats in all gradients, in operator order (the all-reduce buffer).
std::size_t gradient_floats(std::span<models::operator_state* const> ops);
void copy_gradients_out(std::span<models::operator_state* const> ops, std::span<float> out);
void copy_gradients_in(std::span<models::operator_state* const> ops, std::span<const float> in);
// acc[j] = acc[j] + g[j]: one step of the left fold g_0 + g_1 + ... in replica order.
void accumulate(std::span<float> acc, std::span<const float> g);
// Per-operator sum of squared gradients (models::plan_step's input), in operator order.
std::vector<double> gradient_sq_sums(std::span<models::operator_state* const> ops);
// Compute-weight digests taken during a step (apply_step), and the seconds they took.
struct step_digests {
  std::vector<std::uint64_t> values;
  double seconds = 0.0;
};
// AdamW on every active operator when plan.apply. weights (optional): each operator's
// compute-weight digest (XXH3 of what the next forward uses) appended right after its update,
// while its bytes are still in cache (cheaper than a pass of its own).
void apply_step(std::span<models::operator_state* const> ops, const models::step_plan& plan,
                const models::train_config& train, step_digests* weights = nullptr);
// Per operator: the tokens its layer's gate routed to it in this iteration (experts; a
// gate's counters belong to the experts that follow it), 0 for the others. The popularity
// the sparse schedule orders by (paper section 3.5); soft: the summed gate probabilities
// instead (appendix B's soft count).
std::vector<double> operator_popularity(std::span<models::operator_state* const> ops,
                                        bool soft = false);
// Every operator's digest, in operator order (state_hash's input).
std::vector<std::uint64_t> operator_digests(std::span<models::operator_state* const> ops);
// Silent-corruption checks (docs/recovery.md "Silent data corruption"): per operator, XXH3 of
// its compute weights (weights, taken inside apply_step) or of its master, Adam m and v and
// step (state). Replicas of a stage hold the same bits, so their digests must be equal.
enum class verify_kind : std::uint8_t { none, weights, state };
std::vector<std::uint64_t> state_digests(std::span<models::operator_state* const> ops);

// Expert parallelism: the canonical order of a stage's operators over its EP ranks.
// kinds[k]: the kinds of EP rank k's operators() (the same non-experts on every rank, and a
// contiguous block of each layer's experts). Returns (rank, index in its list) in canonical
// order: each non-expert from rank 0, each layer's experts from rank 0, 1, ... in turn.
// Throws std::invalid_argument where the lists do not fit that shape.
struct operator_at {
  int rank = 0;
  std::size_t index = 0;
};
std::vector<operator_at> canonical_order(std::span<const std::vector<models::op_kind>> kinds);
std::vector<models::op_kind> operator_kinds(std::span<models::operator_state* const> ops);

// Expert parallelism and popularity. Each replica's gates count the tokens routed to every
// expert of their layer, held or not, so each EP rank can report its popularity in the
// canonical order (what operator_popularity gives on the whole stage, as with ep = 1): the
// coordinator sums those over every replica of the stage, and every copy of a block of experts
// then orders its sparse schedule by the same job-wide counts. ops: EP rank `split.index`'s
// operators(); a layer's expert block follows its gate (its experts, then the next layer's
// operators). With split.count 1 this is operator_popularity(ops, soft).
std::vector<double> canonical_popularity(std::span<models::operator_state* const> ops,
                                         models::expert_split split, bool soft = false);
// The other way: rank `split.index`'s share of a canonical popularity list, in its operators'
// order (its non-experts, and its block of each layer's experts). Throws std::invalid_argument
// when the list is not the length of the stage's canonical order.
std::vector<double> rank_popularity(std::span<const double> canonical,
                                    std::span<models::operator_state* const> ops,
                                    models::expert_split split);

}  // namespace moevement::engine
