// Expert parallelism (parallel.ep): the experts of every MoE layer are sharded over the `ep`
// consecutive replicas of an EP group; the rows a replica's gate routes to an expert are
// computed by the replica that holds it (docs/engine.md, "Expert parallelism").
//
// Bit-exactness for any ep: an expert computes each source replica's rows of a micro-batch in
// one call, exactly as that replica would with every expert (same rows, same order, same
// kernels), and accumulates their weight gradient per source replica; the engine then folds
// the sources in replica order, as data parallelism folds replicas.
#pragma once

#include <span>

namespace moevement::models {

class operator_state;

// Which experts of every layer a process holds: block `index` of `count` contiguous blocks of
// experts/count each (count divides the expert count: models::validate).
struct expert_split {
  int index = 0, count = 1;
  int first(int experts) const { return index * (experts / count); }
  int last(int experts) const { return (index + 1) * (experts / count); }
  bool holds(int expert, int experts) const {
    return expert >= first(experts) && expert < last(experts);
  }
  // The EP rank holding `expert`.
  int owner(int expert, int experts) const { return expert / (experts / count); }
};

// Where a stage's routed rows are computed. offsets [E+1]: the rows of each expert, grouped by
// expert (cpu::routing::offsets); xs and ye are [rows, C].
class expert_exchange {
 public:
  virtual ~expert_exchange() = default;
  // Fills ye with every expert's output for its rows. training = false (validation): nothing is
  // kept for a backward.
  virtual void forward(int layer, int mb, std::span<const int> offsets, std::span<const float> xs,
                       std::span<float> ye, bool training) = 0;
  // The backward of the same (layer, mb)'s forward: fills d_xs from d_ye (the gradient of ye).
  virtual void backward(int layer, int mb, std::span<const int> offsets,
                        std::span<const float> d_ye, std::span<float> d_xs) = 0;
};

// One expert on `rows` rows: hpre = xs W1, act = gelu(hpre), ye = act W2 (xs [rows,C], hpre and
// act [rows,F], ye [rows,C]).
void expert_forward(const operator_state& ex, int rows, int c, int f, const float* xs, float* hpre,
                    float* act, float* ye);
// Its backward: d_xs [rows,C] from d_ye; dw1 += xs^T d_hpre and dw2 += act^T d_ye (skipped when
// null: a frozen expert). d_act and d_hpre are [rows,F] scratch.
void expert_backward(const operator_state& ex, float* dw1, float* dw2, int rows, int c, int f,
                     const float* d_ye, const float* xs, const float* hpre, const float* act,
                     float* d_act, float* d_hpre, float* d_xs);

}  // namespace moevement::models
