// The MoE transformer: operators in canonical order, and stages (contiguous ranges of layers)
// that run forward and backward per micro-batch on supplied inputs.
//
// Per layer (pre-norm):  h = x + attention(rmsnorm1(x));  y = h + moe(rmsnorm2(h))
//   moe(u) = sum over the token's top-k experts j, in slot order, of p_j(u) * expert_j(u)
//   expert_j(u) = gelu(u W1_j) W2_j      W1_j [C,F], W2_j [F,C]
// Model: x0 = wte[tokens] + wpe[t];  layers;  logits = rmsnorm_f(x_L) W_head  [N,V]
//
// Canonical operator order (state_hash, snapshots): embedding; for each layer l: norm1,
// attention, norm2, gate, expert 0..E-1; final norm; head.
//
// Bit-exactness across partitions: a stage computes exactly the same kernels on the same
// inputs as the whole model does, and weight gradients are accumulated in micro-batch order
// (the caller runs backward of micro-batches 0..M-1 in order, as 1F1B does). So pipelining
// changes no bit, provided activations and gradients cross stage boundaries as exact fp32.
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <vector>

#include "models/config.hpp"
#include "models/cpu/kernels.hpp"
#include "models/expert_exchange.hpp"
#include "models/operator_state.hpp"

namespace moevement::models {

class moe_model {
 public:
  // Builds every operator (names, shapes) but allocates and initialises state only for the
  // owned range [first_op, last_op) (default: all), e.g. a pipeline stage's operators; init is
  // counter-based per operator, so a partial model holds exactly the full model's values.
  // initialize = false leaves the owned operators' state zero (master, m, v, compute): for a
  // model whose every operator is loaded next (a recovery from a window), where the random
  // init would be overwritten anyway. experts: under expert parallelism, only this block of
  // every layer's experts is owned (models/expert_exchange.hpp).
  moe_model(const model_config& cfg, std::uint64_t seed, std::size_t first_op = 0,
            std::size_t last_op = std::size_t(-1), bool initialize = true,
            expert_split experts = {});

  const model_config& config() const { return cfg_; }
  std::vector<operator_state>& ops() { return ops_; }
  const std::vector<operator_state>& ops() const { return ops_; }

  // Canonical indices.
  std::size_t embedding() const { return 0; }
  std::size_t norm1(int layer) const { return layer_base(layer); }
  std::size_t attention(int layer) const { return layer_base(layer) + 1; }
  std::size_t norm2(int layer) const { return layer_base(layer) + 2; }
  std::size_t gate(int layer) const { return layer_base(layer) + 3; }
  std::size_t expert(int layer, int e) const { return layer_base(layer) + 4 + std::size_t(e); }
  std::size_t final_norm() const { return ops_.size() - 2; }
  std::size_t head() const { return ops_.size() - 1; }

  // xxhash64 over every operator's digest() in canonical order (see state_hash()).
  std::vector<std::uint64_t> op_digests() const;
  // Digests of operators [first, last) (all must be allocated), for gathering across stages.
  std::vector<std::uint64_t> op_digests(std::size_t first, std::size_t last) const;

 private:
  std::size_t layer_base(int layer) const { return 1 + std::size_t(layer) * (4 + cfg_.experts); }
  model_config cfg_;
  std::vector<operator_state> ops_;
};

// A contiguous range of layers [first_layer, last_layer); stage 0 also owns the embedding and
// the last stage the final norm and head. Operators [first_op, last_op) in canonical order.
struct stage_range {
  int first_layer = 0, last_layer = 0;
  bool has_embedding = false, has_head = false;
  std::size_t first_op = 0, last_op = 0;
};
// Splits the layers into `stages` contiguous ranges, as even as possible (earlier stages get
// the extra layers). Throws std::invalid_argument when stages > layers or < 1.
std::vector<stage_range> partition(const model_config& cfg, int stages);

class stage {
 public:
  // experts: the block of experts the model holds (expert parallelism, split.count > 1): the
  // routed rows are then computed through set_exchange()'s exchange, never here.
  stage(moe_model& model, stage_range range, int micro_batch_size, int seq_len,
        expert_split experts = {});
  // Where the routed rows go under expert parallelism (not owned; before the first forward).
  void set_exchange(expert_exchange* exchange) { exchange_ = exchange; }
  expert_exchange* exchange() const { return exchange_; }

  const stage_range& range() const { return range_; }
  int tokens() const { return b_ * t_; }  // N = B*T rows of every activation

