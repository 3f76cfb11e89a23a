// The built-in stage: a slice of the MoE transformer of models/ (make_moe_stage).
#include <optional>
#include <string>
#include <vector>

#include "engine/stage_model.hpp"
#include "models/cpu/gemm.hpp"
#include "models/cuda/device.hpp"
#include "models/cuda/stage.hpp"
#include "models/data.hpp"

namespace moevement::engine {
namespace {

// The GPU stage's training state on the device (train.device = cuda), for the engine.
class gpu_state final : public device_state {
 public:
  gpu_state(models::cuda::stage& gpu, std::size_t first_op, bool one_replica)
      : gpu_(gpu), first_(first_op), one_replica_(one_replica) {}
  void step(const models::step_plan& plan, const models::train_config& train,
            bool grads_from_host) override {
    const models::adamw_config cfg{train.lr, train.beta1, train.beta2, train.eps,
                                   train.weight_decay};
    gpu_.step(plan, cfg, grads_from_host);
  }
  bool state_on_device() const override { return gpu_.state_on_device(); }
  bool grads_on_device() const override { return one_replica_ && gpu_.state_on_device(); }
  std::vector<double> grad_sq_sums() override { return gpu_.grad_sq_sums(); }
  void sync_to_host() override { gpu_.sync_to_host(); }
  void host_changed() override { gpu_.host_changed(); }
  void copy_out(std::size_t i, tensor t, std::span<std::byte> dst) override {
    gpu_.copy_out(first_ + i, models::cuda::stage::tensor(t), dst);
  }
  void wait_copies() override { gpu_.wait_copies(); }
  std::shared_ptr<void> pin(std::span<std::byte> bytes) override { return gpu_.pin(bytes); }
  std::shared_ptr<std::byte[]> alloc_pinned(std::size_t n) override { return gpu_.alloc_pinned(n); }
  double time_copy(std::span<std::byte> dst) override { return gpu_.time_copy(dst); }

 private:
  models::cuda::stage& gpu_;
  std::size_t first_;
  bool one_replica_;
};
static_assert(int(device_state::tensor::compute) == int(models::cuda::stage::tensor::compute));

class moe_stage final : public stage_model {
 public:
  moe_stage(const stage_setup& setup, const models::stage_range& range)
      : setup_(setup),
        model_(setup.model, setup.train.seed, range.first_op, range.last_op, setup.initialize),
        stage_(model_, range, setup.train.micro_batch_size, setup.train.seq_len) {
    if (setup.first() || setup.last()) {
      corpus_.emplace(
          models::corpus::load(setup.train.corpus, setup.train.val_fraction, setup.train.seq_len));
    }
    const std::size_t n = std::size_t(stage_.tokens());
    tokens_.resize(n);
    targets_.resize(n);
    for (std::size_t i = range.first_op; i < range.last_op; ++i) ops_.push_back(&model_.ops()[i]);
    if (setup.train.device == models::device::cuda) {
      // The GPU computes. Once the engine steps on the device (device()), master, m and v live
      // there too and the host operators are a mirror the engine syncs when it reads them;
      // until then (a replay, the in-process pipeline) they are the state: weights go up each
      // iteration. Gradients come back after the last backward (reduction, clipping norms).
      // One GPU per worker where several are visible: the worker's rank in the job (a spare
      // takes the rank of the stage it rebuilds, and the GPU its predecessor freed).
      const int rank = setup.replica * setup.stages + setup.stage;
      ctx_ = std::make_unique<models::cuda::context>(rank % models::cuda::device_count());
      gpu_ = std::make_unique<models::cuda::stage>(
          *ctx_, model_, range, setup.train.micro_batch_size, setup.train.seq_len);
      state_ = std::make_unique<gpu_state>(*gpu_, range.first_op, setup.replicas == 1);
    }
  }

  std::size_t boundary_floats() const override {
    return std::size_t(stage_.tokens()) * std::size_t(setup_.model.d_model);
  }
  std::vector<models::operator_state*> operators() override { return ops_; }

  void begin_iteration(std::int64_t iteration) override {
    stage_.abort();  // nothing of an earlier iteration may survive into this one
    iteration_ = iteration;
    backwards_ = 0;
    if (gpu_) {
      gpu_->abort();
      gpu_->prepare();  // the host's weights, when the host holds the state
      gpu_->zero_grads();
    }
  }

  stage_output forward(int mb, std::span<const float> x_in) override {
    if (mb < 0 || mb >= setup_.train.micro_batches) {
      throw std::out_of_range("moe_stage::forward: micro-batch " + std::to_string(mb) +
                              " is not in [0, train.micro_batches)");
    }
    check_boundary(x_in, !setup_.first(), "x_in");
    fill(models::split::train, iteration_, setup_.replica, mb);
    const float* x = x_in.empty() ? nullptr : x_in.data();
    const auto r = gpu_ ? gpu_->forward(mb, tokens_.data(), x, targets_.data())
                        : stage_.forward(mb, tokens_.data(), x, targets_.data());
    return {r.activation, r.loss, r.aux_loss};
  }

