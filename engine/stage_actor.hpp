// The stage actor: one per (stage, replica), in its worker process. It drives a stage_model
// through an iteration for the coordinator: 1F1B over the micro-batches (boundary tensors
// exported and pulled, see bulk_io.hpp), the gradient reduction along the replicas of its
// stage in replica order, the optimizer step the coordinator planned, the hooks of a
// checkpoint policy, validation on replica 0, and its operators' digests.
//
// A custom stage type may subclass it (stage_registry::add_actor): the subclass takes
// messages of its own beside these (its interface: actors::extended<stage_actor::interface,
// ...>) and reaches its model on the compute thread (on_compute_thread).
//
// Message-driven: every handler does what the inputs it has allow, then returns, so that a
// neighbour's tensor arriving while this stage computes simply waits in the mailbox. The
// computation itself runs on the actor's own compute thread (awaited), so the node's
// heartbeats never stall behind a long GEMM.
#pragma once

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <thread>
#include <vector>

#include "actors/system.hpp"
#include "engine/bulk_io.hpp"
#include "engine/compute_watch.hpp"
#include "engine/engine.capnp.h"
#include "engine/expert_router.hpp"
#include "engine/hooks.hpp"
#include "engine/resume_point.hpp"
#include "engine/schedule.hpp"
#include "engine/stage_model.hpp"
#include "engine/stage_registry.hpp"

namespace moevement::engine {

class stage_actor : public actors::actor {
 public:
  using interface =
      actors::interface<actors::ask_t<wire::Wire, wire::WireAck>, actors::tell_t<wire::Iterate>,
                        actors::tell_t<wire::Activation>, actors::tell_t<wire::Gradient>,
                        actors::tell_t<wire::ReducePartial>, actors::tell_t<wire::ReduceTotal>,
                        actors::tell_t<wire::ReduceGroup>, actors::tell_t<wire::Step>,
                        actors::ask_t<wire::Abort, wire::AbortAck>, actors::tell_t<wire::Validate>,
                        actors::tell_t<wire::ValActivation>,
                        actors::ask_t<wire::DigestsQuery, wire::Digests>,
                        actors::ask_t<wire::StageStateQuery, wire::StageState>>;

  // Allocates and exports the boundary and reduction buffers (throws if the link cannot).
  // args.hooks may be null (policy none); args.faults may be empty (no failure injection).
  explicit stage_actor(stage_actor_args args);
  ~stage_actor() override;

  // Messages dropped as stale (an aborted epoch) or refused as malformed.
  std::uint64_t dropped() const { return dropped_; }
  // A standby head took over and this stage runs on: its reports go to the new coordinator
  // (called by its worker's agent, on the actor thread).
  void set_coordinator(actors::actor_ref coordinator) { coordinator_ = coordinator; }
  // Where its compute thread is: its worker's agent answers the head's stuck-stage probe from
  // it (this actor is busy while its compute runs).
  std::shared_ptr<const compute_watch> watch() const { return watch_; }

 protected:
  // For a subclass's own handlers. The model is the compute thread's: read or change it only
  // inside on_compute_thread, which runs fn there between the engine's own work (in order
  // with it) and waits. fn must not touch the subclass's members past the call's end.
  const stage_setup& setup() const { return setup_; }
  stage_model& model() { return *model_; }
  std::int64_t iteration() const { return iteration_; }  // the current or last one
  asio::awaitable<void> on_compute_thread(std::function<void()> fn);

 protected:
  // Makes the reduction's buffers (a subclass that overrides it co_awaits this one first).
  asio::awaitable<void> on_start() override;

 private:
  enum class phase : std::uint8_t {
    idle,
    running,
    reducing,
    wait_total,
    reduced,
    stepped,
    aborted
  };
  struct incoming {                                     // pull targets; shared with in-flight pulls
    std::vector<float> act, grad, partial, total, val;  // [M*bf] [M*bf] [G] [G] [bf]
  };

