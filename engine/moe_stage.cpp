// The built-in stage: a slice of the MoE transformer of models/ (make_moe_stage).
#include <algorithm>
#include <cstdlib>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "engine/stage_model.hpp"
#include "models/cpu/gemm.hpp"
#include "models/cuda/collectives.hpp"
#include "models/cuda/device.hpp"
#include "models/cuda/stage.hpp"
#include "models/data.hpp"

namespace moevement::engine {
namespace {

// NCCL refuses two ranks of a group on one GPU ("Duplicate GPU detected": it compares host
// hashes and bus ids). Where this stage's replicas share GPUs (more ranks than GPUs: each
// worker takes GPU rank % visible), each worker gets a host id of its own, unless the
// environment sets one: NCCL then connects them over its socket transport. Called before
// this process's first NCCL call, which reads it.
void tell_nccl_apart_if_sharing(const stage_setup& setup) {
  if (std::getenv("NCCL_HOSTID") != nullptr) return;
  const int gpus = std::max(models::cuda::device_count(), 1);
  std::set<int> used;
  for (int d = 0; d < setup.replicas; ++d) used.insert((d * setup.stages + setup.stage) % gpus);
  if (int(used.size()) == setup.replicas) return;
  const int rank = setup.replica * setup.stages + setup.stage;
  const std::string id = "moevement-rank-" + std::to_string(rank);
  ::setenv("NCCL_HOSTID", id.c_str(), 1);
}

// The replicas' gradient sum through NCCL (train.collectives), on the stage's context.
class gpu_reduction final : public device_reduction {
 public:
  gpu_reduction(models::cuda::context& ctx, models::cuda::stage& gpu,
                std::vector<models::operator_state*> ops, const stage_setup& setup,
                std::size_t first_op)
      : ctx_(ctx), gpu_(gpu), ops_(std::move(ops)), setup_(setup), first_(first_op) {}
  // The host id is set at the first NCCL call of the process, not when the stage is made: a
  // spare's replay builds every replica of the stage it rebuilds, and only the stage actor's
  // own replica talks NCCL.
  std::vector<std::byte> new_group_id() override {
    tell_nccl_apart_if_sharing(setup_);
    return models::cuda::new_group_id();
  }
  void join(std::span<const std::byte> id) override {
    (void)leave();
    tell_nccl_apart_if_sharing(setup_);
    group_ = std::make_unique<models::cuda::nccl_group>(ctx_, id, setup_.replicas, setup_.replica);
    formed_ = false;
  }
  result sum(std::chrono::steady_clock::time_point form_deadline,
             const std::atomic<bool>& stop) override {
    result out;
    if (!group_ || !group_->alive()) {
      out.error = "no NCCL group (it was aborted, and no new one was wired)";
      return out;
    }
    auto ended = [&](const models::cuda::wait_result& w) {
      out.stopped = w.end == models::cuda::wait_end::stopped;
      if (!out.stopped) out.error = w.error;
      if (w.end == models::cuda::wait_end::timed_out) out.error += " (train.nccl_timeout_s)";
      return out;
    };
    if (!formed_) {
      const auto w = group_->wait_formed(form_deadline, stop);
      out.form_s = w.seconds;
      if (w.end != models::cuda::wait_end::done) return ended(w);
      formed_ = true;
    }
    std::vector<std::span<float>> grads;
    for (std::size_t i = 0; i < ops_.size(); ++i) {
      grads.emplace_back(gpu_.grads(first_ + i), ops_[i]->grad().size());
    }
    const auto w = group_->sum(grads, stop);
    out.sum_s = w.seconds;
    if (w.end != models::cuda::wait_end::done) return ended(w);
    out.ok = true;
    return out;
  }
  // Whether a group is held: only the stage actor's replica joins one. A replay's stages
  // (every replica of a stage, in one spare) never do, and sum on the host.
  bool holds_group() const { return group_ != nullptr; }
  double leave() override {
    if (!group_) return 0.0;
    const double s = group_->abort();
    group_.reset();
    return s;
  }

