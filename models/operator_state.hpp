// An operator is the unit of training state (paper section 3.1): the embedding, each norm, each
// attention block, each gate, each expert, the head. It owns FP32 master weights, Adam m and v,
// its step, the 2-byte compute weights derived from the master (what forward and backward
// read), and the gradient buffer. A frozen operator has no usable master/m/v: its compute
// weights are supplied from outside (a snapshot) and it computes no weight gradient.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "models/tensor.hpp"

namespace moevement::models {

enum class op_kind : std::uint8_t { embedding, norm, attention, gate, expert, head };
enum class op_mode : std::uint8_t { active, frozen };
std::string_view op_kind_name(op_kind k);

struct param_spec {
  std::string name;
  std::vector<std::int64_t> shape;
  float init_std;  // 0: constant init_value instead
  float init_value;
  bool decay;  // weight decay applies (matrices); never norms, embeddings
};

struct adamw_config {
  float lr, beta1, beta2, eps, weight_decay;
};

// AdamW's bias corrections 1 - beta1^step and 1 - beta2^step (step counted from 1): in fp64,
// then one rounding to fp32. The one definition the CPU and the CUDA optimizer share.
struct adamw_bias {
  float bc1, bc2;
};
adamw_bias adamw_bias_corrections(const adamw_config& cfg, std::int64_t step);

class operator_state {
 public:
  // allocate false: an operator another stage owns (as after release(), without ever
  // allocating: a stage of a big model need not touch the whole model's memory).
  operator_state(std::string name, op_kind kind, std::vector<param_spec> params, dtype compute,
                 bool allocate = true);

  const std::string& name() const { return name_; }
  op_kind kind() const { return kind_; }
  op_mode mode() const { return mode_; }
  dtype compute_dtype() const { return dtype_; }
  std::size_t param_count() const { return params_.size(); }
  const param_spec& param(std::size_t i) const { return params_[i]; }
  std::int64_t numel() const { return numel_; }
  // Where parameter p starts in master, m, v, the gradient and the compute weights; p ==
  // param_count() gives numel().
  std::int64_t param_offset(std::size_t p) const { return offsets_[p]; }

  // Counter-based init: element j of parameter p is normal(key(seed, op_index, p), j).
  void init(std::uint64_t seed, std::uint64_t op_index);

  // FP32 training state.
  std::span<float> master() { return master_; }
  std::span<const float> master() const { return master_; }
  std::span<float> adam_m() { return m_; }
  std::span<const float> adam_m() const { return m_; }
  std::span<float> adam_v() { return v_; }
  std::span<const float> adam_v() const { return v_; }
  std::int64_t step() const { return step_; }
  void set_step(std::int64_t s) { step_ = s; }

  // The compute weights (numel * dtype_size bytes) and their exact fp32 expansion, which the
  // kernels read: weight(p) points at parameter p.
  std::span<const std::byte> compute_bytes() const { return compute_; }
  const float* weight(std::size_t p) const { return expanded_.data() + offsets_[p]; }
  // Re-derives compute weights from the master (after an update or a restore).
  void refresh_compute();
  // Frozen operators: take compute weights from a snapshot (size must match).
  void set_compute_bytes(std::span<const std::byte> bytes);

  // Switch mode. Frozen -> active expects master/m/v/step restored first (the caller's job);
  // the compute weights are then re-derived from the master.
  void set_mode(op_mode m);

  // Gradient of parameter p, or nullptr when frozen (kernels then skip the weight gradient).
  float* grad(std::size_t p) {
    return mode_ == op_mode::active ? grad_.data() + offsets_[p] : nullptr;
  }
  std::span<float> grad() { return grad_; }
  std::span<const float> grad() const { return grad_; }
  void zero_grad();
  // sum of grad^2 in element order, in fp64 (0 when frozen).
  double grad_sq_sum() const;

  // One AdamW step on g = grad * grad_mul (grad_mul folds in clipping and loss unscaling);
  // step += 1, then refresh_compute(). No-op when frozen.
  void adamw_step(const adamw_config& cfg, float grad_mul);

  // xxhash64 over master, m, v (bytes, in parameter order) then step: this operator's share of
  // the model's state_hash.
  std::uint64_t digest() const;

  // Popularity counters (gates): routed assignments per expert and summed gate probabilities,
  // accumulated by forward, cleared by the caller at the start of an iteration.
  std::vector<std::int64_t>& routed_tokens() { return routed_tokens_; }
  std::vector<double>& prob_sums() { return prob_sums_; }
  const std::vector<std::int64_t>& routed_tokens() const { return routed_tokens_; }
  const std::vector<double>& prob_sums() const { return prob_sums_; }
  void reset_popularity();

  // Frees every buffer (an operator another stage owns); allocated() is then false and the
  // operator must not be used.
  void release();
  bool allocated() const { return allocated_; }

 private:
  std::string name_;
  op_kind kind_;
  op_mode mode_ = op_mode::active;
  dtype dtype_;
  std::vector<param_spec> params_;
  std::vector<std::int64_t> offsets_;  // [params+1]
  std::int64_t numel_ = 0;
  std::vector<float> master_, m_, v_, grad_, expanded_;
  std::vector<std::byte> compute_;
  std::int64_t step_ = 0;
  bool allocated_ = true;
  std::vector<std::int64_t> routed_tokens_;
  std::vector<double> prob_sums_;
};

}  // namespace moevement::models
