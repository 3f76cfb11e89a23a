#include "recovery/moevement_policy.hpp"

#include <fmt/format.h>
#include <asio/co_spawn.hpp>
#include <asio/post.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <exception>
#include <future>
#include <mutex>
#include <stdexcept>
#include <thread>

#include <sys/resource.h>
#include <unistd.h>

#include "base/hash.hpp"
#include "models/cpu/gemm.hpp"
#include "recovery/region_restore.hpp"
#include "recovery/region_supervisor.hpp"
#include "recovery/snapshot.hpp"
#include "recovery/sparse_to_dense.hpp"
#include "recovery/worker_tasks.hpp"
#include "sim/sparse_schedule.hpp"

namespace moevement::recovery {

namespace {

using actors::actor_ref;
using actors::read_ref;
using actors::write_ref;
using asio::awaitable;

// The stage's hooks. The capture of a step's slot runs on a capture thread of its own,
// overlapped with the next iteration's forward and backward (which only read the state it
// copies); the next step waits for it first (the stall), then ships it through the agent.
class checkpoint_hooks : public engine::stage_hooks {
 public:
  checkpoint_hooks(std::shared_ptr<capture_shared> shared, actors::actor_system& system,
                   actor_ref agent, std::vector<models::operator_state*> ops, policy_limits limits,
                   sparse_config config, std::chrono::milliseconds max_window_wait)
      : shared_(std::move(shared)),
        system_(system),
        agent_(agent),
        ops_(std::move(ops)),
        limits_(limits),
        config_(std::move(config)),
        max_window_wait_(max_window_wait) {
    // The capture yields to the stages' compute: it has until the next step to finish, and
    // where the stages compute on the same cores it takes their time.
    asio::post(pool_, [this] {
      capture_tid_ = ::gettid();
      (void)::setpriority(PRIO_PROCESS, ::gettid(), 19);
    });
  }
  bool soft_popularity() const override { return config_.soft(); }
  bool disposable() const override { return true; }  // the capture is released where it may be
  ~checkpoint_hooks() override {
    // A capture in flight is waited for (on the disposer's thread, when the stage dropped these
    // hooks there) at full priority, not the capture's own lowest.
    if (const pid_t tid = capture_tid_.load(); tid > 0) (void)::setpriority(PRIO_PROCESS, tid, 0);
    pool_.join();
    release_capture(shared_, system_);
  }

