#include "recovery/baseline_policy.hpp"

#include <fmt/format.h>
#include <asio/co_spawn.hpp>
#include <asio/post.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <set>
#include <stdexcept>

#include "base/clock.hpp"
#include "base/hash.hpp"
#include "recovery/baseline_recovery.hpp"
#include "recovery/moevement_policy.hpp"
#include "recovery/region_supervisor.hpp"
#include "recovery/sparse_capture.hpp"
#include "recovery/worker_tasks.hpp"

namespace moevement::recovery {

namespace {

using actors::actor_ref;
using actors::read_ref;
using actors::write_ref;
using asio::awaitable;
using sclock = std::chrono::steady_clock;

// Windows dense-disk keeps per stage replica: checkpoint.keep verified ones behind what the
// slowest stage may not have on disk yet. Persisting runs in the background and a stage may
// lag another by up to three snapshots (two buffers in flight, one step more on the
// survivors of a loss during the step phase): a stage that pruned to only `keep` windows could
// hold none of the ones the lost stage has, and the global rollback would find no common one.
// dense-memory checkpoints kept by a stage and its holders (see the capture).
constexpr std::size_t memory_checkpoints_kept = 3;

int disk_windows_kept(const policy_config& c) {
  return c.keep + 3;
}

baseline_kind kind_of(engine::policy_kind policy) {
  switch (policy) {
    case engine::policy_kind::dense_memory:
      return baseline_kind::dense_memory;
    case engine::policy_kind::dense_disk:
      return baseline_kind::dense_disk;
    case engine::policy_kind::pec:
      return baseline_kind::pec;
    default:
      throw std::invalid_argument("not a baseline policy: " + engine::policy_name(policy));
  }
}

}  // namespace

held_checkpoint held_on_heap(std::shared_ptr<std::vector<std::byte>> bytes,
                             std::size_t snapshot_size) {
  const std::span<std::byte> view(*bytes);
  return {view, std::move(bytes), snapshot_size};
}

namespace {

std::span<const std::byte> snapshot_part(const held_checkpoint& c) {
  return std::span<const std::byte>(c.bytes).first(c.snapshot_size);
}
std::span<const std::byte> trailer_part(const held_checkpoint& c) {
  return std::span<const std::byte>(c.bytes).subspan(c.snapshot_size);
}

// The stage's hooks (compute thread): the capture of the policy every k iterations.
class baseline_hooks : public engine::stage_hooks {
 public:
  baseline_hooks(std::shared_ptr<baseline_shared> shared, actors::actor_system& system,
                 actor_ref agent, std::vector<models::operator_state*> ops, baseline_kind kind,
                 policy_config config, int stage, int replica, engine::device_state* device,
                 models::expert_split split)
      : device_(device),
        split_(split),
        shared_(std::move(shared)),
        system_(system),
        agent_(agent),
        ops_(std::move(ops)),
        kind_(kind),
        config_(std::move(config)),
        stage_(stage),
        replica_(replica) {}

  void before_step(std::int64_t, const engine::checkpoint_step& decided) override {
    popularity_.assign(decided.popularity.begin(), decided.popularity.end());
    std::lock_guard lock(shared_->mu);
    if (decided.place.w_sparse > 0 && shared_->interval == 0) {
      start_captures(decided.place.w_sparse);
    }
  }

