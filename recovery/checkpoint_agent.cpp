#include "recovery/checkpoint_agent.hpp"

#include <fmt/format.h>
#include <asio/post.hpp>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <set>
#include <stdexcept>
#include <thread>

#include "recovery/replicator.hpp"
#include "recovery/snapshot.hpp"
#include "recovery/worker_tasks.hpp"

namespace moevement::recovery {

using actors::actor_ref;
using actors::read_ref;
using actors::write_ref;
using asio::awaitable;

void release_capture(std::shared_ptr<capture_shared>& shared, actors::actor_system& system) {
  if (shared && !system.io().get_executor().running_in_this_thread()) {
    // Dropped off the actor thread (actor_system::dispose): the pool's regions are the link's.
    asio::post(system.io(),
               [s = std::move(shared), sys = &system]() mutable { release_capture(s, *sys); });
    return;
  }
  if (shared && shared.use_count() == 1 && shared->pool) {
    system.dispose(shared->pool->release_files());
  }
  shared.reset();
}

checkpoint_agent::~checkpoint_agent() {
  release_capture(shared_, system());
}

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
  on<wire::SlotsStored>(&checkpoint_agent::stored_all);
  on<engine::wire::WindowPersisted>(&checkpoint_agent::persisted);
  on<engine::wire::WindowsAbandoned>(&checkpoint_agent::abandoned);
  on<engine::wire::SnapshotTargets>(&checkpoint_agent::retarget);
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
  out.setPendingWindow(st->pending_window);
}

void checkpoint_agent::ship(std::int64_t iteration) {
  const replication_cpu::scope measured(shared_->replication.get());
  std::uint64_t window = 0;
  std::uint32_t slot = 0;
  std::size_t w_sparse = 1;
  pending_slot p;
  {
    std::lock_guard lock(shared_->mu);
    const auto bytes = shared_->capture.slot_of(iteration);
    const auto place = shared_->capture.place_of(iteration);
    if (!bytes || !place || !shared_->schedule) return;
    const auto w = std::uint64_t(place->w_sparse);
    w_sparse = w;
    last_w_ = w;
    window = place->window;
    slot = place->slot;
    auto& r = replicated_[window];
    if (r.size() != w) r.assign(w, false);
    if (!(placed_ && targets_.empty())) {  // else no other worker to hold a copy: none to offer
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
    }
  }
  if (placed_ && targets_.empty()) {  // its own capture is the window's only copy
    slot_replicated(window, slot);
    refill_pool(w_sparse);
    return;
  }
  if (copy_flip_) {
    if (const int bit = copy_flip_(iteration); bit >= 0) {
      p.flip_bit = std::int64_t(p.slot.length / 2) * 8 + bit;
    }
  }
  unsent_bytes_ += p.slot.length;
  pending_[{window, slot}] = std::move(p);
  unsent_.emplace_back(window, slot);
  if (slot + 1 >= w_sparse || unsent_bytes_ >= limits_.store_batch_bytes) flush();
  refill_pool(w_sparse);
}

actor_ref checkpoint_agent::flip_holder() const {
  // A flip injected into a copy goes to the first holder (the lowest node), which a restore
  // asks first, so that the restore meets the bad copy before the good one.
  actor_ref flip_at;
  for (const actor_ref& t : targets_) {
    if (!flip_at.valid() || t.node < flip_at.node) flip_at = t;
  }
  return flip_at;
}

void checkpoint_agent::write_offer(wire::StoreSlot::Builder b, std::uint64_t window,
                                   std::uint32_t slot, pending_slot& p, const actor_ref& to,
                                   const actor_ref& flip_at) {
  write_slot_key(b.initKey(), stage_, replica_, window, slot);
  transport::write_descriptor(b.initTensor(), p.slot);
  write_ref(b.initFrom(), self());
  if (p.share) transport::write_share(b.initShare(), *p.share);
  if (p.flip_bit >= 0 && to == flip_at) b.setFlipBit(std::exchange(p.flip_bit, -1));
  p.asked.push_back(to);
}

