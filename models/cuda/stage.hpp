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