  void after_step(std::int64_t iteration, std::span<models::operator_state* const> ops) override {
    const auto t0 = sclock::now();
    const double cpu0 = engine::thread_cpu_seconds();
    snapshot_bytes_ = 0;
    lent_bytes_ = 0;
    std::lock_guard lock(shared_->mu);
    const int k = shared_->interval;
    if (k <= 0) return;
    const bool point = (iteration + 1) % k == 0;
    const std::int64_t state = iteration + 1;
    // A GPU stage steps on the device: a capture reads the host copy, brought up to date first
    // (the device-to-host copy of the whole state, as Gemini and CheckFreq take it).
    if (point && device_ != nullptr) device_->sync_to_host();
    switch (kind_) {
      case baseline_kind::dense_disk:
        shared_->disk->after_step(iteration, ops);
        if (point) snapshot_bytes_ = shared_->disk->snapshot_bytes();
        host_bytes_ = shared_->disk->bytes_held();
        break;
      case baseline_kind::dense_memory: {
        if (!point) break;
        const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
        const std::vector<capture_kind> kinds(ops.size(), capture_kind::full);
        const held_checkpoint buf = take_buffer(snapshot_size(cops, kinds));
        write_snapshot(buf.bytes, {std::uint64_t(state / k), 0, state, stage_, replica_},
                       models::loss_scaler{}, cops, kinds);
        shared_->held[state] = buf;
        // Gemini keeps the newest complete checkpoint and the one being written; one more
        // here: the newest may not have reached the lost stage's holders when it died, and
        // survivors of a loss in the step phase are one checkpoint ahead of it.
        while (shared_->held.size() > memory_checkpoints_kept) {
          recycle(shared_->held.begin()->second);
          shared_->held.erase(shared_->held.begin());
        }
        shared_->to_ship.push_back(state);
        snapshot_bytes_ = buf.bytes.size();
        lent_bytes_ = buf.lent ? buf.bytes.size() : 0;
        break;
      }
      case baseline_kind::pec: {
        auto& cap = *shared_->pec_cap;
        if (!popularity_.empty()) cap.set_popularity(popularity_);
        cap.after_step(iteration, ops);
        if (!point) break;
        pec_meta meta;
        const auto& sched = *shared_->pec_sched;
        for (std::size_t i = 0; i < ops.size(); ++i) meta.saved_at.push_back(sched.saved_at(i));
        meta.unsaved = sched.unsaved_tokens(state);
        const auto trailer = encode_pec_meta(meta);
        std::set<std::int64_t> keep;
        for (const auto& v : cap.held()) {
          keep.insert(v.iteration);
          if (v.iteration != state) continue;
          auto buf = std::make_shared<std::vector<std::byte>>(v.bytes.begin(), v.bytes.end());
          buf->insert(buf->end(), trailer.begin(), trailer.end());
          shared_->held[state] = held_on_heap(buf, v.bytes.size());
          snapshot_bytes_ = v.bytes.size();
        }
        std::erase_if(shared_->held, [&](const auto& kv) { return !keep.contains(kv.first); });
        shared_->to_ship.push_back(state);
        break;
      }
    }
    if (kind_ != baseline_kind::dense_disk) {
      std::uint64_t n = 0;
      for (const auto& [it, c] : shared_->held) n += c.bytes.size();
      if (spare_.owner) n += spare_.bytes.size();
      if (shared_->pool) n += shared_->pool->free_bytes();
      host_bytes_ = n;
    }
    stall_s_ = point ? seconds_since(t0) : 0.0;
    capture_cpu_s_ = engine::thread_cpu_seconds() - cpu0;
  }

  void after_step_shipped(std::int64_t) override {
    if (kind_ == baseline_kind::dense_disk) return;
    (void)system_.post_call(agent_, [](actors::actor& a) -> awaitable<void> {
      static_cast<baseline_agent&>(a).ship();
      co_return;
    });
  }

  void on_wired(std::span<const actor_ref> holders) override {
    std::vector<actor_ref> targets(holders.begin(), holders.end());
    (void)system_.post_call(agent_, [targets](actors::actor& a) -> awaitable<void> {
      static_cast<baseline_agent&>(a).set_targets(targets);
      co_return;
    });
  }

  engine::checkpoint_stats stats() const override {
    return {
        snapshot_bytes_.load(), stall_s_.load(), host_bytes_.load(), 0, lent_bytes_.load(), 0, 0,
        capture_cpu_s_.load()};
  }

 private:
  engine::device_state* device_;  // the stage's state on a GPU, or nullptr
  models::expert_split split_;    // the experts this worker holds (parallel.ep)
  // Under shared_->mu, once k is known.
  void start_captures(int k) {
    shared_->interval = k;
    if (kind_ == baseline_kind::dense_disk) {
      shared_->disk.emplace(stage_, replica_, k, nullptr, config_.dir, disk_windows_kept(config_));
    } else if (kind_ == baseline_kind::pec) {
      shared_->pec_sched.emplace(config_.pec_experts, config_.pec_order, k, ops_, split_);
      shared_->pec_cap.emplace(*shared_->pec_sched, stage_, replica_);
    }
  }
  // n bytes: memory the pool lends (dense-memory), else those of an older checkpoint nobody
  // uses any more, else the heap. A lent spare is kept; a heap one gives way to lent memory
  // (as sparse_capture::fit does), or the first checkpoints' heap buffers would circulate
  // for good.
  held_checkpoint take_buffer(std::size_t n) {
    held_checkpoint spare = std::exchange(spare_, {});
    const bool spare_fits = spare.owner && spare.bytes.size() == n;
    if (spare_fits && (spare.lent || !shared_->pool)) return spare;
    if (shared_->pool) {
      if (auto m = shared_->pool->take(n)) return {m->bytes.first(n), std::move(m->owner), n, true};
    }
    if (spare_fits) return spare;
    return held_on_heap(std::make_shared<std::vector<std::byte>>(n), n);
  }
  void recycle(const held_checkpoint& c) {
    // Only the held map refers to it (the agent takes references under the lock only).
    if (c.owner.use_count() == 1) spare_ = c;
  }

