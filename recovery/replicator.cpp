#include "recovery/replicator.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <set>
#include <stdexcept>

#include "recovery/snapshot.hpp"
#include "recovery/worker_tasks.hpp"

namespace moevement::recovery {

using actors::actor_ref;
using actors::read_ref;
using actors::write_ref;
using asio::awaitable;

void write_slot_key(wire::SlotKey::Builder b, int stage, int replica, std::uint64_t window,
                    std::uint32_t slot) {
  b.setStage(stage);
  b.setReplica(replica);
  b.setWindow(window);
  b.setSlot(slot);
}

replicator::replicator(engine::bulk_io& io, policy_limits limits,
                       std::shared_ptr<durable_writer> durable, std::filesystem::path root,
                       bool share, std::shared_ptr<replication_cpu> cpu)
    : io_(io),
      limits_(limits),
      durable_(std::move(durable)),
      root_(std::move(root)),
      share_(share),
      cpu_(std::move(cpu)) {
  on<wire::StoreSlot>(&replicator::store);
  on<wire::StoreSlots>(&replicator::store_all);
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

std::optional<replicator::store_answer> replicator::store_mapped(const key& id,
                                                                 const actor_ref& from,
                                                                 wire::StoreSlot::Reader m,
                                                                 std::uint64_t length) {
  // The owner's pages, mapped: no copy, and they outlive the owner (a second mapping keeps
  // them). It writes them again only for a window after the next persisted one, when this
  // replicator has dropped this one too. Anything wrong (another host, a handle that names
  // other memory): pull a copy instead.
  const auto h = transport::read_share(m.getShare());
  if (!h.ok() || h->length != length || h->offset > h->size || h->length > h->size - h->offset) {
    return std::nullopt;
  }
  const std::tuple<std::int32_t, std::uint64_t, std::uint64_t> file{h->pid, h->device, h->inode};
  std::shared_ptr<transport::shared_memory> mapped;
  if (const auto f = files_.find(file); f != files_.end() &&
                                        f->second->memory().size() == h->size &&
                                        h->host == transport::host_tag() && f->second->whole()) {
    mapped = f->second;
  } else {
    auto opened = transport::shared_memory::open(*h);
    if (!opened.ok()) return std::nullopt;
    mapped = std::make_shared<transport::shared_memory>(std::move(*opened));
  }
  const auto bytes = mapped->memory().subspan(h->offset, h->length);
  const auto& [stage, replica, window, slot] = id;
  const auto tag = read_snapshot_tag(bytes);
  store_answer a;
  a.from = from;
  a.id = id;
  if (!tag || tag->stage != stage || tag->replica != replica || tag->window != window ||
      tag->slot != slot) {
    a.error = "the mapped bytes are not the slot offered";
  } else {
    stored_slot s;
    s.length = length;
    s.offset = h->offset;
    files_[file] = mapped;  // only a file that held the slot offered is kept
    s.mapped = std::move(mapped);
    s.file = file;
    slots_[id] = std::move(s);
    a.ok = a.mapped = true;
  }
  return a;
}

std::size_t replicator::bytes_held() const {
  // Copies only: a mapped slot is its owner's memory (counted there while it lives).
  std::size_t n = 0;
  for (const auto& [k, r] : slots_) n += r.region.memory().size();
  for (const auto& [length, r] : spare_) n += r.memory().size();
  return n;
}

awaitable<void> replicator::store(wire::StoreSlot::Reader m) {
  const replication_cpu::scope measured(cpu_.get());
  if (auto a = offer(m)) answer({std::move(*a)});
  co_return;
}

awaitable<void> replicator::store_all(wire::StoreSlots::Reader m) {
  const replication_cpu::scope measured(cpu_.get());
  const auto slots = m.getSlots();
  if (slots.size() > limits_.max_store_batch) co_return;  // malformed: nothing is taken
  std::vector<store_answer> now;
  for (const auto s : slots) {
    if (auto a = offer(s)) now.push_back(std::move(*a));
  }
  answer(now);
  co_return;
}

void replicator::answer(const std::vector<store_answer>& answers) {
  std::vector<bool> sent(answers.size(), false);
  for (std::size_t i = 0; i < answers.size(); ++i) {
    if (sent[i]) continue;
    std::vector<const store_answer*> to;  // every answer for this agent
    for (std::size_t j = i; j < answers.size(); ++j) {
      if (!sent[j] && answers[j].from == answers[i].from) {
        to.push_back(&answers[j]);
        sent[j] = true;
      }
    }
    auto write = [](wire::SlotStored::Builder b, const store_answer& a) {
      const auto& [stage, replica, window, slot] = a.id;
      write_slot_key(b.initKey(), stage, replica, window, slot);
      b.setOk(a.ok);
      b.setError(a.error);
      b.setMapped(a.mapped);
    };
    if (to.size() == 1) {
      (void)tell<wire::SlotStored>(to[0]->from,
                                   [&](wire::SlotStored::Builder b) { write(b, *to[0]); });
      continue;
    }
    (void)tell<wire::SlotsStored>(to[0]->from, [&](wire::SlotsStored::Builder b) {
      auto l = b.initAnswers(static_cast<unsigned>(to.size()));
      for (unsigned k = 0; k < l.size(); ++k) write(l[k], *to[k]);
    });
  }
}

std::optional<replicator::store_answer> replicator::offer(wire::StoreSlot::Reader m) {
  const auto k = m.getKey();
  const actor_ref from = read_ref(m.getFrom());
  const key id{k.getStage(), k.getReplica(), k.getWindow(), k.getSlot()};
  auto refused = [&](const char* why) -> std::optional<store_answer> {
    store_answer a;
    a.from = from;
    a.id = id;
    a.error = why;
    return a;
  };
  auto d = transport::read_descriptor(m.getTensor());
  if (!from.valid()) return std::nullopt;
  if (!d.ok() || d->node != from.node || d->length > limits_.max_slot_bytes) {
    return refused("malformed StoreSlot");
  }
  if (k.getWindow() < persisted_) return refused("window older than the persisted one");
  if (share_ && m.hasShare()) {
    if (auto a = store_mapped(id, from, m, d->length)) return a;
  }
  if (limits_.accept_copy_flips && m.getFlipBit() >= 0 &&
      std::uint64_t(m.getFlipBit()) / 8 < d->length) {
    flips_[id] = std::uint64_t(m.getFlipBit());
  }
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
  (void)system().spawn<slot_puller>(io_, *d, holder, limits_.pull_chunk_bytes, self(), id, from,
                                    timeline_);
  return std::nullopt;
}

slot_puller::slot_puller(engine::bulk_io& io, transport::bulk_descriptor desc,
                         std::shared_ptr<transport::bulk_region> holder, std::uint64_t chunk,
                         actor_ref replicator, replicator::key id, actor_ref from,
                         std::uint64_t timeline)
    : io_(io),
      desc_(desc),
      holder_(std::move(holder)),
      chunk_(chunk),
      replicator_(replicator),
      id_(id),
      from_(from),
      timeline_(timeline) {}

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
                           [holder = holder_, id = id_, from = from_, length = desc_.length, error,
                            timeline = timeline_](actors::actor& a) -> awaitable<void> {
                             static_cast<replicator&>(a).finish_store(id, from, holder, length,
                                                                      error, timeline);
                             co_return;
                           });
  quit();
}