void checkpoint_agent::flush() {
  const auto shipped = std::exchange(unsent_, {});
  unsent_bytes_ = 0;
  const actor_ref flip_at = flip_holder();
  for (const actor_ref& t : targets_) {
    std::vector<std::pair<std::uint64_t, std::uint32_t>> offer;
    for (const auto& k : shipped) {
      const auto it = pending_.find(k);  // gone: its window was dropped meanwhile
      if (it == pending_.end()) continue;
      const auto& asked = it->second.asked;
      if (std::find(asked.begin(), asked.end(), t) == asked.end()) offer.push_back(k);
    }
    for (std::size_t at = 0; at < offer.size(); at += limits_.max_store_batch) {
      const std::size_t n = std::min(limits_.max_store_batch, offer.size() - at);
      if (n == 1) {
        auto& p = pending_.at(offer[at]);
        (void)tell<wire::StoreSlot>(t, [&](wire::StoreSlot::Builder b) {
          write_offer(b, offer[at].first, offer[at].second, p, t, flip_at);
        });
        continue;
      }
      (void)tell<wire::StoreSlots>(t, [&](wire::StoreSlots::Builder b) {
        auto l = b.initSlots(static_cast<unsigned>(n));
        for (unsigned i = 0; i < n; ++i) {
          const auto& k = offer[at + i];
          write_offer(l[i], k.first, k.second, pending_.at(k), t, flip_at);
        }
      });
    }
  }
}

void checkpoint_agent::refill_pool(std::size_t w_sparse) {
  // Regions for the slots that missed, on this thread as the link requires: as many of each
  // size as windows the capture holds (the capture reuses its windows' memory after that, so
  // the pool is asked only at the start and when a reorder grows a slot), and as many free
  // ones kept (a shared pool, which makes regions when the capture asks, keeps none).
  if (shared_->pool) {
    shared_->pool->refill(w_sparse * limits_.max_windows_held, limits_.max_windows_held);
  }
}

void checkpoint_agent::send(std::uint64_t window, std::uint32_t slot, pending_slot& p) {
  const actor_ref flip_at = flip_holder();
  for (const actor_ref& t : targets_) {
    if (std::find(p.asked.begin(), p.asked.end(), t) != p.asked.end()) continue;
    (void)tell<wire::StoreSlot>(
        t, [&](wire::StoreSlot::Builder b) { write_offer(b, window, slot, p, t, flip_at); });
  }
}

void checkpoint_agent::set_targets(std::vector<actor_ref> replicators) {
  targets_ = std::move(replicators);
  placed_ = true;
  if (targets_.empty()) {  // nobody left to copy to: what waits for copies has all it gets
    std::vector<std::pair<std::uint64_t, std::uint32_t>> waiting;
    for (const auto& [k, p] : pending_) waiting.push_back(k);
    for (const auto& [window, slot] : waiting) {
      pending_.erase({window, slot});
      slot_replicated(window, slot);
    }
    return;
  }
  // Slots still waiting for copies go to the new targets (a lost replicator never answers).
  for (auto& [k, p] : pending_) {
    p.asked.clear();
    send(k.first, k.second, p);
  }
}

awaitable<void> checkpoint_agent::retarget(engine::wire::SnapshotTargets::Reader m) {
  if (m.getReplicators().size() > limits_.max_snapshot_targets) co_return;  // not the head's
  std::vector<actor_ref> targets;
  for (auto a : m.getReplicators()) targets.push_back(read_ref(a));
  set_targets(std::move(targets));
}

awaitable<void> checkpoint_agent::stored(wire::SlotStored::Reader m) {
  const replication_cpu::scope measured(shared_->replication.get());
  note_stored(m);
  co_return;
}

awaitable<void> checkpoint_agent::stored_all(wire::SlotsStored::Reader m) {
  const replication_cpu::scope measured(shared_->replication.get());
  for (const auto a : m.getAnswers()) note_stored(a);
  co_return;
}

