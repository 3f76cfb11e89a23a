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
#include <future>
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

void write_key(wire::SlotKey::Builder b, int stage, int replica, std::uint64_t window,
               std::uint32_t slot) {
  b.setStage(stage);
  b.setReplica(replica);
  b.setWindow(window);
  b.setSlot(slot);
}

// The stage's hooks. The capture of a step's slot runs on a capture thread of its own,
// overlapped with the next iteration's forward and backward (which only read the state it
// copies); the next step waits for it first (the stall), then ships it through the agent.
class checkpoint_hooks : public engine::stage_hooks {
 public:
  checkpoint_hooks(std::shared_ptr<capture_shared> shared, actors::actor_system& system,
                   actor_ref agent, std::vector<models::operator_state*> ops, policy_limits limits,
                   sparse_config config)
      : shared_(std::move(shared)),
        system_(system),
        agent_(agent),
        ops_(std::move(ops)),
        limits_(limits),
        config_(std::move(config)) {
    // The capture yields to the stages' compute: it has until the next step to finish, and
    // where the stages compute on the same cores it takes their time.
    asio::post(pool_, [] { (void)::setpriority(PRIO_PROCESS, ::gettid(), 19); });
  }
  bool soft_popularity() const override { return config_.soft(); }
  ~checkpoint_hooks() override { pool_.join(); }