  std::shared_ptr<baseline_shared> shared_;
  actors::actor_system& system_;
  actor_ref agent_;
  std::vector<models::operator_state*> ops_;
  baseline_kind kind_;
  policy_config config_;
  int stage_, replica_;
  std::vector<double> popularity_;
  held_checkpoint spare_;
  std::atomic<std::uint64_t> snapshot_bytes_{0}, host_bytes_{0}, lent_bytes_{0};
  std::atomic<double> stall_s_{0.0};
  std::atomic<double> capture_cpu_s_{0.0};  // the step's own capture (not a disk writer's)
};

// Why `view` cannot be stage s's checkpoint at `iteration` for ops ("" when it can). full:
// every operator must be in it in full (dense); else each entry in full (pec).
std::string unfit_view(const snapshot_view& view, int s, std::int64_t iteration,
                       std::span<models::operator_state* const> ops, bool full) {
  if (view.tag.stage != s) return fmt::format("it is stage {}'s checkpoint", view.tag.stage);
  if (view.tag.state_iteration != iteration) {
    return fmt::format("it holds iteration {}, not {}", view.tag.state_iteration, iteration);
  }
  if (full && view.entries.size() != ops.size()) {
    return fmt::format("{} operators in it, the stage has {} (not a full snapshot of this model)",
                       view.entries.size(), ops.size());
  }
  for (const auto& e : view.entries) {
    if (e.index >= ops.size() || e.mode != models::op_mode::active ||
        e.name != ops[e.index]->name() || e.numel != std::uint64_t(ops[e.index]->numel())) {
      return fmt::format("entry {} ({}) does not match the stage's operator in full", e.index,
                         e.name);
    }
  }
  return "";
}

}  // namespace

// ---- holder

checkpoint_holder::checkpoint_holder(engine::bulk_io& io, baseline_limits limits)
    : io_(io), limits_(limits) {
  on<wire::StoreCheckpoint>(&checkpoint_holder::store);
  on<wire::FetchCheckpoints, wire::CheckpointList>(&checkpoint_holder::fetch);
}

awaitable<void> checkpoint_holder::store(wire::StoreCheckpoint::Reader m) {
  const std::int32_t s = m.getStage(), d = m.getReplica();
  const std::int64_t it = m.getIteration();
  auto desc = transport::read_descriptor(m.getTensor());
  if (!desc.ok() || desc->length == 0 || desc->length > limits_.max_checkpoint_bytes ||
      m.getSnapshotBytes() > desc->length || it < 0 ||
      m.getKeep().size() > limits_.max_held_per_replica) {
    co_return;  // malformed: dropped
  }
  std::set<std::int64_t> keep{it};
  for (auto k : m.getKeep()) keep.insert(k);
  std::erase_if(held_, [&](const auto& kv) {
    const auto& [ks, kd, ki] = kv.first;
    return ks == s && kd == d && !keep.contains(ki);
  });
  auto holder = std::make_shared<transport::bulk_region>(io_.allocate(desc->length));
  auto r = co_await pull_chunked(io_, *desc, holder->memory(), holder, limits_.pull_chunk_bytes);
  if (!r.ok()) co_return;  // the sender died or dropped it meanwhile
  // A late pull (the sender reused that memory for a newer checkpoint) is not stored.
  const auto tag = read_snapshot_tag(holder->memory());
  if (!tag || tag->stage != s || tag->replica != d || tag->state_iteration != it) co_return;
  held_[{s, d, it}] = entry{std::move(*holder), m.getSnapshotBytes()};
}

awaitable<void> checkpoint_holder::fetch(wire::FetchCheckpoints::Reader m,
                                         wire::CheckpointList::Builder out) {
  const std::int32_t s = m.getStage(), d = m.getReplica();
  std::vector<const std::pair<const std::tuple<std::int32_t, std::int32_t, std::int64_t>, entry>*>
      mine;
  for (const auto& kv : held_) {
    if (std::get<0>(kv.first) == s && std::get<1>(kv.first) == d) mine.push_back(&kv);
  }
  auto l = out.initEntries(static_cast<unsigned>(mine.size()));
  for (unsigned i = 0; i < mine.size(); ++i) {
    l[i].setIteration(std::get<2>(mine[i]->first));
    transport::write_descriptor(l[i].initTensor(), mine[i]->second.region.describe_all());
    l[i].setSnapshotBytes(mine[i]->second.snapshot_size);
  }
  co_return;
}

// ---- agent

baseline_agent::baseline_agent(std::shared_ptr<baseline_shared> shared, engine::bulk_io& io,
                               baseline_kind kind, policy_config config, engine::stage_setup setup,
                               engine::stage_model& model,
                               std::shared_ptr<const std::vector<std::byte>> initial,
                               bool replacement, baseline_limits limits)
    : shared_(std::move(shared)),
      io_(io),
      kind_(kind),
      config_(std::move(config)),
      setup_(std::move(setup)),
      model_(model),
      initial_(std::move(initial)),
      replacement_(replacement),
      limits_(limits) {
  on<engine::wire::RollbackQuery, engine::wire::RollbackOffer>(&baseline_agent::query);
  on<engine::wire::RollbackLoad, engine::wire::RollbackLoaded>(&baseline_agent::load);
  on<engine::wire::SnapshotTargets>(&baseline_agent::retarget);
}

void baseline_agent::ship() {
  std::vector<std::pair<std::int64_t, held_checkpoint>> fresh;
  std::vector<std::int64_t> keep;
  {
    std::lock_guard lock(shared_->mu);
    for (auto it : shared_->to_ship) {
      if (auto c = shared_->held.find(it); c != shared_->held.end())
        fresh.emplace_back(it, c->second);
    }
    shared_->to_ship.clear();
    for (const auto& [it, c] : shared_->held) keep.push_back(it);
    std::erase_if(exported_, [&](const auto& kv) { return !shared_->held.contains(kv.first); });
  }
  for (auto& [it, c] : fresh) {
    const auto& [r, held] = export_checkpoint(it, c);
    offer(targets_, it, r, held, keep);
  }
  // Regions for a capture that missed, on this thread as the link requires: a batch of as
  // many as checkpoints are kept, and as many free ones kept (one is given back per
  // checkpoint, after its holders moved on: a smaller bound frees a region the next capture
  // then misses).
  if (shared_->pool) shared_->pool->refill(memory_checkpoints_kept, memory_checkpoints_kept);
}

const std::pair<transport::bulk_region, held_checkpoint>& baseline_agent::export_checkpoint(
    std::int64_t it, const held_checkpoint& c) {
  // Lent memory is a region already; heap memory is exported for this checkpoint.
  transport::bulk_region region;
  if (!(shared_->pool && shared_->pool->lent_region(c.bytes.data()))) {
    region = io_.export_memory(c.bytes);
  }
  return exported_.insert_or_assign(it, std::make_pair(std::move(region), c)).first->second;
}

void baseline_agent::offer(const std::vector<actor_ref>& to, std::int64_t it,
                           const transport::bulk_region& region, const held_checkpoint& c,
                           const std::vector<std::int64_t>& keep) {
  const auto* lent = shared_->pool ? shared_->pool->lent_region(c.bytes.data()) : nullptr;
  const transport::bulk_descriptor desc =
      lent != nullptr ? lent->describe(0, c.bytes.size()) : region.describe_all();
  for (const actor_ref& t : to) {
    (void)tell<wire::StoreCheckpoint>(t, [&](wire::StoreCheckpoint::Builder b) {
      b.setStage(setup_.stage);
      b.setReplica(setup_.replica);
      b.setIteration(it);
      transport::write_descriptor(b.initTensor(), desc);
      b.setSnapshotBytes(c.snapshot_size);
      auto l = b.initKeep(static_cast<unsigned>(keep.size()));
      for (unsigned i = 0; i < keep.size(); ++i) l.set(i, keep[i]);
    });
  }
}

awaitable<void> baseline_agent::retarget(engine::wire::SnapshotTargets::Reader m) {
  if (m.getReplicators().size() > limits_.max_targets) co_return;  // not the head's
  std::vector<actor_ref> targets;
  for (auto a : m.getReplicators()) targets.push_back(read_ref(a));
  set_targets(std::move(targets));
}

void baseline_agent::set_targets(std::vector<actor_ref> holders) {
  std::vector<actor_ref> added;
  for (const actor_ref& h : holders) {
    if (std::find(targets_.begin(), targets_.end(), h) == targets_.end()) added.push_back(h);
  }
  targets_ = std::move(holders);
  if (added.empty()) return;
  // A holder that replaces a lost one gets every checkpoint kept now, oldest first (a pec
  // rollback needs each save of its chain), not only the next: else a failure before the
  // next would roll back further than the kept ones reach. What is kept is `held`: a
  // rollback dropped the abandoned run's newer ones, and a rebuilt stage holds what it
  // restored, not exported yet.
  std::vector<std::pair<std::int64_t, held_checkpoint>> held;
  {
    std::lock_guard lock(shared_->mu);
    for (const auto& [it, c] : shared_->held) held.emplace_back(it, c);
  }
  std::erase_if(exported_, [&](const auto& kv) {
    return std::none_of(held.begin(), held.end(),
                        [&](const auto& h) { return h.first == kv.first; });
  });
  std::vector<std::int64_t> keep;
  for (const auto& [it, c] : held) keep.push_back(it);
  for (const auto& [it, c] : held) {
    const auto e = exported_.find(it);
    const auto& [r, kept] = e != exported_.end() ? e->second : export_checkpoint(it, c);
    offer(added, it, r, kept, keep);
  }
}

std::string baseline_agent::unfit(std::int64_t iteration, const held_checkpoint& c) const {
  try {
    const auto view = parse_snapshot(snapshot_part(c));
    const auto ops = model_.operators();
    const bool full = kind_ != baseline_kind::pec || iteration == 0;
    if (auto why = unfit_view(view, setup_.stage, iteration, ops, full); !why.empty()) return why;
    if (kind_ == baseline_kind::pec && iteration > 0) {
      (void)decode_pec_meta(trailer_part(c), ops.size());
    }
    return "";
  } catch (const std::exception& e) {
    return e.what();
  }
}

void baseline_agent::found_on_disk(std::vector<found_checkpoint>& found,
                                   std::vector<std::string>& rejected) {
  const int s = setup_.stage, d = setup_.replica;
  {
    std::lock_guard lock(shared_->mu);
    if (shared_->disk) {
      try {
        shared_->disk->flush();
      } catch (const std::exception& e) {
        rejected.push_back(e.what());
      }
    }
  }
  const auto dir = replica_dir(config_.dir, s, d);
  if (!std::filesystem::is_directory(dir)) {
    rejected.push_back(fmt::format("{} does not exist (checkpoint.dir)", dir.string()));
    return;
  }
  durable_store store(dir);
  const auto listed = store.listed_windows();
  if (!listed.ok()) {
    rejected.push_back(listed.err().message);
    return;
  }
  const auto& ids = *listed;
  for (auto id = ids.rbegin(); id != ids.rend(); ++id) {
    const std::string origin = fmt::format("{} window {}", dir.string(), *id);
    auto w = store.load(*id);
    if (!w.ok()) {
      rejected.push_back(fmt::format("{}: {}", origin, w.err().message));
      continue;
    }
    auto blob = w->blobs.find("snapshot");
    if (blob == w->blobs.end()) {
      rejected.push_back(origin + ": no blob named snapshot");
      continue;
    }
    auto bytes = std::make_shared<std::vector<std::byte>>(std::move(blob->second));
    const std::size_t n = bytes->size();
    found.push_back({origin, std::int64_t(*id), held_on_heap(bytes, n)});
  }
}

awaitable<void> baseline_agent::found_on_holders(engine::wire::RollbackQuery::Reader m,
                                                 std::vector<found_checkpoint>& found,
                                                 std::vector<std::string>& rejected) {
  const int s = setup_.stage, d = setup_.replica;
  for (auto h : m.getHolders()) {
    const actor_ref holder = read_ref(h);
    auto fill = [&](wire::FetchCheckpoints::Builder b) {
      b.setStage(s);
      b.setReplica(d);
    };
    auto r = co_await ask<wire::FetchCheckpoints, wire::CheckpointList>(
        holder, limits_.fetch_timeout, fill);
    if (!r.ok()) continue;  // that worker is gone too
    for (auto e : r->get().getEntries()) {
      const std::int64_t it = e.getIteration();
      if (std::any_of(found.begin(), found.end(), [&](const auto& f) { return f.iteration == it; }))
        continue;
      const std::string origin = fmt::format(
          "holder on worker {}, stage {} replica {} iteration {}", holder.node, s, d, it);
      auto desc = transport::read_descriptor(e.getTensor());
      if (!desc.ok() || desc->node != holder.node || desc->length == 0 ||
          desc->length > limits_.max_checkpoint_bytes || e.getSnapshotBytes() > desc->length) {
        rejected.push_back(origin + ": malformed answer");
        continue;
      }
      auto buf = std::make_shared<std::vector<std::byte>>(desc->length);
      auto pulled = co_await pull_chunked(io_, *desc, *buf, buf, limits_.pull_chunk_bytes);
      if (!pulled.ok()) {
        rejected.push_back(origin + ": pull failed: " + pulled.err().message);
        continue;
      }
      found.push_back({origin, it, held_on_heap(buf, e.getSnapshotBytes())});
    }
  }
}

std::set<std::int64_t> baseline_agent::not_rollback_points() const {
  std::set<std::int64_t> out;
  if (kind_ != baseline_kind::pec) return out;
  // A pec checkpoint restores each expert from its own newest save: all must be at hand.
  // (A checkpoint that is no rollback point may still hold some expert's newest save: the
  // check is against every verified one.) One that is not is not offered, and not reported
  // either: nothing is wrong with it.
  const std::size_t n = model_.operators().size();
  std::set<std::int64_t> verified;
  for (const auto& [it, c] : candidates_) verified.insert(it);
  for (const auto& [it, c] : candidates_) {
    if (it == 0) continue;
    const auto meta = decode_pec_meta(trailer_part(c.second), n);
    for (std::size_t i = 0; i < n; ++i) {
      if (!verified.contains(meta.saved_at[i])) {
        out.insert(it);
        break;
      }
    }
  }
  return out;
}

awaitable<void> baseline_agent::query(engine::wire::RollbackQuery::Reader m,
                                      engine::wire::RollbackOffer::Builder out) {
  candidates_.clear();
  std::vector<std::string> rejected;
  std::vector<found_checkpoint> found;
  if (kind_ == baseline_kind::dense_disk) {
    // CheckFreq recovers from storage: every stage reads its directory (the replacement the
    // lost worker's), newest first, each window verified (manifest, checksums, format).
    co_await off_thread([&] { found_on_disk(found, rejected); });
  } else if (!replacement_) {
    std::lock_guard lock(shared_->mu);
    for (const auto& [it, c] : shared_->held) {
      found.push_back({fmt::format("host memory of stage {} replica {}, iteration {}", setup_.stage,
                                   setup_.replica, it),
                       it, c});
    }
  } else {
    // The lost worker's copies, from whichever holders still have them.
    co_await found_on_holders(m, found, rejected);
  }
  // Verify each (checksums over whole snapshots: off the actor thread).
  std::vector<std::string> why(found.size());
  std::shared_ptr<std::vector<std::byte>> initial;  // a copy: a load may go on from it
  co_await off_thread([&] {
    for (std::size_t i = 0; i < found.size(); ++i) why[i] = unfit(found[i].iteration, found[i].c);
    initial = std::make_shared<std::vector<std::byte>>(*initial_);  // (a stage's worth: off thread)
  });
  for (std::size_t i = 0; i < found.size(); ++i) {
    if (!why[i].empty()) {
      rejected.push_back(fmt::format("{}: {}", found[i].origin, why[i]));
      continue;
    }
    candidates_.emplace(found[i].iteration, std::make_pair(found[i].origin, found[i].c));
  }
  candidates_.emplace(0, std::make_pair(std::string("the initial state"),
                                        held_on_heap(std::move(initial), initial_->size())));
  const std::set<std::int64_t> not_offered = not_rollback_points();
  std::vector<std::int64_t> offer;
  for (const auto& [it, c] : candidates_) {
    if (!not_offered.contains(it)) offer.push_back(it);
  }
  auto l = out.initIterations(static_cast<unsigned>(offer.size()));
  for (unsigned i = 0; i < offer.size(); ++i) l.set(i, offer[i]);
  auto rj = out.initRejected(static_cast<unsigned>(rejected.size()));
  for (unsigned j = 0; j < rejected.size(); ++j) rj.set(j, rejected[j]);
}

pec_meta baseline_agent::load_pec(std::int64_t c, std::uint64_t& bytes,
                                  std::vector<std::int64_t>& lost, std::uint32_t& stale) {
  const auto ops = model_.operators();
  pec_meta meta;
  meta.saved_at.assign(ops.size(), 0);
  meta.unsaved.assign(ops.size(), 0);
  if (c > 0) meta = decode_pec_meta(trailer_part(candidates_.at(c).second), ops.size());
  // Each operator from its own newest save (<= c): the non-experts from c, a stale expert
  // from an older checkpoint, one never saved from the initial state.
  std::map<std::int64_t, snapshot_view> views;
  for (auto at : meta.saved_at) {
    if (!views.contains(at)) {
      views.emplace(at, parse_snapshot(snapshot_part(candidates_.at(at).second)));
      bytes += candidates_.at(at).second.snapshot_size;
    }
  }
  for (std::size_t i = 0; i < ops.size(); ++i) {
    const auto& v = views.at(meta.saved_at[i]);
    const auto e = std::find_if(v.entries.begin(), v.entries.end(),
                                [&](const auto& x) { return x.index == i; });
    if (e == v.entries.end()) {
      throw std::runtime_error(
          fmt::format("operator {} is not in checkpoint {}", ops[i]->name(), meta.saved_at[i]));
    }
    load_operator(*e, *ops[i]);
  }
  const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
  for (const auto& layer : find_moe_layers(cops, engine::expert_split_of(setup_))) {
    std::int64_t n = 0;
    for (auto e : layer.experts) {
      if (meta.saved_at[e] < c) {
        ++stale;
        n += meta.unsaved[e];
      }
    }
    lost.push_back(n);
  }
  return meta;
}

void baseline_agent::restart_captures(std::int64_t c, int k, const pec_meta& meta) {
  // Captures go on from c: what is newer belongs to the abandoned run.
  std::lock_guard lock(shared_->mu);
  shared_->interval = k;
  shared_->to_ship.clear();
  if (kind_ == baseline_kind::dense_disk) {
    shared_->disk.reset();  // drained by the query's flush
    shared_->disk.emplace(setup_.stage, setup_.replica, k, nullptr, config_.dir,
                          disk_windows_kept(config_));
    durable_store(replica_dir(config_.dir, setup_.stage, setup_.replica))
        .drop_after(std::uint64_t(c));
    return;
  }
  shared_->held.clear();
  for (const auto& [it, cand] : candidates_) {
    if (it > 0 && it <= c) shared_->held[it] = cand.second;
  }
  if (kind_ == baseline_kind::dense_memory) {
    while (shared_->held.size() > memory_checkpoints_kept) {
      shared_->held.erase(shared_->held.begin());
    }
    return;
  }
  const std::set<std::int64_t> needed(meta.saved_at.begin(), meta.saved_at.end());
  std::erase_if(shared_->held, [&](const auto& kv) { return !needed.contains(kv.first); });
  shared_->pec_cap.reset();  // refers to the schedule: first
  shared_->pec_sched.reset();
  shared_->pec_sched.emplace(config_.pec_experts, config_.pec_order, k, model_.operators(),
                             engine::expert_split_of(setup_));
  shared_->pec_sched->restart(c, meta.saved_at, meta.unsaved);
  shared_->pec_cap.emplace(*shared_->pec_sched, setup_.stage, setup_.replica);
  std::map<std::int64_t, std::vector<std::byte>> held;
  for (const auto& [it, hc] : shared_->held) {
    const auto snap = snapshot_part(hc);
    held.emplace(it, std::vector<std::byte>(snap.begin(), snap.end()));
  }
  shared_->pec_cap->restart(std::move(held), meta.saved_at);
}

awaitable<void> baseline_agent::load(engine::wire::RollbackLoad::Reader m,
                                     engine::wire::RollbackLoaded::Builder out) {
  const std::int64_t c = m.getIteration();
  const int k = m.getInterval();
  const auto found = candidates_.find(c);
  if (found == candidates_.end() || k < 1) {
    out.setError(fmt::format("stage {} replica {} did not offer checkpoint {}", setup_.stage,
                             setup_.replica, c));
    co_return;
  }
  std::vector<std::int64_t> lost;
  std::uint32_t stale = 0;
  std::uint64_t bytes = 0;
  try {
    co_await off_thread([&] {
      const engine::host_write_scope writing(model_);  // a GPU stage's state, synced around
      if (kind_ != baseline_kind::pec || c == 0) {
        engine::stage_model* one = &model_;
        (void)restore_full_snapshot(snapshot_part(found->second.second), setup_.stage, c,
                                    std::span(&one, 1));
        bytes = found->second.second.snapshot_size;
      }
      pec_meta meta;
      if (kind_ == baseline_kind::pec) meta = load_pec(c, bytes, lost, stale);
      restart_captures(c, k, meta);
    });
  } catch (const std::exception& e) {
    out.setError(fmt::format("stage {} replica {} could not load checkpoint {}: {}", setup_.stage,
                             setup_.replica, c, e.what()));
    co_return;
  }
  out.setSource(found->second.first);
  out.setBytes(bytes);
  auto l = out.initLostTokens(static_cast<unsigned>(lost.size()));
  for (unsigned i = 0; i < lost.size(); ++i) l.set(i, lost[i]);
  out.setStaleExperts(stale);
  candidates_.clear();
  replacement_ = false;  // from now on its own checkpoints are in its own memory too
}

// ---- the worker's policy

baseline_checkpoint::baseline_checkpoint(actors::actor_system& system, engine::bulk_io& io,
                                         const engine::job_config& job, baseline_limits limits)
    : system_(system),
      io_(io),
      job_(job),
      kind_(kind_of(job.policy)),
      config_(policy_config_of(job.baseline)),
      limits_(limits) {
  if (kind_ != baseline_kind::dense_disk) holder_ = system_.spawn<checkpoint_holder>(io_, limits_);
  // The head's rollback supervises every stage's worker (recovery/rollback_recovery.hpp).
  system_.register_type<region_member>(region_member::registered_name);
}

std::unique_ptr<engine::stage_hooks> baseline_checkpoint::make_hooks(
    const engine::stage_setup& setup, engine::stage_model& model, actor_ref) {
  std::vector<models::operator_state*> ops = model.operators();
  sizes_.clear();
  for (const auto* op : ops) {
    const auto s = sparse_sizes(*op);
    sizes_.push_back({s.compute_bytes, s.master_bytes, s.optim_bytes});
  }
  if (!initial_) throw std::logic_error("baseline_checkpoint::make_hooks before prepare()");
  auto initial = std::move(initial_);
  auto shared = std::make_shared<baseline_shared>();
  if (kind_ == baseline_kind::dense_memory) shared->pool = std::make_unique<slot_pool>(io_);
  agent_ = system_.spawn<baseline_agent>(shared, io_, kind_, config_, setup, model,
                                         std::shared_ptr<const std::vector<std::byte>>(initial),
                                         replacement_, limits_);
  return std::make_unique<baseline_hooks>(shared, system_, agent_, std::move(ops), kind_, config_,
                                          setup.stage, setup.replica, model.device(),
                                          engine::expert_split_of(setup));
}

void baseline_checkpoint::prepare(const engine::stage_setup& setup, engine::stage_model& model) {
  const std::vector<models::operator_state*> ops = model.operators();
  const std::vector<const models::operator_state*> cops(ops.begin(), ops.end());
  const std::vector<capture_kind> kinds(ops.size(), capture_kind::full);
  auto initial = std::make_shared<std::vector<std::byte>>(snapshot_size(cops, kinds));
  const auto t0 = sclock::now();
  write_snapshot(*initial, {0, 0, 0, setup.stage, setup.replica}, models::loss_scaler{}, cops,
                 kinds);
  const double secs = seconds_since(t0);
  bandwidth_ = secs > 0 ? double(initial->size()) / secs : 0.0;
  initial_ = std::move(initial);
}

awaitable<std::unique_ptr<engine::stage_model>> baseline_checkpoint::restore(
    engine::wire::Restore::Reader, const engine::stage_factory& factory,
    engine::stage_setup setup) {
  std::unique_ptr<engine::stage_model> model;
  co_await off_thread([&] {
    model = factory(setup);
    prepare(setup, *model);
  });
  replacement_ = true;
  co_return model;
}

engine::checkpoint_factory any_policy_factory(policy_limits limits) {
  return [moe = policy_factory(limits)](
             actors::actor_system& system, engine::bulk_io& io,
             const engine::job_config& job) -> std::unique_ptr<engine::worker_checkpoint> {
    if (engine::recovery_of(job.policy) == engine::recovery_kind::rollback) {
      return std::make_unique<baseline_checkpoint>(system, io, job);
    }
    return moe(system, io, job);
  };
}

}  // namespace moevement::recovery
