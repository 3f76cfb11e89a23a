// models::stage on one GPU: the same layers, kernels in the same order and the same contract
// (stage.hpp in models/), with the activations, compute weights and gradients on the device.
// The host moe_model stays the owner of the training state: upload_weights() copies every
// operator's compute weights (their fp32 expansion) to the device, download_grads() copies the
// accumulated weight gradients back into the host operators. So the engine's optimizer,
// snapshots, frozen operators and replay work on the host state unchanged; the trainer
// (trainer.hpp) instead keeps master, m and v on the device and writes weights() directly.
// Boundary tensors and the loss come back to the host (they cross stages as exact fp32).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "models/cuda/kernels.hpp"
#include "models/model.hpp"

namespace moevement::models::cuda {

// operator_state::adamw_step on device copies of `op`'s state: AdamW over master, m and v
// ([numel] each) with gradient `grad` (times grad_mul), then the compute weights' fp32 values
// into `weights`; the step is counted on `op`. The CPU's bits. The trainer and the engine's
// GPU stage both step this way.
void step_operator(context& ctx, operator_state& op, float* master, float* m, float* v,
                   const float* grad, float* weights, const adamw_config& cfg, float grad_mul);

class stage {
 public:
  // Allocates the owned operators' device weights and gradients (zero) and uploads the
  // weights. Throws without a GPU.
  stage(context& ctx, moe_model& model, stage_range range, int micro_batch_size, int seq_len);
  ~stage();
  stage(const stage&) = delete;
  stage& operator=(const stage&) = delete;

  const stage_range& range() const { return range_; }
  int tokens() const { return b_ * t_; }

  // Host -> device: compute weights of every owned operator (active or frozen).
  void upload_weights();
  // Zero the device gradients; device -> host: add nothing, overwrite the host operators'
  // gradients of active operators with the device's accumulated ones.
  void zero_grads();
  void download_grads();
  // Device buffers of owned operator i (canonical index): [numel] each.
  float* weights(std::size_t i);
  float* grads(std::size_t i);

  // ---- The training state on the device (the engine's GPU stage; the trainer keeps its own).
  // Until the first step(), and again after host_changed(), the host operators are the current
  // copy and prepare() uploads their compute weights before each iteration (as
  // upload_weights()). step() runs AdamW on the device's master, m and v (uploaded from the
  // host first when they are not current there): from then on the device is current, the host
  // operators' step counters are kept, and sync_to_host() brings their master, m, v and
  // compute weights up to date. Frozen operators are never stepped.
  void prepare();
  // plan.apply false: nothing changes (the steps are not counted). grads_from_host: the host
  // operators' gradients go up first (reduced across replicas); else the device's own are used.
  void step(const step_plan& plan, const adamw_config& cfg, bool grads_from_host);
  bool state_on_device() const;
  // Per owned operator (range order): the fp64 sum of squares of its device gradient, as
  // operator_state::grad_sq_sum computes it on the host (0 when frozen), bit for bit.
  std::vector<double> grad_sq_sums();
  void sync_to_host();
  void host_changed();
  // Snapshot copies on a side stream, ordered after the last step(), overlapping whatever the
  // compute stream runs next (which only reads the state). dst: host memory of exactly the
  // tensor's size (page-locked for a DMA transfer). Throws std::logic_error unless
  // state_on_device(). compute: operator_state::compute_bytes's format, from the master.
  enum class tensor : std::uint8_t { master, adam_m, adam_v, compute };
  void copy_out(std::size_t i, tensor t, std::span<std::byte> dst);
  void wait_copies();
  std::shared_ptr<void> pin(std::span<std::byte> bytes);
  std::shared_ptr<std::byte[]> alloc_pinned(std::size_t n);
  // Seconds the side stream takes to fill dst from device memory (the operators' weights in
  // turn), the device idle first: the snapshot bandwidth Algorithm 1 plans with.
  double time_copy(std::span<std::byte> dst);

  // As models::stage::forward / backward; pointers are host memory. Frozen operators (by the
  // host operator's mode) get no weight gradient.
  models::stage::forward_result forward(int mb, const std::int32_t* tokens, const float* x_in,
                                        const std::int32_t* targets, bool training = true);
  std::span<const float> backward(int mb, const float* grad_out, float loss_grad);
  std::size_t in_flight() const;
  void abort();

  struct impl;

 private:
  void warm_up();
  std::unique_ptr<impl> impl_;
  stage_range range_;
  int b_, t_;
};

}  // namespace moevement::models::cuda