  void before_step(std::int64_t iteration, const engine::checkpoint_step& decided) override {
    const auto t0 = std::chrono::steady_clock::now();
    if (pending_.valid()) {
      pending_.wait();
      pending_.get();  // rethrows what the capture threw
    }
    std::unique_lock lock(shared_->mu);
    // A new window while replication is behind: wait for the job to persist one (bounded).
    if (shared_->schedule && iteration % shared_->schedule->w_sparse() == 0) {
      shared_->dropped.wait_for(lock, limits_.max_window_wait, [&] {
        return shared_->capture.windows_held() < limits_.max_windows_held;
      });
    }
    stall_s_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (decided.w_sparse > 0 && !shared_->schedule) {
      sparse_config c = config_;  // the job's ordering; W as the coordinator chose it
      c.w_sparse = decided.w_sparse;
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
    asio::post(pool_, [this, iteration, done] {
      try {
        {
          const double cpu0 = engine::thread_cpu_seconds();
          // The copy itself runs unlocked: the agent's handlers take this lock on the
          // process's one actor thread, which must never wait out a whole slot's copy.
          std::optional<sparse_capture::slot_write> job;
          {
            std::lock_guard lock(shared_->mu);
            job = shared_->capture.begin_capture(iteration, ops_);
          }
          if (job) job->write();
          std::lock_guard lock(shared_->mu);
          if (job) shared_->capture.end_capture(*job);
          capture_cpu_s_ = engine::thread_cpu_seconds() - cpu0;
          const bool captured = shared_->capture.slot_of(iteration).has_value();
          slot_bytes_ = captured ? shared_->capture.last_slot_bytes() : 0;
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
  void on_boundary_send(std::int64_t iteration, int micro_batch, engine::boundary kind,
                        std::span<const float> tensor) override {
    std::lock_guard lock(shared_->log_mu);
    shared_->capture.on_boundary_send(iteration, micro_batch, kind, tensor);
    log_bytes_ = shared_->capture.log().bytes();
  }
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
            log_bytes_.load(),
            lent_bytes_.load(),
            shared_->replica_maps.load(),
            shared_->replica_pulls.load(),
            capture_cpu_s_.load()};
  }

 private:
  std::shared_ptr<capture_shared> shared_;
  actors::actor_system& system_;
  actor_ref agent_;
  std::vector<models::operator_state*> ops_;
  policy_limits limits_;
  sparse_config config_;
  std::future<void> pending_;  // the capture in flight
  double stall_s_ = 0.0;
  std::atomic<std::uint64_t> slot_bytes_{0}, host_bytes_{0}, log_bytes_{0}, lent_bytes_{0};
  std::atomic<double> capture_cpu_s_{0.0};
  asio::thread_pool pool_{1};  // last: joined first
};

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

// ---- checkpoint agent

checkpoint_agent::checkpoint_agent(std::shared_ptr<capture_shared> shared, engine::bulk_io& io,
                                   int stage, int replica, actor_ref coordinator, int copies,
                                   policy_limits limits, durable_target durable)
    : shared_(std::move(shared)),
      io_(io),
      stage_(stage),
      replica_(replica),
      coordinator_(coordinator),
      copies_(copies),
      limits_(limits),
      durable_(std::move(durable)) {
  on<wire::SlotStored>(&checkpoint_agent::stored);
  on<engine::wire::WindowPersisted>(&checkpoint_agent::persisted);
  on<engine::wire::WindowsAbandoned>(&checkpoint_agent::abandoned);
  on<wire::FetchLog, wire::LogData>(&checkpoint_agent::fetch_log);
  on<wire::ReleaseLog>(&checkpoint_agent::release);
  on<wire::FetchSchedule, wire::ScheduleState>(&checkpoint_agent::schedule);
}

awaitable<void> checkpoint_agent::schedule(wire::FetchSchedule::Reader,
                                           wire::ScheduleState::Builder out) {
  std::optional<stage_schedule::state> st;
  {
    std::lock_guard lock(shared_->mu);
    if (shared_->schedule) st = shared_->schedule->save();
  }
  out.setHas(st.has_value());
  if (!st) co_return;
  auto order = out.initOrder(static_cast<unsigned>(st->order.size()));
  for (unsigned i = 0; i < order.size(); ++i) order.set(i, std::uint32_t(st->order[i]));
  auto pop = out.initOrderPopularity(static_cast<unsigned>(st->order_popularity.size()));
  for (unsigned i = 0; i < pop.size(); ++i) pop.set(i, st->order_popularity[i]);
  auto counts = out.initCounts(static_cast<unsigned>(st->counts.size()));
  unsigned i = 0;
  for (const auto& [w, c] : st->counts) {
    counts[i].setWindow(w);
    auto l = counts[i++].initCounts(static_cast<unsigned>(c.size()));
    for (unsigned j = 0; j < l.size(); ++j) l.set(j, c[j]);
  }
  auto scheds = out.initSchedules(static_cast<unsigned>(st->schedules.size()));
  i = 0;
  for (const auto& [w, slots] : st->schedules) {
    scheds[i].setWindow(w);
    auto ls = scheds[i++].initSlots(static_cast<unsigned>(slots.size()));
    for (unsigned j = 0; j < ls.size(); ++j) {
      auto a = ls[j].initActive(static_cast<unsigned>(slots[j].active.size()));
      for (unsigned x = 0; x < a.size(); ++x) a.set(x, std::uint32_t(slots[j].active[x]));
      auto f = ls[j].initFrozen(static_cast<unsigned>(slots[j].frozen.size()));
      for (unsigned x = 0; x < f.size(); ++x) f.set(x, std::uint32_t(slots[j].frozen[x]));
    }
  }
  out.setReorders(st->reorders);
  auto dec = out.initDecayed(static_cast<unsigned>(st->decayed.size()));
  for (unsigned j = 0; j < dec.size(); ++j) dec.set(j, st->decayed[j]);
  auto pend = out.initPending(static_cast<unsigned>(st->pending.size()));
  for (unsigned j = 0; j < pend.size(); ++j) pend.set(j, st->pending[j]);
  out.setPendingIteration(st->pending_iteration);
}

void checkpoint_agent::ship(std::int64_t iteration) {
  std::uint64_t window = 0;
  std::uint32_t slot = 0;
  std::size_t w_sparse = 1;
  pending_slot p;
  {
    std::lock_guard lock(shared_->mu);
    const auto bytes = shared_->capture.slot_of(iteration);
    if (!bytes || !shared_->schedule) return;
    const auto w = std::uint64_t(shared_->schedule->w_sparse());
    w_sparse = w;
    window = std::uint64_t(iteration) / w;
    slot = std::uint32_t(std::uint64_t(iteration) % w);
    // The capture's own buffer, as it is: it stays unchanged until its window is dropped,
    // which happens only after every copy of it was made (no copy here). Lent memory is a
    // region already (a replica on this host reads it with one RMA get); heap memory (the
    // pool had none free yet) is exported for this slot.
    if (const auto* lent = shared_->pool ? shared_->pool->lent_region(bytes->data()) : nullptr) {
      p.slot = lent->describe(0, bytes->size());
      p.share = shared_->pool->lent_share(bytes->data(), bytes->size());
    } else {
      p.region = io_.export_memory({const_cast<std::byte*>(bytes->data()), bytes->size()});
      p.slot = p.region.describe_all();
    }
    auto& r = replicated_[window];
    if (r.size() != w) r.assign(w, false);
  }
  auto& slot_state = pending_[{window, slot}] = std::move(p);
  send(window, slot, slot_state);
  // Regions for the slots that missed, on this thread as the link requires: as many of each
  // size as windows the capture holds (the capture reuses its windows' memory after that, so
  // the pool is asked only at the start and when a reorder grows a slot), and as many free
  // ones kept (a shared pool, which makes regions when the capture asks, keeps none).
  if (shared_->pool) {
    shared_->pool->refill(w_sparse * limits_.max_windows_held, limits_.max_windows_held);
  }
}

void checkpoint_agent::send(std::uint64_t window, std::uint32_t slot, pending_slot& p) {
  const auto d = p.slot;
  const auto share = p.share;
  const actor_ref me = self();
  for (const actor_ref& t : targets_) {
    if (std::find(p.asked.begin(), p.asked.end(), t) != p.asked.end()) continue;
    p.asked.push_back(t);
    (void)tell<wire::StoreSlot>(t, [&](wire::StoreSlot::Builder b) {
      write_key(b.initKey(), stage_, replica_, window, slot);
      transport::write_descriptor(b.initTensor(), d);
      write_ref(b.initFrom(), me);
      if (share) transport::write_share(b.initShare(), *share);
    });
  }
}

void checkpoint_agent::set_targets(std::vector<actor_ref> replicators) {
  targets_ = std::move(replicators);
  // Slots still waiting for copies go to the new targets (a lost replicator never answers).
  for (auto& [k, p] : pending_) {
    p.asked.clear();
    send(k.first, k.second, p);
  }
}

awaitable<void> checkpoint_agent::stored(wire::SlotStored::Reader m) {
  const auto key = m.getKey();
  if (key.getStage() != stage_ || key.getReplica() != replica_) co_return;
  const auto it = pending_.find({key.getWindow(), key.getSlot()});
  if (it == pending_.end() || !m.getOk()) co_return;
  // The answer names no sender we could trust more than the count: one more copy.
  ++it->second.copies;
  ++(m.getMapped() ? shared_->replica_maps : shared_->replica_pulls);
  const std::size_t need = std::min<std::size_t>(std::size_t(std::max(copies_, 1)),
                                                 std::max<std::size_t>(targets_.size(), 1));
  if (it->second.copies < need) co_return;
  const std::uint64_t window = key.getWindow();
  auto& r = replicated_[window];
  if (key.getSlot() < r.size()) r[key.getSlot()] = true;
  pending_.erase(it);
  check_window(window);
}

void checkpoint_agent::check_window(std::uint64_t window) {
  const auto& r = replicated_[window];
  if (r.empty() || !std::all_of(r.begin(), r.end(), [](bool b) { return b; })) return;
  std::int64_t first = 0;
  std::uint64_t digest = 0;
  {
    std::lock_guard lock(shared_->mu);
    if (!shared_->capture.complete(window)) return;  // started mid-window (a replacement)
    first = shared_->capture.first_iteration(window);
    digest = shared_->capture.schedule_digest(window);
  }
  (void)tell<engine::wire::WindowReplicated>(coordinator_,
                                             [&](engine::wire::WindowReplicated::Builder b) {
                                               b.setStage(stage_);
                                               b.setReplica(replica_);
                                               b.setWindow(window);
                                               b.setFirstIteration(first);
                                               b.setScheduleDigest(digest);
                                             });
}

awaitable<void> checkpoint_agent::persisted(engine::wire::WindowPersisted::Reader m) {
  const std::uint64_t window = m.getWindow();
  const bool durable = m.getDurable();
  std::vector<std::span<const std::byte>> slots;
  std::int64_t first = -1;
  {
    std::scoped_lock lock(shared_->mu, shared_->log_mu);
    if (durable && durable_.writer) {
      // Pinned until written: the next persisted window must not recycle its buffers.
      slots = shared_->capture.window_slots(window);
      if (!slots.empty()) {
        shared_->capture.pin(window);
        first = shared_->capture.first_iteration(window);
      }
    }
    shared_->capture.drop_before(window, m.getFirstIteration());
    shared_->dropped.notify_all();
  }
  replicated_.erase(replicated_.begin(), replicated_.lower_bound(window));
  for (auto it = pending_.begin(); it != pending_.end();) {
    it = it->first.first < window ? pending_.erase(it) : std::next(it);
  }
  if (durable) write_durable(window, first, std::move(slots));
  co_return;
}

awaitable<void> checkpoint_agent::abandoned(engine::wire::WindowsAbandoned::Reader m) {
  std::size_t n = 0;
  {
    std::lock_guard lock(shared_->mu);
    n = shared_->capture.abandon_ended_before(m.getBefore());
    if (n > 0) shared_->dropped.notify_all();
  }
  // The abandoned windows keep their regions until the next window persists: as many more
  // for the windows captured meanwhile, or they would go on the heap (read by rendezvous).
  if (n > 0 && shared_->pool) shared_->pool->grow(n);
  co_return;
}

void checkpoint_agent::write_durable(std::uint64_t window, std::int64_t first,
                                     std::vector<std::span<const std::byte>> slots) {
  if (!durable_.writer) {
    durable_done(window, 0, 0.0, "checkpoint.durable is off in this worker");
    return;
  }
  if (slots.empty()) {
    durable_done(window, 0, 0.0,
                 "this stage does not hold the whole window (it was rebuilt after it began)");
    return;
  }
  const durable_window_meta meta{stage_, replica_, window, first, int(slots.size())};
  // The job holds the capture (its pinned buffers) until it unpinned them.
  durable_.writer->post([shared = shared_, sys = &system(), me = self(), meta,
                         slots = std::move(slots), dir = durable_.dir,
                         keep = durable_.keep]() mutable {
    const auto t0 = std::chrono::steady_clock::now();
    std::uint64_t bytes = 0;
    std::string error;
    try {
      durable_store store(dir);
      bytes = write_durable_window(store, meta, slots);
      store.prune(keep);
    } catch (const std::exception& e) {
      error = fmt::format("{} (check the disk and checkpoint.dir)", e.what());
    }
    const double secs =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard lock(shared->mu);
      shared->capture.unpin(meta.window);
      shared->dropped.notify_all();
    }
    // `shared` is let go on the actor thread: if it is the last owner, its slot pool
    // withdraws regions from the link, which only that thread may do.
    asio::post(sys->io(),
               [sys, me, window = meta.window, bytes, secs, error, shared = std::move(shared)] {
                 (void)sys->post_call(me, [=](actors::actor& a) -> awaitable<void> {
                   static_cast<checkpoint_agent&>(a).durable_done(window, bytes, secs, error);
                   co_return;
                 });
               });
  });
}

void checkpoint_agent::durable_done(std::uint64_t window, std::uint64_t bytes, double seconds,
                                    const std::string& error) {
  (void)tell<engine::wire::DurableWritten>(coordinator_,
                                           [&](engine::wire::DurableWritten::Builder b) {
                                             b.setStage(stage_);
                                             b.setReplica(replica_);
                                             b.setWindow(window);
                                             b.setBytes(bytes);
                                             b.setSeconds(seconds);
                                             b.setError(error);
                                           });
}

awaitable<void> checkpoint_agent::fetch_log(wire::FetchLog::Reader m, wire::LogData::Builder out) {
  const std::int64_t from = m.getFromIteration(), to = m.getToIteration();
  const std::uint64_t mbs = m.getMicroBatches(), floats = m.getFloatsEach();
  const auto dir = m.getGradient() ? log_direction::gradient : log_direction::activation;
  if (from < 0 || to < from || to - from > (1 << 20) || mbs == 0 || mbs > 4096 || floats == 0 ||
      floats > limits_.max_log_bytes / sizeof(float)) {
    out.setError("malformed log request");
    co_return;
  }
  const std::uint64_t each = floats * sizeof(float);
  const std::uint64_t count = std::uint64_t(to - from + 1) * mbs;
  if (count > limits_.max_log_bytes / each) {
    out.setError(fmt::format("log request of {} tensors exceeds the limit", count));
    co_return;
  }
  transport::bulk_region region = io_.allocate(count * each);
  {
    std::lock_guard lock(shared_->log_mu);
    const log_store& log = shared_->capture.log();
    std::byte* dst = region.memory().data();
    for (std::int64_t it = from; it <= to; ++it) {
      for (std::uint32_t mb = 0; mb < mbs; ++mb) {
        const auto bytes = log.find({std::uint64_t(it), mb, dir, m.getReplica()});
        if (!bytes || bytes->size() != each) {
          out.setError(fmt::format(
              "stage {} replica {} has no logged {} of iteration {} micro-batch {} for replica {}",
              stage_, replica_, dir == log_direction::gradient ? "gradient" : "activation", it, mb,
              m.getReplica()));
          co_return;
        }
        std::memcpy(dst, bytes->data(), each);
        dst += each;
      }
    }
  }
  while (leases_.size() >= limits_.max_log_leases) leases_.erase(leases_.begin());
  const std::uint64_t lease = next_lease_++;
  transport::write_descriptor(out.initTensor(), region.describe_all());
  out.setLease(lease);
  leases_.emplace(lease, std::move(region));
}

awaitable<void> checkpoint_agent::release(wire::ReleaseLog::Reader m) {
  leases_.erase(m.getLease());
  co_return;
}

// ---- replicator

replicator::replicator(engine::bulk_io& io, policy_limits limits,
                       std::shared_ptr<durable_writer> durable, std::filesystem::path root,
                       bool share)
    : io_(io),
      limits_(limits),
      durable_(std::move(durable)),
      root_(std::move(root)),
      share_(share) {
  on<wire::StoreSlot>(&replicator::store);
  on<wire::FetchSlot, wire::SlotData>(&replicator::fetch);
  on<engine::wire::WindowPersisted>(&replicator::persisted);
  on<engine::wire::DurableQuery, engine::wire::DurableOffer>(&replicator::durable_query);
}

awaitable<void> replicator::durable_query(engine::wire::DurableQuery::Reader m,
                                          engine::wire::DurableOffer::Builder out) {
  const int stage = m.getStage(), replica = m.getReplica();
  std::vector<std::uint64_t> ok;
  std::vector<std::string> rejected;
  if (!durable_) {
    rejected.push_back("checkpoint.durable is off in this worker");
  } else if (stage < 0 || replica < 0 || stage >= engine::max_job_workers ||
             replica >= engine::max_job_workers) {
    rejected.push_back("malformed DurableQuery");
  } else {
    // Reading every window back (checksums) takes a while: off the actor thread, once the
    // writes in flight are done.
    co_await off_thread([&] {
      durable_->drain();
      const durable_store store(durable_window_dir(root_, stage, replica));
      ok = verified_durable_windows(store, stage, replica, &rejected);
    });
  }
  auto w = out.initWindows(static_cast<unsigned>(ok.size()));
  for (unsigned i = 0; i < w.size(); ++i) w.set(i, ok[i]);
  auto r = out.initRejected(static_cast<unsigned>(rejected.size()));
  for (unsigned i = 0; i < r.size(); ++i) {
    r.set(i, fmt::format("stage {} replica {}: {}", stage, replica, rejected[i]));
  }
}

bool replicator::store_mapped(const key& id, const actor_ref& from, wire::StoreSlot::Reader m,
                              std::uint64_t length) {
  // The owner's pages, mapped: no copy, and they outlive the owner (a second mapping keeps
  // them). It writes them again only for a window after the next persisted one, when this
  // replicator has dropped this one too. Anything wrong (another host, a handle that names
  // other memory): pull a copy instead.
  const auto h = transport::read_share(m.getShare());
  if (!h.ok() || h->length != length) return false;
  auto mapped = transport::shared_memory::open(*h);
  if (!mapped.ok()) return false;
  const auto bytes = mapped->memory().subspan(h->offset, h->length);
  const auto& [stage, replica, window, slot] = id;
  const auto tag = read_snapshot_tag(bytes);
  std::string error;
  if (!tag || tag->stage != stage || tag->replica != replica || tag->window != window ||
      tag->slot != slot) {
    error = "the mapped bytes are not the slot offered";
  } else {
    stored_slot s;
    s.length = length;
    s.offset = h->offset;
    s.mapped = std::make_shared<transport::shared_memory>(std::move(*mapped));
    slots_[id] = std::move(s);
  }
  (void)tell<wire::SlotStored>(from, [&](wire::SlotStored::Builder b) {
    write_key(b.initKey(), stage, replica, window, slot);
    b.setOk(error.empty());
    b.setError(error);
    b.setMapped(error.empty());
  });
  return true;
}

std::size_t replicator::bytes_held() const {
  // Copies only: a mapped slot is its owner's memory (counted there while it lives).
  std::size_t n = 0;
  for (const auto& [k, r] : slots_) n += r.region.memory().size();
  for (const auto& [length, r] : spare_) n += r.memory().size();
  return n;
}

awaitable<void> replicator::store(wire::StoreSlot::Reader m) {
  const auto k = m.getKey();
  const actor_ref from = read_ref(m.getFrom());
  const key id{k.getStage(), k.getReplica(), k.getWindow(), k.getSlot()};
  auto answer = [&](bool ok, const std::string& error) {
    (void)tell<wire::SlotStored>(from, [&](wire::SlotStored::Builder b) {
      write_key(b.initKey(), k.getStage(), k.getReplica(), k.getWindow(), k.getSlot());
      b.setOk(ok);
      b.setError(error);
    });
  };
  auto d = transport::read_descriptor(m.getTensor());
  if (!from.valid() || !d.ok() || d->node != from.node || d->length > limits_.max_slot_bytes) {
    if (from.valid()) answer(false, "malformed StoreSlot");
    co_return;
  }
  if (k.getWindow() < persisted_) {
    answer(false, "window older than the persisted one");
    co_return;
  }
  if (share_ && m.hasShare() && store_mapped(id, from, m, d->length)) co_return;
  // The pull runs in an actor of its own: a peer that hangs mid-pull must not keep this
  // replicator from serving FetchSlot to a recovery (the copy it holds is what is needed).
  // As an actor (not a detached coroutine) it is cancelled with the system at shutdown.
  transport::bulk_region region;
  // The smallest spare region that holds it: after a recovery a replicator may hold another
  // stage's slots, of other sizes.
  if (const auto spare = spare_.lower_bound(d->length); spare != spare_.end()) {
    region = std::move(spare->second);
    spare_.erase(spare);
  } else {
    region = io_.allocate(d->length);
  }
  auto holder = std::make_shared<transport::bulk_region>(std::move(region));
  (void)system().spawn<slot_puller>(io_, *d, holder, limits_.pull_chunk_bytes, self(), id, from);
  co_return;
}

slot_puller::slot_puller(engine::bulk_io& io, transport::bulk_descriptor desc,
                         std::shared_ptr<transport::bulk_region> holder, std::uint64_t chunk,
                         actor_ref replicator, replicator::key id, actor_ref from)
    : io_(io),
      desc_(desc),
      holder_(std::move(holder)),
      chunk_(chunk),
      replicator_(replicator),
      id_(id),
      from_(from) {}

awaitable<void> slot_puller::on_start() {
  auto r =
      co_await pull_chunked(io_, desc_, holder_->memory().first(desc_.length), holder_, chunk_);
  std::string error = r.ok() ? std::string() : "pull failed: " + r.err().message;
  if (error.empty()) {
    // A late pull (the sender gave the slot's memory to a newer capture) reads another
    // slot: refused, not stored. (The full checksum is checked when a recovery loads it.)
    const auto& [stage, replica, window, slot] = id_;
    const auto tag = read_snapshot_tag(holder_->memory().first(desc_.length));
    if (!tag || tag->stage != stage || tag->replica != replica || tag->window != window ||
        tag->slot != slot) {
      error = "the pulled bytes are not the slot asked for (its buffer was reused meanwhile)";
    }
  }
  (void)system().post_call(replicator_,
                           [holder = holder_, id = id_, from = from_, length = desc_.length,
                            error](actors::actor& a) -> awaitable<void> {
                             static_cast<replicator&>(a).finish_store(id, from, holder, length,
                                                                      error);
                             co_return;
                           });
  quit();
}

void replicator::finish_store(const key& id, const actor_ref& from,
                              const std::shared_ptr<transport::bulk_region>& holder,
                              std::uint64_t length, const std::string& error) {
  const auto& [stage, replica, window, slot] = id;
  const bool ok = error.empty() && window >= persisted_;
  if (ok) {
    stored_slot s;
    s.region = std::move(*holder);
    s.length = length;
    slots_[id] = std::move(s);
  }
  (void)tell<wire::SlotStored>(from, [&](wire::SlotStored::Builder b) {
    write_key(b.initKey(), stage, replica, window, slot);
    b.setOk(ok);
    b.setError(ok ? std::string() : error.empty() ? "window older than the persisted one" : error);
  });
}

awaitable<void> replicator::fetch(wire::FetchSlot::Reader m, wire::SlotData::Builder out) {
  const auto k = m.getKey();
  const auto it = slots_.find(key{k.getStage(), k.getReplica(), k.getWindow(), k.getSlot()});
  out.setFound(it != slots_.end());
  if (it == slots_.end()) co_return;
  stored_slot& s = it->second;
  if (!s.mapped) {
    transport::write_descriptor(out.initTensor(), s.region.describe(0, s.length));
    co_return;
  }
  // A puller on this host maps it in turn; one elsewhere pulls it from an export of the
  // mapping, made once.
  transport::write_share(out.initShare(), s.mapped->share(s.offset, s.length));
  if (s.exported.memory().empty()) {
    s.exported = io_.export_memory(s.mapped->memory().subspan(s.offset, s.length));
  }
  transport::write_descriptor(out.initTensor(), s.exported.describe_all());
  co_return;
}

awaitable<void> replicator::persisted(engine::wire::WindowPersisted::Reader m) {
  persisted_ = std::max(persisted_, m.getWindow());
  // No recovery pulls a window older than the persisted one (the coordinator does not advance
  // it during a recovery's pulls), so its regions may take the next window's slots. Spares the
  // window before left unused are freed.
  std::multimap<std::uint64_t, transport::bulk_region> dropped;
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (std::get<2>(it->first) < persisted_) {
      if (!it->second.region.memory().empty()) {
        dropped.emplace(it->second.region.memory().size(), std::move(it->second.region));
      }
      it = slots_.erase(it);
    } else {
      ++it;
    }
  }
  if (!dropped.empty()) spare_ = std::move(dropped);
  co_return;
}

// ---- the worker's policy

moevement_checkpoint::moevement_checkpoint(actors::actor_system& system, engine::bulk_io& io,
                                           const engine::job_config& job, policy_limits limits)
    : system_(system), io_(io), job_(job), limits_(limits) {
  if (engine::durable_tier(job_)) durable_ = std::make_shared<durable_writer>();
  replicator_ = system_.spawn<recovery::replicator>(io_, limits_, durable_, job_.baseline.dir,
                                                    job_.share_memory);
  inbox_ = std::make_shared<group_inbox>(system_.io());
  exchange_ = system_.spawn<recovery::group_exchange>(inbox_);
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
  {
    // Algorithm 1's bandwidth: how fast this process writes snapshot bytes, measured on the
    // stage's first operators up to a sample of policy_limits::bandwidth_sample_bytes (this
    // runs on the actor thread: a whole-stage copy could outlast a heartbeat).
    std::vector<const models::operator_state*> sample;
    std::vector<capture_kind> kinds;
    std::size_t bytes = 0;
    for (const auto* op : ops) {
      const auto s = sparse_sizes(*op);
      const std::uint64_t full = s.master_bytes + s.optim_bytes;
      if (!sample.empty() && bytes + full > limits_.bandwidth_sample_bytes) break;
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
      for (int i = 0; i < limits_.bandwidth_samples; ++i) {
        const double copy = d->time_copy(dst);
        const auto t0 = std::chrono::steady_clock::now();
        (void)xxh3_64(dst);
        keep_best(copy +
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    } else {
      std::vector<std::byte> buf(size);
      for (int i = 0; i < limits_.bandwidth_samples; ++i) {
        const auto t0 = std::chrono::steady_clock::now();
        write_snapshot(buf, {}, models::loss_scaler{}, sample, kinds);
        keep_best(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
    }
    bandwidth_ = best;
  }
  auto shared = std::make_shared<capture_shared>(setup.stage, setup.replica);
  shared->pool = std::make_unique<slot_pool>(io_, job_.share_memory);
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
  sparse_config config;
  config.order_by = parse_ordering(job_.ordering);
  config.decay_alpha = job_.decay_alpha;
  config.reorder.change_threshold = job_.reorder_change;
  config.reorder.fraction_threshold = job_.reorder_fraction;
  return std::make_unique<checkpoint_hooks>(shared, system_, agent_, std::move(ops), limits_,
                                            std::move(config));
}

awaitable<std::unique_ptr<engine::stage_model>> moevement_checkpoint::restore(
    engine::wire::Restore::Reader plan, const engine::stage_factory& factory,
    engine::stage_setup setup) {
  fresh_ = false;
  // Hooks of an older generation's stage are gone with its stage actor; its agent goes too.
  if (agent_.valid()) system_.stop(agent_);
  agent_ = {};
  restored_log_.reset();
  restored_schedule_.reset();
  restored_regions_.clear();
  restored_files_.clear();
  restored_w_ = 0;
  timing_ = {};
  restore_context ctx{system_, io_, job_, limits_, durable_.get(), inbox_};
  restored_stage r = co_await restore_region(std::move(ctx), plan, factory, std::move(setup));
  restored_log_ = std::move(r.log);
  restored_schedule_ = std::move(r.schedule);
  restored_regions_ = std::move(r.regions);
  restored_files_ = std::move(r.files);
  restored_w_ = r.w;
  timing_ = r.timing;
  co_return std::move(r.model);
}

engine::checkpoint_factory policy_factory(policy_limits limits) {
  return [limits](actors::actor_system& system, engine::bulk_io& io,
                  const engine::job_config& job) -> std::unique_ptr<engine::worker_checkpoint> {
    if (job.policy != engine::policy_kind::moevement) return nullptr;
    return std::make_unique<moevement_checkpoint>(system, io, job, limits);
  };
}

}  // namespace moevement::recovery