  asio::awaitable<void> wire(wire::Wire::Reader m, wire::WireAck::Builder);
  asio::awaitable<void> iterate(wire::Iterate::Reader m);
  asio::awaitable<void> activation(wire::Activation::Reader m);
  asio::awaitable<void> gradient(wire::Gradient::Reader m);
  asio::awaitable<void> reduce_partial(wire::ReducePartial::Reader m);
  asio::awaitable<void> reduce_total(wire::ReduceTotal::Reader m);
  asio::awaitable<void> reduce_group(wire::ReduceGroup::Reader m);
  asio::awaitable<void> step(wire::Step::Reader m);
  asio::awaitable<void> abort(wire::Abort::Reader m, wire::AbortAck::Builder);
  asio::awaitable<void> validate(wire::Validate::Reader m);
  asio::awaitable<void> val_activation(wire::ValActivation::Reader m);
  asio::awaitable<void> validate_one(std::uint64_t round, int index, std::span<const float> x);
  asio::awaitable<void> digests(wire::DigestsQuery::Reader, wire::Digests::Builder out);
  // A standby head that took over: the iteration in flight dropped, where this stage is.
  asio::awaitable<void> state(wire::StageStateQuery::Reader, wire::StageState::Builder out);
  // Drops the iteration in flight, if any (Abort and a takeover); the NCCL group's abort
  // seconds.
  asio::awaitable<double> drop_in_flight();
  // What a step leaves for a standby head: the step plans from Step.keepFrom on, and where
  // the step checkpointed.
  void keep_step(std::int64_t it, const models::step_plan& plan, wire::Step::Reader m);
  // What the step cost and the state's digests (verify), to the coordinator.
  void tell_stepped(const std::vector<std::uint64_t>& digests, double verify_s);

  // Runs the 1F1B steps whose inputs are here, then the reduction when all are done.
  asio::awaitable<void> advance();
  // One forward or backward pass of the plan; false: it waits for its input, or the stage failed.
  asio::awaitable<bool> forward_pass(pipeline_step s);
  asio::awaitable<bool> backward_pass(pipeline_step s, float loss_grad);
  asio::awaitable<void> reduce();
  asio::awaitable<void> finish_reduce();
  // Expert parallelism's reduction: the two folds below, each as far as its inputs allow.
  asio::awaitable<void> reduce_sharded();
  asio::awaitable<void> fold_dense();
  asio::awaitable<void> fold_experts();
  // Where a reduction message's tensor goes in the buffers (first float, floats): all of them,
  // or under expert parallelism one of the two folds' parts.
  std::pair<std::size_t, std::size_t> fold_part(bool experts) const;
  // NCCL (device_reduction): replica 0 makes the wiring's group and tells the others; each
  // joins; the sum runs on the compute thread, and an Abort stops it (stop_sum_).
  asio::awaitable<void> form_group();
  asio::awaitable<void> join_group(std::vector<std::byte> id);
  asio::awaitable<void> device_reduce();
  // Whether a stage-to-stage message of `epoch` is to be taken (else counted and dropped).
  bool accept(std::uint64_t epoch);
  // Pulls into `into`; false (and the coordinator told) on failure.
  asio::awaitable<bool> pull(const transport::bulk_descriptor& d, std::span<float> into);
  // Runs fn on the compute thread and waits for it.
  template <class F>
  asio::awaitable<void> compute(F&& fn) {
    auto task = [&fn, watch = watch_]() -> asio::awaitable<void> {
      const compute_watch::task busy(watch.get());
      fn();
      co_return;
    };
    co_await asio::co_spawn(pool_.get_executor(), std::move(task), asio::use_awaitable);
  }
  void fail(const std::string& what);
  asio::awaitable<void> at_fault_point(fault_point p) {
    if (faults_.at && faults_.at(iteration_, p)) {
      // A stall: the compute thread hangs (a kernel that never returns); the actor waits on it.
      co_await compute([] {
        for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
      });
    }
  }