  struct forward_result {
    std::span<const float> activation;  // [B,T,C] output (not on the last stage)
    double loss = 0.0;                  // mean cross-entropy of this micro-batch (last stage only)
    double aux_loss = 0.0;              // sum over this stage's layers of the load-balancing loss
  };
  // Forward of micro-batch `mb`. The first stage reads tokens [B,T]; the others x_in [B,T,C].
  // The last stage needs targets [B,T]. With training=false (validation) nothing is kept and
  // popularity counters are untouched; the activation is then valid until the next forward.
  forward_result forward(int mb, const std::int32_t* tokens, const float* x_in,
                         const std::int32_t* targets, bool training = true);
  // Backward of micro-batch `mb` (its forward must have run with training=true).
  // grad_out [B,T,C] is the gradient of the stage output (nullptr on the last stage).
  // loss_grad = loss_scale / micro_batches: the gradient the iteration loss puts on this
  // micro-batch's mean loss (also scales the auxiliary losses). Weight gradients of active
  // operators are accumulated; returns the gradient of x_in (empty on the first stage), valid
  // until the next backward. Frees the micro-batch's activations.
  std::span<const float> backward(int mb, const float* grad_out, float loss_grad);

  // Micro-batches whose activations are held (forward done, backward not yet).
  std::size_t in_flight() const { return cache_.size(); }
  // Drops every micro-batch in flight (an aborted iteration); their buffers are kept for reuse.
  // Weights and gradients are untouched.
  void abort();

 private:
  struct layer_cache {
    std::vector<float> x;  // [N,C] input (the residual stream)
    std::vector<float> n1, rstd1, qkv, att, yatt, h, n2, rstd2, glogits;
    cpu::routing route;
    std::vector<float> xs, hpre, act, ye;  // [rows,C] [rows,F] [rows,F] [rows,C]
  };
  struct mb_cache {
    std::vector<std::int32_t> tokens, targets;
    std::vector<layer_cache> layers;
    std::vector<float> out;               // [N,C] output of the last layer
    std::vector<float> nf, rstdf, probs;  // head: [N,C] [N] [N,V]
  };
  void layer_forward(int l, int mb, layer_cache& c, float* out, bool training);
  void layer_backward(int l, int mb, layer_cache& c, const float* dout, float* dx, float loss_grad);
  // The routed rows' expert outputs c.ye from c.xs: here, or through the exchange.
  void experts_forward(int l, int mb, layer_cache& c, bool training);
  // d_xs_ from d_ye_ (and the local experts' weight gradients).
  void experts_backward(int l, int mb, layer_cache& c);
  operator_state& op(std::size_t i) { return model_.ops()[i]; }

  moe_model& model_;
  stage_range range_;
  int b_, t_;
  expert_split split_;
  expert_exchange* exchange_ = nullptr;
  std::map<int, mb_cache> cache_;
  std::vector<mb_cache> spare_;  // finished caches, kept so their buffers are reused
  // scratch reused across calls (no state between calls)
  std::vector<float> d_a_, d_b_, d_c_, d_qkv_, d_att_, d_logits_, d_weight_, d_ye_, d_xs_, d_h_;
  std::vector<float> h_logits_, h_losses_, h_dlogits_, h_dnf_, d_cur_, d_next_;
  std::vector<float> grad_in_;
  std::vector<float> val_out_;  // [N,C] validation output (training=false keeps no cache)
};

// Dynamic loss scaling for fp16 compute weights; part of the training state (in state_hash).
struct loss_scaler {
  bool enabled = false;  // f16 only
  float scale = 1.0f;
  std::int32_t good_steps = 0;
  std::int32_t window = 200;
  // After the gradients of an iteration: overflow halves the scale and skips the step;
  // `window` good steps in a row double it. Returns whether to apply the step.
  bool update(bool finite);
};

// How to apply one optimizer step, from the per-operator sums of squared gradients in
// canonical order (each stage computes its own; the engine gathers them in that order).
struct step_plan {
  bool apply = true;       // false: fp16 overflow, skip the update
  double grad_norm = 0.0;  // of the unscaled gradient
  float grad_mul = 1.0f;   // multiply gradients by this: clipping and loss unscaling
};
step_plan plan_step(std::span<const double> per_op_sq, loss_scaler& scaler, float grad_clip);

// xxhash64 over the operators' digests in canonical order, then the loss scaler's state.
// Partition-independent: any placement yields the same digests in the same order.
std::uint64_t state_hash(std::span<const std::uint64_t> op_digests, const loss_scaler& scaler);

}  // namespace moevement::models
