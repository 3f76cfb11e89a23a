// The experts one replica holds under expert parallelism (models/expert_exchange.hpp): it
// computes the rows every replica of its EP group (the sources) routes to them, keeps what
// their backward needs per (source, layer, micro-batch), and accumulates each source's weight
// gradient apart, for the engine's fold in replica order.
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <span>
#include <tuple>
#include <vector>

#include "models/expert_exchange.hpp"
#include "models/model.hpp"

namespace moevement::models {

class expert_shard {
 public:
  // The experts `split` of the MoE layers of `range` (allocated in `model`), for `sources`
  // source replicas (split.count: the EP group).
  expert_shard(moe_model& model, stage_range range, expert_split split);
  // The same for any stage whose experts are GELU MLPs of the built-in kind (an operator with
  // w1 [d_model, d_ff] and w2 [d_ff, d_model]; a custom stage's, docs/custom-stages.md):
  // `held` is every held expert of the range's layers, layer by layer, split.last - split.first
  // of the `experts` of each layer.
  expert_shard(std::vector<operator_state*> held, int experts, int d_model, int d_ff,
               stage_range range, expert_split split);

  const expert_split& split() const { return split_; }
  int experts_per_layer() const { return experts_total_; }  // every rank's, E
  int d_model() const { return c_; }
  int sources() const { return split_.count; }
  // The held experts of every layer of the range, in canonical order.
  std::span<operator_state* const> experts() const { return experts_; }

  // Forward of source `source`'s rows of `layer`, micro-batch `mb`: rows[j] rows for the j-th
  // held expert of the layer, in order; xs and ye [sum rows, C]. training: keeps the activations
  // for backward(). Throws std::invalid_argument on shapes that do not fit, std::logic_error on a
  // forward already held.
  void forward(int source, int layer, int mb, std::span<const int> rows, std::span<const float> xs,
               std::span<float> ye, bool training);
  // Backward of that forward: d_ye -> d_xs, the weight gradients of active experts added to the
  // source's gradient. Frees the forward's activations.
  void backward(int source, int layer, int mb, std::span<const float> d_ye, std::span<float> d_xs);

  // Start of an iteration: every source gradient zeroed, every activation dropped.
  void begin_iteration();
  // An aborted iteration: activations dropped (gradients untouched).
  void abort();
  // Source `source`'s weight gradient of experts(), in their order and layout (as
  // engine::copy_gradients_out lays them out).
  std::span<const float> source_gradient(int source) const;
  // Forwards held for a backward.
  std::size_t in_flight() const { return cache_.size(); }
  // The stage's layers; their count is a source's backwards per micro-batch.
  const stage_range& range() const { return range_; }
  int layers() const { return range_.last_layer - range_.first_layer; }

 private:
  struct held {
    std::vector<int> rows;
    std::vector<float> xs, hpre, act;
  };
  using key = std::tuple<int, int, int>;  // source, layer, micro-batch
  // The held experts of `layer`: their index in experts_ of the first, and the count.
  std::size_t first_of(int layer) const;
  void check_call(int source, int layer, std::span<const int> rows, std::size_t floats,
                  std::size_t out_floats) const;

  int experts_total_, c_, f_;
  stage_range range_;
  expert_split split_;
  int per_layer_;  // held experts per layer
  std::vector<operator_state*> experts_;
  std::vector<std::size_t> grad_offset_;   // [experts_]: where each starts in a source gradient
  std::vector<std::vector<float>> grads_;  // [source]
  std::map<key, held> cache_;
  std::vector<held> spare_;  // buffers of finished backwards, reused
  std::vector<float> d_act_, d_hpre_;
};

// The exchange of one source replica whose EP group is in this process (the in-process
// engine, a spare's replay): each owner's shard is called directly.
class direct_exchange final : public expert_exchange {
 public:
  // group[k]: EP rank k's shard; source: this replica's EP rank.
  direct_exchange(std::vector<expert_shard*> group, int source, int experts, int d_model);
  void forward(int layer, int mb, std::span<const int> offsets, std::span<const float> xs,
               std::span<float> ye, bool training) override;
  void backward(int layer, int mb, std::span<const int> offsets, std::span<const float> d_ye,
                std::span<float> d_xs) override;

 private:
  // fn(owner, its experts' row counts, where their rows start and how many floats they are)
  // for each owner in rank order.
  void each_owner(std::span<const int> offsets,
                  const std::function<void(expert_shard&, const std::vector<int>&, std::size_t,
                                           std::size_t)>& fn);
  std::vector<expert_shard*> group_;
  int source_, experts_, c_;
};

}  // namespace moevement::models