  void before_step(std::int64_t, const engine::checkpoint_step& decided) override {
    const auto t0 = std::chrono::steady_clock::now();
    if (pending_.valid()) {
      pending_.wait();
      pending_.get();  // rethrows what the capture threw
    }
    // The iteration's log copies the capture thread has not made: made here (the sent bytes are
    // written again by the next iteration). Their CPU on the capture thread counts as the
    // capture's (the copies made here count in the stall).
    shared_->copier.settle();
    log_cpu_last_s_ = log_cpu_s_.exchange(0.0);
    replication_cpu_last_s_ = shared_->replication ? shared_->replication->take() : 0.0;
    {
      const std::lock_guard lock(log_error_mu_);
      if (log_error_) std::rethrow_exception(std::exchange(log_error_, nullptr));
    }
    std::unique_lock lock(shared_->mu);
    // A new window while replication is behind: wait for the job to persist one (bounded).
    // Past the wait the window is skipped, not captured (memory stays bounded however long
    // nothing persists), and so are the next ones at once, without waiting, until a window
    // persists again: a stuck replication costs no stall per window.
    place_ = decided.place;
    if (shared_->schedule && place_.w_sparse > 0 && place_.slot == 0) {
      const auto full = [&] { return shared_->capture.windows_held() >= limits_.max_windows_held; };
      if (!(paused_ && full())) {
        shared_->dropped.wait_for(lock, max_window_wait_, [&] { return !full(); });
      }
      paused_ = full();
      if (paused_) {
        shared_->capture.skip_window(place_.window);
        windows_skipped_ = shared_->capture.windows_skipped();
      }
    }
    stall_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (place_.w_sparse > 0 && !shared_->schedule) {
      sparse_config c = config_;  // the job's ordering; W as the coordinator chose it
      c.w_sparse = place_.w_sparse;
      shared_->schedule.emplace(c, ops_);
      if (shared_->taken_over) {  // a replacement schedules as its stage's survivors do
        shared_->schedule->load(std::move(*shared_->taken_over));
        shared_->taken_over.reset();
      }
      shared_->capture.set_schedule(*shared_->schedule);
    }
    shared_->capture.set_counts(decided.popularity);
  }
  void on_step(std::int64_t iteration, float loss_grad, const models::step_plan& plan) override {
    std::lock_guard lock(shared_->mu);
    shared_->capture.on_step(iteration, loss_grad, plan);
  }
  void after_step(std::int64_t iteration, std::span<models::operator_state* const>) override {
    auto done = std::make_shared<std::promise<void>>();
    pending_ = done->get_future();
    asio::post(pool_, [this, iteration, done, place = place_] {
      try {
        {
          const double cpu0 = engine::thread_cpu_seconds();
          // The copy itself runs unlocked: the agent's handlers take this lock on the
          // process's one actor thread, which must never wait out a whole slot's copy.
          std::optional<sparse_capture::slot_write> job;
          {
            std::lock_guard lock(shared_->mu);
            job = shared_->capture.begin_capture(iteration, ops_, place);
          }
          if (job) job->write();
          std::lock_guard lock(shared_->mu);
          if (job) shared_->capture.end_capture(*job);
          capture_cpu_s_ = engine::thread_cpu_seconds() - cpu0;
          const bool captured = shared_->capture.slot_of(iteration).has_value();
          slot_bytes_ = captured ? shared_->capture.last_slot_bytes() : 0;
          fresh_bytes_ = captured && shared_->capture.last_slot_fresh() ? slot_bytes_.load() : 0;
          lent_bytes_ = captured && shared_->capture.last_slot_lent() ? slot_bytes_.load() : 0;
          host_bytes_ = shared_->capture.snapshot_bytes_held() +
                        (shared_->pool ? shared_->pool->free_bytes() : 0);
        }
        // Ship it from the actor thread (posting to the io_context is thread-safe).
        asio::post(system_.io(), [sys = &system_, agent = agent_, iteration] {
          (void)sys->post_call(agent, [iteration](actors::actor& a) -> awaitable<void> {
            static_cast<checkpoint_agent&>(a).ship(iteration);
            co_return;
          });
        });
        done->set_value();
      } catch (...) {
        done->set_exception(std::current_exception());
      }
    });
  }
  // The log's copy of a large send is queued here and made on the capture thread (log_copier),
  // or by the next settle: before_step, settle_sends, a log read. A small one is made here.
  void on_boundary_send(std::int64_t iteration, int micro_batch, engine::boundary kind,
                        std::span<const float> tensor) override {
    if (tensor.size_bytes() < limits_.log_copy_async_bytes) {
      shared_->copier.copy_now({iteration, micro_batch, kind, tensor});
      return;
    }
    if (!shared_->copier.queue({iteration, micro_batch, kind, tensor})) return;
    asio::post(pool_, [this] {
      const double cpu0 = engine::thread_cpu_seconds();
      try {
        if (shared_->copier.copy_queued() == 0) return;  // settled before it came to this
      } catch (...) {  // (out of memory) the next step fails with it, as a capture's would
        const std::lock_guard lock(log_error_mu_);
        if (!log_error_) log_error_ = std::current_exception();
        return;
      }
      const double used = engine::thread_cpu_seconds() - cpu0;
      double was = log_cpu_s_.load();
      while (!log_cpu_s_.compare_exchange_weak(was, was + used)) {
      }
    });
  }
  void settle_sends() override { shared_->copier.settle(); }
  void on_wired(std::span<const actor_ref> replicators) override {
    std::vector<actor_ref> targets(replicators.begin(), replicators.end());
    (void)system_.post_call(agent_, [targets](actors::actor& a) -> awaitable<void> {
      static_cast<checkpoint_agent&>(a).set_targets(targets);
      co_return;
    });
  }
  engine::checkpoint_stats stats() const override {
    // The slot of this step is still being copied: report the previous one's size.
    return {slot_bytes_.load(),
            stall_s_,
            host_bytes_.load(),
            shared_->log_bytes.load(),
            lent_bytes_.load(),
            shared_->replica_maps.load(),
            shared_->replica_pulls.load(),
            capture_cpu_s_.load() + log_cpu_last_s_.load(),
            replication_cpu_last_s_.load(),
            fresh_bytes_.load(),
            windows_skipped_.load()};
  }
  std::optional<std::pair<std::uint64_t, std::int64_t>> persisted_window() const override {
    const std::lock_guard lock(shared_->mu);
    const auto id = shared_->capture.persisted_id();
    if (!id) return std::nullopt;
    const std::int64_t first = shared_->capture.first_iteration(*id);
    if (first < 0) return std::nullopt;  // a rebuilt stage that never held it
    return std::pair{*id, first};
  }