  std::shared_ptr<compute_watch> watch_ = std::make_shared<compute_watch>();
  stage_setup setup_;
  std::unique_ptr<stage_model> model_;
  bulk_io& io_;
  actors::actor_ref coordinator_;
  std::unique_ptr<stage_hooks> hooks_;
  fault_hooks faults_;
  actors::actor_ref prev_, next_;
  std::vector<actors::actor_ref> replicas_;
  std::vector<models::operator_state*> ops_;
  std::vector<pipeline_step> plan_;
  std::size_t first_backward_ = 0;  // index in plan_ of the first backward micro-batch
  std::size_t bf_ = 0;              // floats per boundary tensor
  std::size_t gf_ = 0;              // floats in all gradients
  int m_ = 1;                       // micro-batches

  // outgoing tensors, exported: [M*bf] activations, [M*bf] input gradients, [G] reduction,
  // [val_batches*bf] validation activations
  transport::bulk_region act_out_, grad_out_, red_out_, val_out_;
  std::shared_ptr<incoming> in_;
  std::vector<std::uint64_t> act_epoch_, grad_epoch_;  // the epoch each input slot holds
  std::uint64_t partial_epoch_ = 0, total_epoch_ = 0;

  std::uint64_t epoch_ = 0;
  std::int64_t iteration_ = 0;
  // The last iteration stepped: -1 for a stage built from the initial state; unknown for a
  // rebuilt one until its first Iterate (whose iteration follows it).
  std::optional<std::int64_t> stepped_;
  // For a standby head (StageState): the step plans the head keeps for replays, and the last
  // step's checkpoint window and its size.
  std::map<std::int64_t, planned_step> kept_steps_;
  std::uint64_t last_window_ = 0;
  int last_w_sparse_ = 0;
  std::uint32_t last_slot_ = 0;
  std::vector<double> last_popularity_;  // as the Step carried it (canonical order)
  float loss_scale_ = 1.0f;
  phase phase_ = phase::idle;
  std::size_t next_step_ = 0;
  std::vector<double> losses_, aux_;
  double compute_s_ = 0.0;
  // This iteration's compute-thread seconds in the hooks: on_boundary_send, and the step's
  // hooks (the Stepped message's logSeconds, stepHookSeconds).
  double log_s_ = 0.0, step_hook_s_ = 0.0;
  std::uint64_t dropped_ = 0;
  bool failed_ = false;

  // Expert parallelism: where the model's routed rows go (engine/expert_router.hpp); null
  // without it.
  std::shared_ptr<expert_router> router_;
  // Its reduction: the non-experts' fold over every replica (their gradient is the first
  // dense_floats_ of gf_ in the reduction's buffers) and the expert block's over its copies
  // (the rest).
  struct fold {
    bool sent = false, done = false;  // this iteration's share sent; the total is here
    std::uint64_t partial_epoch = 0, total_epoch = 0;
  };
  std::vector<models::operator_state*> dense_ops_;
  std::size_t dense_floats_ = 0;
  fold dense_fold_, expert_fold_;

  device_reduction* reduction_ = nullptr;  // model_->device()->reduction(): NCCL, else null
  std::uint64_t wiring_ = 0;               // the last Wire's count
  std::uint64_t early_wiring_ = 0;         // a ReduceGroup that came before its Wire
  std::vector<std::byte> early_group_;
  bool joined_ = false;  // this wiring's group joined (it may still be forming)
  std::chrono::steady_clock::time_point joined_at_;
  std::atomic<bool> stop_sum_{false};
  double group_form_s_ = 0.0, device_sum_s_ = 0.0;  // this iteration's, for StageDone

  asio::thread_pool pool_{1};  // last: joined first, before the model it computes on dies
};

}  // namespace moevement::engine