  std::span<const float> backward(int mb, std::span<const float> grad_out,
                                  float loss_grad) override {
    check_boundary(grad_out, !setup_.last(), "grad_out");
    const float* g = grad_out.empty() ? nullptr : grad_out.data();
    if (!gpu_) return stage_.backward(mb, g, loss_grad);
    const auto dx = gpu_->backward(mb, g, loss_grad);
    // 1F1B runs the backwards of micro-batches 0..M-1 in order: after the last one the
    // device holds the iteration's accumulated gradients
    // (the host's copy: the engine reduces or sums it there, unless they stay on the device)
    if (++backwards_ == setup_.train.micro_batches && !state_->grads_on_device()) {
      gpu_->download_grads();
    }
    return dx;
  }

  void abort_iteration() override {
    stage_.abort();
    if (gpu_) gpu_->abort();
    backwards_ = 0;
  }

  stage_output validate(int index, std::span<const float> x_in) override {
    check_boundary(x_in, !setup_.first(), "x_in");
    // the trainer's validation batches: (seed, val, index, replica 0, micro-batch 0)
    fill(models::split::val, index, 0, 0);
    const float* x = x_in.empty() ? nullptr : x_in.data();
    // validation runs after the step (and after a recovery's loads), before the next
    // begin_iteration: the device needs the current weights (the host's, if it holds them)
    if (gpu_) gpu_->prepare();
    const auto r = gpu_ ? gpu_->forward(-1, tokens_.data(), x, targets_.data(), false)
                        : stage_.forward(-1, tokens_.data(), x, targets_.data(), false);
    return {r.activation, r.loss, r.aux_loss};
  }

  device_state* device() override { return state_.get(); }

 private:
  void check_boundary(std::span<const float> t, bool needed, const char* what) const {
    const std::size_t want = needed ? boundary_floats() : 0;
    if (t.size() != want) {
      throw std::invalid_argument("moe_stage " + std::to_string(setup_.stage) + ": " + what +
                                  " has " + std::to_string(t.size()) + " floats, expected " +
                                  std::to_string(want));
    }
  }
  void fill(models::split s, std::int64_t iteration, int replica, int mb) {
    if (!corpus_) return;  // a middle stage reads no data
    models::fill_batch(*corpus_, s, setup_.train.seed, iteration, replica, mb,
                       setup_.train.micro_batch_size, setup_.train.seq_len, tokens_.data(),
                       targets_.data());
  }

  stage_setup setup_;
  models::moe_model model_;
  models::stage stage_;
  std::optional<models::corpus> corpus_;
  std::vector<models::operator_state*> ops_;
  std::vector<std::int32_t> tokens_, targets_;  // [B,T] scratch
  std::int64_t iteration_ = 0;
  int backwards_ = 0;                           // of this iteration
  std::unique_ptr<models::cuda::context> ctx_;  // train.device = cuda only
  std::unique_ptr<models::cuda::stage> gpu_;
  std::unique_ptr<gpu_state> state_;  // before gpu_ in destruction: it refers to it
};

}  // namespace

std::unique_ptr<stage_model> make_moe_stage(const stage_setup& setup) {
  if (setup.stages < 1 || setup.stage < 0 || setup.stage >= setup.stages) {
    throw models::config_error("parallel.pp", "stage " + std::to_string(setup.stage) +
                                                  " is not in [0, " + std::to_string(setup.stages) +
                                                  ")");
  }
  if (setup.stages > setup.model.layers) {
    throw models::config_error("parallel.pp", std::to_string(setup.stages) +
                                                  " stages exceed the model's " +
                                                  std::to_string(setup.model.layers) +
                                                  " layers; use at most model.layers stages");
  }
  if (setup.replicas < 1 || setup.replica < 0 || setup.replica >= setup.replicas) {
    throw models::config_error("parallel.dp", "replica " + std::to_string(setup.replica) +
                                                  " is not in [0, " +
                                                  std::to_string(setup.replicas) + ")");
  }
  if (setup.train.data_parallel != setup.replicas) {
    throw models::config_error("parallel.dp", "train.data_parallel (" +
                                                  std::to_string(setup.train.data_parallel) +
                                                  ") must equal the number of replicas (" +
                                                  std::to_string(setup.replicas) + ")");
  }
  models::validate(setup.model, setup.train);
  if (setup.train.device == models::device::cuda && models::cuda::device_count() == 0) {
    throw models::config_error("train.device", "'cuda' but no GPU is usable on this worker (" +
                                                   models::cuda::describe_device() +
                                                   "); set train.device = \"cpu\"");
  }
  models::cpu::set_gemm_threads(setup.train.blis_threads);
  const auto range = models::partition(setup.model, setup.stages)[std::size_t(setup.stage)];
  return std::make_unique<moe_stage>(setup, range);
}

}  // namespace moevement::engine