 private:
  std::shared_ptr<capture_shared> shared_;
  actors::actor_system& system_;
  actor_ref agent_;
  std::vector<models::operator_state*> ops_;
  policy_limits limits_;
  sparse_config config_;
  std::chrono::milliseconds max_window_wait_;  // checkpoint.max_window_wait_ms
  std::future<void> pending_;                  // the capture in flight
  double stall_s_ = 0.0;
  engine::checkpoint_place place_;  // where this step captures, as the head placed it
  bool paused_ = false;             // the last window was skipped (before_step)
  std::atomic<std::uint64_t> windows_skipped_{0};
  std::atomic<std::uint64_t> slot_bytes_{0}, host_bytes_{0}, lent_bytes_{0};
  std::atomic<std::uint64_t> fresh_bytes_{0};
  std::atomic<double> capture_cpu_s_{0.0};
  // The log copies' CPU on the capture thread: summed since the last step, and the last step's.
  std::atomic<double> log_cpu_s_{0.0}, log_cpu_last_s_{0.0};
  // The process's actor-thread CPU on replication taken at the last step (replication_cpu).
  std::atomic<double> replication_cpu_last_s_{0.0};
  std::mutex log_error_mu_;
  std::exception_ptr log_error_;       // a log copy the capture thread failed to make
  std::atomic<pid_t> capture_tid_{0};  // the capture thread's (its priority)
  asio::thread_pool pool_{1};          // last: joined first
};

// Algorithm 1's bandwidth: how fast this process writes snapshot bytes, measured on the
// stage's first operators up to a sample of policy_limits::bandwidth_sample_bytes (this
// runs on the actor thread: a whole-stage copy could outlast a heartbeat).
double measure_bandwidth(const std::vector<models::operator_state*>& ops,
                         engine::stage_model& model, const policy_limits& limits) {
  std::vector<const models::operator_state*> sample;
  std::vector<capture_kind> kinds;
  std::size_t bytes = 0;
  for (const auto* op : ops) {
    const auto s = sparse_sizes(*op);
    const std::uint64_t full = s.master_bytes + s.optim_bytes;
    if (!sample.empty() && bytes + full > limits.bandwidth_sample_bytes) break;
    sample.push_back(op);
    kinds.push_back(capture_kind::full);
    bytes += full;
  }
  // The fastest of a few copies: the workers start together, and one copy of a few
  // milliseconds is easily cut into by another process (W_sparse follows this closely).
  const std::size_t size = snapshot_size(sample, kinds);
  double best = 0;
  const auto keep_best = [&](double secs) {
    if (secs > 0) best = std::max(best, double(size) / secs);
  };
  if (engine::device_state* d = model.device()) {
    // A GPU stage's slot is a copy on the side stream into page-locked memory, then the
    // checksum over it on the host: both count.
    const auto pinned = d->alloc_pinned(size);
    const std::span<std::byte> dst(pinned.get(), size);
    for (int i = 0; i < limits.bandwidth_samples; ++i) {
      const double copy = d->time_copy(dst);
      const auto t0 = std::chrono::steady_clock::now();
      (void)xxh3_64(dst);
      keep_best(copy +
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  } else {
    std::vector<std::byte> buf(size);
    for (int i = 0; i < limits.bandwidth_samples; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      write_snapshot(buf, {}, models::loss_scaler{}, sample, kinds);
      keep_best(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
  }
  return best;
}

}  // namespace

int choose_window(const std::vector<std::vector<engine::op_size>>& stages, double iteration_s,
                  double bandwidth) {
  int w = 1;
  for (const auto& ops : stages) {
    if (ops.empty()) continue;
    std::vector<sim::sparse_op> sizes;
    for (const auto& o : ops) {
      sim::sparse_op s;
      s.compute_bytes = o.compute_bytes;
      s.master_bytes = o.master_bytes;
      s.optim_bytes = o.optim_bytes;
      sizes.push_back(s);
    }
    w = std::max(w, sim::find_window_size(sizes, iteration_s, bandwidth).w_sparse);
  }
  return w;
}

// ---- the worker's policy

moevement_checkpoint::moevement_checkpoint(actors::actor_system& system, engine::bulk_io& io,
                                           const engine::job_config& job, policy_limits limits)
    : system_(system), io_(io), job_(job), limits_(limits) {
  if (engine::durable_tier(job_)) durable_ = std::make_shared<durable_writer>();
  replicator_ = system_.spawn<recovery::replicator>(io_, limits_, durable_, job_.baseline.dir,
                                                    job_.share_memory, replication_cpu_);
  inbox_ = std::make_shared<group_inbox>(system_.io());
  boundaries_ = std::make_shared<group_inbox>(system_.io());
  exchange_ = system_.spawn<recovery::group_exchange>(inbox_, boundaries_);
  // The head's region supervisors start a region_member here while this worker takes part
  // in a recovery (recovery/region_supervisor.hpp).
  system_.register_type<region_member>(region_member::registered_name);
}

std::unique_ptr<engine::stage_hooks> moevement_checkpoint::make_hooks(
    const engine::stage_setup& setup, engine::stage_model& model, actor_ref coordinator) {
  std::vector<models::operator_state*> ops = model.operators();
  sizes_.clear();
  for (const auto* op : ops) {
    const auto s = sparse_sizes(*op);
    sizes_.push_back({s.compute_bytes, s.master_bytes, s.optim_bytes});
  }
  bandwidth_ = measure_bandwidth(ops, model, limits_);
  auto shared = std::make_shared<capture_shared>(setup.stage, setup.replica);
  shared->pool = std::make_unique<slot_pool>(io_, job_.share_memory);
  // What its replicator spent before this stage (a spare's, holding others' copies) is no
  // step's: the first step's take starts from here.
  (void)replication_cpu_->take();
  shared->replication = replication_cpu_;
  // Kept through the first window's refills (one per captured slot), so that each of its
  // slots can take its restored file instead of a new one.
  const std::size_t refills = std::max(restored_w_, restored_files_.size());
  for (auto& f : restored_files_) shared->pool->adopt(std::move(f), refills);
  restored_files_.clear();
  if (!restored_regions_.empty()) {
    for (auto& r : restored_regions_) shared->pool->adopt(std::move(r));
    restored_regions_.clear();
    shared->pool->grow(limits_.max_windows_held - 1);
  }
  shared->capture.set_allocator(
      [pool = shared->pool.get()](std::size_t bytes) { return pool->take(bytes); });
  shared->capture.set_device(model.device());
  if (restored_log_) {
    shared->capture.mutable_log() = std::move(*restored_log_);
    shared->capture.mutable_log().recycle_into(shared->log_recycled);  // the move took its own
    restored_log_.reset();
  }
  if (restored_schedule_) {
    shared->taken_over = std::move(*restored_schedule_);
    restored_schedule_.reset();
  }
  durable_target durable;
  if (durable_) {
    durable.writer = durable_;
    durable.dir = durable_window_dir(job_.baseline.dir, setup.stage, setup.replica);
    // One more than checkpoint.keep: the stages may be a window apart (the one being
    // written), and a corrupt newest common window must still have a good one behind it.
    durable.keep = std::size_t(job_.baseline.keep) + 1;
    durable.delay = std::chrono::milliseconds(job_.durable_write_delay_ms);
    if (setup.stage == job_.pp - 1 && setup.replica == 0) {
      durable.fail_from = job_.durable_fail_from;
    }
    if (fresh_) {
      // A new job: windows an earlier job left there must never be loaded as this one's.
      durable_->post([dir = durable.dir] {
        try {
          durable_store(dir).clear();
        } catch (const std::exception&) {
          // The writes that follow fail the same way and report it.
        }
      });
    }
  }
  if (agent_.valid()) system_.stop(agent_);  // an older restore's stage (never wired)
  agent_ = system_.spawn<checkpoint_agent>(shared, io_, setup.stage, setup.replica, coordinator,
                                           job_.snapshot_replicas, limits_, std::move(durable));
  if (auto* a = system_.local_actor<checkpoint_agent>(agent_)) {
    a->set_copy_flip(std::exchange(copy_flip_, {}));
  }
  sparse_config config;
  config.order_by = parse_ordering(job_.ordering);
  config.decay_alpha = job_.decay_alpha;
  config.reorder.change_threshold = job_.reorder_change;
  config.reorder.fraction_threshold = job_.reorder_fraction;
  return std::make_unique<checkpoint_hooks>(shared, system_, agent_, std::move(ops), limits_,
                                            std::move(config),
                                            std::chrono::milliseconds(job_.max_window_wait_ms));
}

void moevement_checkpoint::set_coordinator(actor_ref coordinator) {
  if (auto* a = system_.local_actor<checkpoint_agent>(agent_)) a->set_coordinator(coordinator);
}

awaitable<std::unique_ptr<engine::stage_model>> moevement_checkpoint::restore(
    engine::wire::Restore::Reader plan, const engine::stage_factory& factory,
    engine::stage_setup setup) {
  fresh_ = false;
  // A survivor replaying its own role in place keeps its old upstream log for the replay to
  // check its sends against (the old stage is stopped: nothing writes it any more).
  std::shared_ptr<capture_shared> old;
  if (const auto* a = system_.local_actor<checkpoint_agent>(agent_)) {
    if (a->stage() == setup.stage && a->replica() == setup.replica && plan.getGroup().size() > 0 &&
        !plan.getDurable() && plan.getWindowStages() == 0) {
      old = a->shared();
    }
  }
  // Hooks of an older generation's stage are gone with its stage actor; its agent goes too.
  if (agent_.valid()) system_.stop(agent_);
  agent_ = {};
  restored_log_.reset();
  restored_schedule_.reset();
  restored_regions_.clear();
  restored_files_.clear();
  restored_w_ = 0;
  timing_ = {};
  restore_context ctx{system_, io_, job_, limits_, durable_.get(), inbox_, boundaries_};
  if (old) {
    old->copier.settle();  // its last sends' copies still queued (the stage is stopped)
    ctx.own_log = &old->capture.log();
  }
  struct release_old {  // on the actor thread, also when the restore throws
    std::shared_ptr<capture_shared>& old;
    actors::actor_system& system;
    ~release_old() {
      if (old) release_capture(old, system);
    }
  } releasing{old, system_};
  restored_stage r = co_await restore_region(std::move(ctx), plan, factory, std::move(setup));
  restored_log_ = std::move(r.log);
  restored_schedule_ = std::move(r.schedule);
  restored_regions_ = std::move(r.regions);
  restored_files_ = std::move(r.files);
  restored_w_ = r.w;
  timing_ = r.timing;
  co_return std::move(r.model);
}

awaitable<std::vector<std::uint64_t>> moevement_checkpoint::judge(
    engine::wire::Restore::Reader plan, const engine::stage_factory& factory,
    engine::stage_setup setup) {
  // Its own context: the running restore's state (restored_*) is not touched, and nothing is
  // written to the durable tier.
  restore_context ctx{system_, io_, job_, limits_, nullptr, inbox_, boundaries_};
  restored_stage r = co_await restore_region(std::move(ctx), plan, factory, std::move(setup));
  const auto ops = r.model->operators();
  std::vector<std::uint64_t> digests;
  co_await off_thread([&] { digests = engine::operator_digests(ops); });
  // The model's memory goes off the actor thread; the regions (transport handles) here.
  system_.dispose(std::move(r.model));
  co_return digests;
}

engine::checkpoint_factory policy_factory(policy_limits limits) {
  return [limits](actors::actor_system& system, engine::bulk_io& io,
                  const engine::job_config& job) -> std::unique_ptr<engine::worker_checkpoint> {
    if (job.policy != engine::policy_kind::moevement) return nullptr;
    return std::make_unique<moevement_checkpoint>(system, io, job, limits);
  };
}

}  // namespace moevement::recovery