void replicator::finish_store(const key& id, const actor_ref& from,
                              const std::shared_ptr<transport::bulk_region>& holder,
                              std::uint64_t length, const std::string& error,
                              std::uint64_t timeline) {
  const replication_cpu::scope measured(cpu_.get());
  const auto& [stage, replica, window, slot] = id;
  const bool ok = error.empty() && window >= persisted_ && timeline == timeline_;
  if (ok) {
    stored_slot s;
    s.region = std::move(*holder);
    s.length = length;
    if (const auto f = flips_.find(id); f != flips_.end()) {
      s.region.memory()[f->second / 8] ^= std::byte(1u << (f->second % 8));
      const std::string line = fmt::format(
          "inject: flipped bit {} of the copy of stage {} replica {} window {} slot {} held by "
          "worker {}\n",
          f->second, stage, replica, window, slot, system().node());
      std::fwrite(line.data(), 1, line.size(), stdout);
      std::fflush(stdout);
    }
    slots_[id] = std::move(s);
  }
  flips_.erase(id);
  (void)tell<wire::SlotStored>(from, [&](wire::SlotStored::Builder b) {
    write_slot_key(b.initKey(), stage, replica, window, slot);
    b.setOk(ok);
    b.setError(ok                      ? std::string()
               : !error.empty()        ? error
               : timeline != timeline_ ? "of a timeline the job left (it restarted from disk)"
                                       : "window older than the persisted one");
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
  const replication_cpu::scope measured(cpu_.get());
  if (m.getRestart()) {
    // The job went back to a durable window (a standby head's restore from disk, a resume):
    // every copy held is of a timeline left, and the windows after this one are numbered anew
    // (taken again, not refused as older than the last timeline's persisted one).
    ++timeline_;
    persisted_ = m.getWindow();
    for (auto& [id, s] : slots_) {
      if (!s.region.memory().empty()) {
        spare_.emplace(s.region.memory().size(), std::move(s.region));
      }
    }
    slots_.clear();
    flips_.clear();
    co_return;
  }
  persisted_ = std::max(persisted_, m.getWindow());
  // No recovery pulls a window older than the persisted one (the coordinator does not advance
  // it during a recovery's pulls), so its regions may take the next window's slots. Spares the
  // window before left unused are freed.
  // Older windows the head retains (a shadow check replays from one) stay too.
  std::set<std::uint64_t> kept;
  for (const auto w : m.getRetained()) kept.insert(w);
  std::multimap<std::uint64_t, transport::bulk_region> dropped;
  std::map<std::tuple<std::int32_t, std::uint64_t, std::uint64_t>,
           std::shared_ptr<transport::shared_memory>>
      files;  // those of the slots kept and of the ones dropped now
  for (auto it = slots_.begin(); it != slots_.end();) {
    if (it->second.mapped) files.emplace(it->second.file, it->second.mapped);
    const std::uint64_t window = std::get<2>(it->first);
    if (window < persisted_ && !kept.contains(window)) {
      if (!it->second.region.memory().empty()) {
        dropped.emplace(it->second.region.memory().size(), std::move(it->second.region));
      }
      it = slots_.erase(it);
    } else {
      ++it;
    }
  }
  if (!dropped.empty()) spare_ = std::move(dropped);
  files_ = std::move(files);
  co_return;
}

}  // namespace moevement::recovery