void checkpoint_agent::note_stored(wire::SlotStored::Reader m) {
  const auto key = m.getKey();
  if (key.getStage() != stage_ || key.getReplica() != replica_) return;
  const auto it = pending_.find({key.getWindow(), key.getSlot()});
  if (it == pending_.end() || !m.getOk()) return;
  // The answer names no sender we could trust more than the count: one more copy.
  ++it->second.copies;
  ++(m.getMapped() ? shared_->replica_maps : shared_->replica_pulls);
  const std::size_t need = std::min<std::size_t>(std::size_t(std::max(copies_, 1)),
                                                 std::max<std::size_t>(targets_.size(), 1));
  if (it->second.copies < need) return;
  pending_.erase(it);
  slot_replicated(key.getWindow(), key.getSlot());
}

void checkpoint_agent::slot_replicated(std::uint64_t window, std::uint32_t slot) {
  auto& r = replicated_[window];
  if (slot < r.size()) r[slot] = true;
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
  const replication_cpu::scope measured(shared_->replication.get());
  const std::uint64_t window = m.getWindow();
  const bool durable = m.getDurable();
  durable_kept_.clear();
  for (const auto w : m.getDurableKept()) durable_kept_.insert(w);
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
    std::set<std::uint64_t> keep;
    for (const auto w : m.getRetained()) keep.insert(w);
    shared_->capture.drop_before(window, m.getFirstIteration(), keep, m.getRetainedFirst());
    shared_->dropped.notify_all();
  }
  // The dropped windows' memory the capture did not keep goes back now, not at the next ship.
  refill_pool(last_w_);
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
    durable_done(window, {.error = "checkpoint.durable is off in this worker"});
    return;
  }
  if (slots.empty()) {
    durable_done(window, {.error = "this stage does not hold the whole window (it was rebuilt "
                                   "after it began)"});
    return;
  }
  const durable_window_meta meta{stage_, replica_, window, first, int(slots.size())};
  // engine.durable_fail_from (tests): this role's disk failing.
  const bool fail = durable_.fail_from >= 0 && window >= std::uint64_t(durable_.fail_from);
  // The job holds the capture (its pinned buffers) until it unpinned them.
  durable_.writer->post([shared = shared_, sys = &system(), me = self(), meta,
                         slots = std::move(slots), dir = durable_.dir, keep = durable_.keep,
                         also = durable_kept_, delay = durable_.delay, fail]() mutable {
    std::this_thread::sleep_for(delay);
    const auto t0 = std::chrono::steady_clock::now();
    const double cpu0 = engine::thread_cpu_seconds();
    durable_result r;
    try {
      if (fail) throw std::runtime_error("engine.durable_fail_from: this role's writes fail");
      durable_store store(dir);
      r.bytes = write_durable_window(store, meta, slots);
      store.prune(keep, also);
    } catch (const std::exception& e) {
      r.error = fmt::format("{} (check the disk and checkpoint.dir)", e.what());
    }
    r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    r.cpu_s = engine::thread_cpu_seconds() - cpu0;
    {
      std::lock_guard lock(shared->mu);
      shared->capture.unpin(meta.window);
      shared->dropped.notify_all();
    }
    // `shared` is let go on the actor thread: if it is the last owner, its slot pool
    // withdraws regions from the link, which only that thread may do.
    asio::post(sys->io(), [sys, me, window = meta.window, r = std::move(r),
                           shared = std::move(shared)]() mutable {
      (void)sys->post_call(me, [=](actors::actor& a) -> awaitable<void> {
        static_cast<checkpoint_agent&>(a).durable_done(window, r);
        co_return;
      });
      release_capture(shared, *sys);
    });
  });
}

void checkpoint_agent::durable_done(std::uint64_t window, const durable_result& r) {
  (void)tell<engine::wire::DurableWritten>(coordinator_,
                                           [&](engine::wire::DurableWritten::Builder b) {
                                             b.setStage(stage_);
                                             b.setReplica(replica_);
                                             b.setWindow(window);
                                             b.setBytes(r.bytes);
                                             b.setSeconds(r.seconds);
                                             b.setCpuSeconds(r.cpu_s);
                                             b.setError(r.error);
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
  shared_->copier.settle();  // the sends whose copies are still queued (none waits here long)
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

}  // namespace moevement::recovery