 private:
  models::cuda::context& ctx_;
  models::cuda::stage& gpu_;
  std::vector<models::operator_state*> ops_;
  stage_setup setup_;
  std::size_t first_;
  std::unique_ptr<models::cuda::nccl_group> group_;
  bool formed_ = false;
};

// The GPU stage's training state on the device (train.device = cuda), for the engine.
class gpu_state final : public device_state {
 public:
  gpu_state(models::cuda::stage& gpu, std::size_t first_op, bool one_replica,
            std::unique_ptr<gpu_reduction> reduction)
      : gpu_(gpu), first_(first_op), one_replica_(one_replica), reduction_(std::move(reduction)) {}
  device_reduction* reduction() override { return reduction_.get(); }
  void step(const models::step_plan& plan, const models::train_config& train,
            bool grads_from_host) override {
    const models::adamw_config cfg{train.lr, train.beta1, train.beta2, train.eps,
                                   train.weight_decay};
    gpu_.step(plan, cfg, grads_from_host);
  }
  bool state_on_device() const override { return gpu_.state_on_device(); }
  // In an NCCL group the replicas always sum on the device, whichever copy holds the state (a
  // rebuilt replica's is the host's until its first step), so that all agree on the path.
  bool grads_on_device() const override {
    return (reduction_ != nullptr && reduction_->holds_group()) ||
           (one_replica_ && gpu_.state_on_device());
  }
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
  std::unique_ptr<gpu_reduction> reduction_;  // NCCL groups only
};
static_assert(int(device_state::tensor::compute) == int(models::cuda::stage::tensor::compute));

class moe_stage final : public stage_model {
 public:
  moe_stage(const stage_setup& setup, const models::stage_range& range)
      : setup_(setup),
        split_(expert_split_of(setup)),
        model_(setup.model, setup.train.seed, range.first_op, range.last_op, setup.initialize,
               split_),
        stage_(model_, range, setup.train.micro_batch_size, setup.train.seq_len, split_) {
    if (split_.count > 1) shard_ = std::make_unique<models::expert_shard>(model_, range, split_);
    if (setup.first() || setup.last()) {
      corpus_.emplace(
          models::corpus::load(setup.train.corpus, setup.train.val_fraction, setup.train.seq_len));
    }
    const std::size_t n = std::size_t(stage_.tokens());
    tokens_.resize(n);
    targets_.resize(n);
    for (std::size_t i = range.first_op; i < range.last_op; ++i) {
      if (model_.ops()[i].allocated()) ops_.push_back(&model_.ops()[i]);  // EP: held experts
    }
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
      std::unique_ptr<gpu_reduction> reduction;
      if (setup.replicas > 1 && models::uses_nccl(setup.train)) {
        reduction = std::make_unique<gpu_reduction>(*ctx_, *gpu_, ops_, setup, range.first_op);
      }
      state_ = std::make_unique<gpu_state>(*gpu_, range.first_op, setup.replicas == 1,
                                           std::move(reduction));
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
    if (shard_) shard_->begin_iteration();
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
    // The expert shard keeps the aborted iteration's rows: its EP peers may still be computing
    // that iteration (an abort reaches each stage when it is free) and need their backwards
    // served. begin_iteration() drops them.
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
  models::expert_shard* experts() override { return shard_.get(); }
  void set_expert_exchange(models::expert_exchange* exchange) override {
    stage_.set_exchange(exchange);
  }
  models::expert_exchange* expert_exchange() const override { return stage_.exchange(); }

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
  models::expert_split split_;  // the experts this replica holds (all without EP)
  models::moe_model model_;
  models::stage stage_;
  std::unique_ptr<models::expert_shard> shard_;  // expert parallelism only
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
  if (setup.train.expert_parallel > 1 && setup.train.device == models::device::cuda) {
    throw models::config_error("parallel.ep",
                               "expert parallelism trains on train.device = "
                               "\"cpu\" only so far; set parallel.ep = 1 on GPUs");
  }
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
