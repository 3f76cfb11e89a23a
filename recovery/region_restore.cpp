#include "recovery/region_restore.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <stdexcept>
#include <thread>

#include "base/cores.hpp"
#include "engine/expert_router.hpp"
#include "models/cpu/gemm.hpp"
#include "recovery/durable_store.hpp"
#include "recovery/layout_change.hpp"
#include "recovery/sparse_to_dense.hpp"
#include "recovery/worker_tasks.hpp"

namespace moevement::recovery {

namespace {

using actors::actor_ref;
using actors::read_ref;
using asio::awaitable;
using sclock = std::chrono::steady_clock;

constexpr auto fetch_timeout = std::chrono::seconds(30);

// The GEMM threads of a replay: its share of the cores this process may run on
// (checkpoint.replay_threads).
int replay_threads(const engine::job_config& job, int host_share) {
  return engine::replay_threads_for(job.replay_threads, host_share, base::usable_cores());
}

// Runs `replay` on the calling thread with `threads` GEMM threads, then back to `usual`
// however it ends.
template <class F>
void with_gemm_threads(int threads, int usual, F&& replay) {
  models::cpu::set_gemm_threads(threads);
  try {
    replay();
  } catch (...) {
    models::cpu::set_gemm_threads(usual);
    throw;
  }
  models::cpu::set_gemm_threads(usual);
}

// A Restore, decoded and checked.
struct restore_plan {
  int stage = 0, replica = 0, first_stage = 0, last_stage = 0, k = 1, dp = 1;
  std::int64_t target = 0, first = 0;
  bool has_window = false, durable = false;
  int w = 0;
  std::uint64_t window = 0, generation = 0;
  int host_share = 1;
  int window_pp = 0, window_dp = 0, window_ep = 0;
  std::vector<int> replicas;     // of each region stage, rebuilt here (all, or this one)
  std::vector<actor_ref> group;  // [replica] the members' exchanges (empty: no group)
  // [s - first_stage] the exchange of the member replaying (s, replica) (empty: this worker
  // replays every stage of the region, not a pipeline of them)
  std::vector<actor_ref> pipeline;
  std::map<std::int64_t, step_record> steps;
  bool pipelined() const { return !pipeline.empty(); }
  // The stages replayed here: the region's, or (pipelined) this role's alone.
  int first_here() const { return pipelined() ? stage : first_stage; }
  int k_here() const { return pipelined() ? 1 : k; }
  // Index i of a stage replica rebuilt here (i = j * replicas.size() + r, stage
  // first_here() + j) -> its place in the Restore's sources ((stage - first_stage) * dp +
  // replica).
  std::size_t source(std::size_t i) const {
    return std::size_t(stage_of(i) - first_stage) * std::size_t(dp) + std::size_t(replica_of(i));
  }
  int stage_of(std::size_t i) const { return first_here() + int(i / replicas.size()); }
  int replica_of(std::size_t i) const { return replicas[i % replicas.size()]; }
};

// The exchanges a Restore names for its group or pipeline: each valid, each on its own worker.
std::vector<actor_ref> members_of(capnp::List<::moevement::wire::ActorAddress>::Reader list,
                                  const char* what) {
  std::vector<actor_ref> out;
  std::set<transport::node_id> nodes;
  for (auto a : list) {
    out.push_back(read_ref(a));
    nodes.insert(out.back().node);
    if (!out.back().valid()) {
      throw std::runtime_error(
          fmt::format("malformed Restore from the coordinator (a member of its {})", what));
    }
  }
  if (nodes.size() != out.size()) {
    throw std::runtime_error(
        fmt::format("malformed Restore from the coordinator (a worker twice in its {})", what));
  }
  return out;
}

restore_plan decode(engine::wire::Restore::Reader m, const engine::job_config& job,
                    const engine::stage_setup& setup, bool durable_on) {
  restore_plan p;
  p.stage = m.getStage();
  p.replica = setup.replica;
  p.dp = job.dp;
  p.first_stage = m.getFirstStage();
  p.last_stage = m.getLastStage();
  p.k = p.last_stage - p.first_stage + 1;
  p.target = m.getTargetIteration();
  p.first = m.getFirstIteration();
  p.has_window = m.getHasWindow();
  p.w = m.getWSparse();
  p.window = m.getWindow();
  p.generation = m.getGeneration();
  p.durable = m.getDurable();
  p.host_share = m.getHostShare();
  p.window_pp = m.getWindowStages();
  p.window_dp = m.getWindowReplicas();
  p.window_ep = m.getWindowEp();
  if (p.first_stage < 0 || p.last_stage >= job.pp || p.stage < p.first_stage ||
      p.stage > p.last_stage || m.getSources().size() != unsigned(p.k * p.dp) ||
      p.target < p.first || p.first < 0 || (p.has_window && (p.w <= 0 || p.w > (1 << 20)))) {
    throw std::runtime_error("malformed Restore from the coordinator");
  }
  if (p.durable &&
      (!durable_on || !p.has_window || p.first_stage != 0 || p.last_stage != job.pp - 1)) {
    throw std::runtime_error(
        "malformed durable Restore (the whole pipeline from a window, with checkpoint.durable)");
  }
  if (m.getGroup().size() != 0) {
    if (m.getGroup().size() != unsigned(p.dp) || p.dp < 2) {
      throw std::runtime_error("malformed Restore from the coordinator (its group)");
    }
    p.group = members_of(m.getGroup(), "group");
    p.replicas = {p.replica};
  } else {
    for (int d = 0; d < p.dp; ++d) p.replicas.push_back(d);
  }
  if (m.getPipeline().size() != 0) {
    // One stage replica replayed here: with dp > 1 only as a group member.
    if (m.getPipeline().size() != unsigned(p.k) || p.k < 2 || p.replicas.size() != 1) {
      throw std::runtime_error("malformed Restore from the coordinator (its pipeline)");
    }
    p.pipeline = members_of(m.getPipeline(), "pipeline");
  }
  const int mbs = job.train.micro_batches;
  for (auto r : m.getSteps()) {
    step_record rec;
    rec.loss_grad = r.getLossScale() / float(mbs * p.dp);
    rec.plan.apply = r.getApply();
    rec.plan.grad_mul = r.getGradMul();
    rec.plan.grad_norm = r.getGradNorm();
    p.steps[r.getIteration()] = rec;
  }
  return p;
}

// One Restore's work, in the order it runs.
class region_restore {
 public:
  region_restore(restore_context ctx, engine::wire::Restore::Reader m, restore_plan plan,
                 engine::stage_setup setup)
      : ctx_(std::move(ctx)), m_(m), p_(std::move(plan)), setup_(std::move(setup)) {}

  awaitable<restored_stage> run(const engine::stage_factory& factory);

 private:
  // The windows of every stage replica rebuilt here: from the durable tier's files, or
  // pulled from the replicators holding each slot.
  awaitable<void> load_durable_windows();
  // A copy of slot j of (st, d) from `holder` passes its checksum and parses; else it is
  // counted (copies_refused), said on stderr, and false.
  awaitable<bool> intact(std::span<const std::byte> bytes, int j, int st, int d,
                         const actor_ref& holder);
  // A judge's replay (Restore.judge): every replica's copy of the window holds the same state,
  // or this throws naming the slot and replicas that differ.
  void check_copies_agree() const;
  // The replica whose copies (and files) stand for stage replica i's: its own, or the one
  // its source names (slotsFrom: its own are untrusted, or gone from disk).
  int copies_of(std::size_t i) const {
    const int from = m_.getSources()[unsigned(p_.source(i))].getSlotsFrom();
    if (from >= p_.dp) {
      throw std::invalid_argument(
          fmt::format("Restore: slotsFrom {} is past the {} replicas", from, p_.dp));
    }
    return from >= 0 ? from : p_.replica_of(i);
  }
  awaitable<void> pull_window(std::size_t i);
  awaitable<void> pull_slot(std::size_t i, int slot);
  // The upstream logs of [first, target) of the healthy stages just outside the region.
  awaitable<void> fetch_logs(std::size_t floats);
  awaitable<void> fetch_log(actor_ref agent, bool gradient, int replica, std::size_t floats,
                            log_store& into);
  // One answer of it: iterations [from, to].
  awaitable<void> fetch_log_piece(actor_ref agent, bool gradient, int replica, std::size_t floats,
                                  std::int64_t from, std::int64_t to, log_store& into);
  // The schedule state of a surviving replica of this stage (none when the whole group is
  // rebuilt: the fresh ones agree with each other).
  awaitable<void> fetch_schedule();
  awaitable<void> replay();
  // Under expert parallelism: the router this member's replay computes its EP group's rows
  // with (its actor spawned, the model's exchange), and its naming: to the other members
  // (ReplayExperts through the group exchanges), and theirs taken as its peers.
  std::shared_ptr<engine::expert_router> replay_router();
  awaitable<void> name_router(engine::expert_router& router);

  restore_context ctx_;
  engine::wire::Restore::Reader m_;
  restore_plan p_;
  engine::stage_setup setup_;
  restored_stage out_;
  std::vector<std::unique_ptr<engine::stage_model>> models_;
  // slots_[i][j]: slot j of stage replica i; kept_ owns their memory.
  std::vector<std::vector<std::span<const std::byte>>> slots_;
  std::vector<std::shared_ptr<const void>> kept_;
  std::vector<std::shared_ptr<transport::bulk_region>> own_regions_;
  std::vector<std::shared_ptr<transport::shared_memory>> own_files_;
  std::vector<log_store> up_, down_;  // [r] of the replicas rebuilt here
  sclock::time_point started_ = sclock::now(), pulled_at_;
};

awaitable<restored_stage> region_restore::run(const engine::stage_factory& factory) {
  // Fresh stages for every replica rebuilt here of every stage of the region: the initial
  // state, or what the windows' slots overwrite. Built on a thread of their own while this
  // one pulls the slots: allocating a stage's state is as long as pulling it.
  const std::size_t all = std::size_t(p_.k_here()) * p_.replicas.size();
  models_.resize(all);
  slots_.resize(all);
  std::future<void> building = std::async(std::launch::async, [&] {
    for (std::size_t i = 0; i < all; ++i) {
      engine::stage_setup sd = setup_;
      sd.stage = p_.stage_of(i);
      sd.replica = p_.replica_of(i);
      // The window's slots overwrite every operator in full: its random init is wasted time.
      sd.initialize = !p_.has_window;
      models_[i] = factory(sd);
    }
  });
  try {
    if (p_.durable) {
      co_await load_durable_windows();
    } else if (p_.has_window) {
      for (std::size_t i = 0; i < all; ++i) co_await pull_window(i);
    }
  } catch (...) {
    building.wait();
    throw;
  }
  co_await off_thread([&] { building.get(); });
  if (m_.getJudge()) co_await off_thread([&] { check_copies_agree(); });
  co_await fetch_logs(models_[0]->boundary_floats());
  if (p_.group.empty() && !p_.durable) co_await fetch_schedule();
  pulled_at_ = sclock::now();
  co_await replay();
  for (auto& r : own_regions_) out_.regions.push_back(std::move(*r));
  for (auto& f : own_files_) out_.files.push_back(std::move(*f));
  out_.w = std::size_t(std::max(p_.w, 1));
  const std::size_t n = p_.replicas.size();
  const auto mine = std::size_t(std::find(p_.replicas.begin(), p_.replicas.end(), p_.replica) -
                                p_.replicas.begin());
  const std::size_t own = std::size_t(p_.stage - p_.first_here()) * n + mine;
  // Restored from another replica's copies: this role's own windows on disk are not used
  // again (a predecessor fenced for silent corruption wrote them, or they are gone or corrupt);
  // a later restore from disk takes that replica's, until this role persists windows of its
  // own. Dropped on the writer thread, before anything this role writes.
  if (ctx_.durable != nullptr && !m_.getJudge() && copies_of(own) != p_.replica) {
    ctx_.durable->post([dir = durable_window_dir(ctx_.job.baseline.dir, p_.stage, p_.replica)] {
      try {
        durable_store(dir).clear();
      } catch (const std::exception&) {
        // Left as they are: a restore from disk then loads and checks them as it would.
      }
    });
  }
  out_.model = std::move(models_[own]);
  co_return std::move(out_);
}

void region_restore::check_copies_agree() const {
  const int ep = std::max(ctx_.job.ep, 1);
  for (std::size_t i = 0; i < slots_.size(); ++i) {
    // The first replica of the same stage and shard rebuilt here: the copy i is checked with.
    std::size_t first = i;
    for (std::size_t k = 0; k < i; ++k) {
      if (p_.stage_of(k) == p_.stage_of(i) && p_.replica_of(k) % ep == p_.replica_of(i) % ep) {
        first = k;
        break;
      }
    }
    if (first == i) continue;
    for (std::size_t j = 0; j < slots_[i].size() && j < slots_[first].size(); ++j) {
      if (!same_state(parse_snapshot(slots_[i][j]), parse_snapshot(slots_[first][j]))) {
        throw std::runtime_error(fmt::format(
            "the copies of window {} slot {} of stage {} replicas {} and {} differ, so a replay "
            "from it could take either side",
            p_.window, j, p_.stage_of(i), p_.replica_of(first), p_.replica_of(i)));
      }
    }
  }
}

awaitable<void> region_restore::load_durable_windows() {
  // Every stage replica's window from its files, verified (the manifest's checksums, the
  // meta, every slot's own checksum and tag).
  co_await off_thread([&] {
    ctx_.durable->drain();
    for (std::size_t i = 0; i < slots_.size(); ++i) {
      const int st = p_.stage_of(i), d = copies_of(i);
      const durable_store store(durable_window_dir(ctx_.job.baseline.dir, st, d));
      auto loaded = load_durable_window(store, p_.window, st, d);
      if (!loaded.ok()) {
        throw std::runtime_error(
            fmt::format("durable window of stage {} replica {}: {}", st, d, loaded.err().message));
      }
      if (loaded->meta.first_iteration != p_.first || loaded->meta.w_sparse != p_.w) {
        throw std::runtime_error(fmt::format(
            "durable window {} of stage {} replica {} replays from iteration {} with W={}, "
            "the coordinator says {} and {}",
            p_.window, st, d, loaded->meta.first_iteration, loaded->meta.w_sparse, p_.first, p_.w));
      }
      auto owned = std::make_shared<std::vector<std::vector<std::byte>>>(std::move(loaded->slots));
      for (const auto& sl : *owned) slots_[i].emplace_back(sl);
      kept_.push_back(std::move(owned));
    }
    // Windows newer than this one on this replica's disk are from a timeline the job left
    // (a resume, or a rollback past a corrupt window): one the job writes from now on must
    // never rank below them.
    durable_store(durable_window_dir(ctx_.job.baseline.dir, p_.stage, p_.replica))
        .drop_after(p_.window);
  });
}

awaitable<bool> region_restore::intact(std::span<const std::byte> bytes, int j, int st, int d,
                                       const actor_ref& holder) {
  std::string error;
  co_await off_thread([&] {
    try {
      (void)parse_snapshot(bytes);
    } catch (const snapshot_error& e) {
      error = e.what();
    }
  });
  if (error.empty()) co_return true;
  ++out_.timing.copies_refused;
  const std::string line = fmt::format(
      "slot {} of window {} of stage {} replica {}: the copy on worker {} is refused ({}); "
      "trying another\n",
      j, p_.window, st, d, holder.node, error);
  std::fwrite(line.data(), 1, line.size(), stderr);
  co_return false;
}

awaitable<void> region_restore::pull_window(std::size_t i) {
  for (int j = 0; j < p_.w; ++j) co_await pull_slot(i, j);
}

awaitable<void> region_restore::pull_slot(std::size_t i, int j) {
  const int st = p_.stage_of(i), d = p_.replica_of(i);
  const bool own = st == p_.stage && d == p_.replica;
  const auto src = m_.getSources()[unsigned(p_.source(i))];
  const int from = copies_of(i);
  auto& timing = out_.timing;
  for (auto h : src.getSlotHolders()) {
    const actor_ref holder = read_ref(h);
    auto fill = [&](wire::FetchSlot::Builder b) {
      auto key = b.initKey();
      key.setStage(st);
      key.setReplica(from);
      key.setWindow(p_.window);
      key.setSlot(std::uint32_t(j));
    };
    auto r = co_await ctx_.system.ask<wire::FetchSlot, wire::SlotData>(holder, fetch_timeout, fill);
    if (!r.ok() || !r->get().getFound()) continue;  // lost, or not one of its holders
    auto desc = transport::read_descriptor(r->get().getTensor());
    if (!desc.ok() || desc->node != holder.node || desc->length > ctx_.limits.max_slot_bytes) {
      continue;
    }
    // A holder on this host that keeps the slot mapped: map it too (no copy, except of this
    // process's own stage replica, whose regions its slot pool takes over).
    std::shared_ptr<transport::shared_memory> mapped;
    std::span<std::byte> shared_bytes;
    if (ctx_.job.share_memory && r->get().hasShare()) {
      const auto sh = transport::read_share(r->get().getShare());
      if (sh.ok() && sh->length == desc->length) {
        if (auto mm = transport::shared_memory::open(*sh); mm.ok()) {
          mapped = std::make_shared<transport::shared_memory>(std::move(*mm));
          shared_bytes = mapped->memory().subspan(sh->offset, sh->length);
        }
      }
    }
    // A copy whose checksum fails (a flipped bit where it is held) is refused: the next one.
    if (mapped && !co_await intact(shared_bytes, j, st, from, holder)) continue;
    if (mapped && !own) {
      slots_[i].emplace_back(shared_bytes);
      kept_.push_back(std::move(mapped));
      ++timing.slots_mapped;
      co_return;
    }
    // This process's own stage replica: into link-allocated regions (memory files with
    // checkpoint.share_memory), which its slot pool then lends to the capture. The others:
    // heap memory, not zeroed (the pull writes every byte, and parse_snapshot checks them).
    std::shared_ptr<void> owner;
    std::shared_ptr<transport::bulk_region> region;
    std::shared_ptr<transport::shared_memory> own_file;
    std::span<std::byte> into;
    if (own) {
      try {
        if (ctx_.job.share_memory) {
          own_file = std::make_shared<transport::shared_memory>(
              transport::shared_memory::create(desc->length));
          into = own_file->memory().first(desc->length);
          owner = own_file;
        } else {
          region = std::make_shared<transport::bulk_region>(ctx_.io.allocate(desc->length));
          into = region->memory().first(desc->length);
          owner = region;
        }
      } catch (const std::exception&) {
        // Out of mappable memory: the heap below (the pool then allocates later).
      }
    }
    if (!owner) {
      std::shared_ptr<std::byte[]> buf = std::make_shared_for_overwrite<std::byte[]>(desc->length);
      into = std::span<std::byte>(buf.get(), desc->length);
      owner = std::move(buf);
    }
    if (mapped) {
      co_await off_thread([&] { std::memcpy(into.data(), shared_bytes.data(), into.size()); });
      ++timing.slots_mapped;  // this process's own: mapped, then copied into its memory
    } else {
      auto pulled =
          co_await pull_chunked(ctx_.io, *desc, into, owner, ctx_.limits.pull_chunk_bytes);
      if (!pulled.ok()) continue;  // the holder died meanwhile: try the next copy
      ++timing.slots_pulled;
      timing.handles_refused += r->get().hasShare() ? 1 : 0;
      if (!co_await intact(into, j, st, from, holder)) continue;
    }
    slots_[i].emplace_back(into);
    if (region) own_regions_.push_back(std::move(region));
    if (own_file) own_files_.push_back(std::move(own_file));
    kept_.push_back(std::move(owner));
    co_return;
  }
  throw engine::snapshot_lost(fmt::format(
      "slot {} of window {} of stage {} replica {} is on no live replicator (every copy was "
      "lost)",
      j, p_.window, st, from));
}

awaitable<void> region_restore::fetch_log(actor_ref agent, bool gradient, int d, std::size_t floats,
                                          log_store& into) {
  const std::int64_t t = p_.target, w0 = p_.first;
  const int mbs = ctx_.job.train.micro_batches;
  const std::uint64_t each = floats * sizeof(float);
  const std::uint64_t per_iteration = std::uint64_t(mbs) * each;
  if (per_iteration > ctx_.limits.max_log_bytes) {
    throw std::runtime_error(fmt::format(
        "one iteration's upstream log ({} bytes) exceeds what a neighbour serves in one answer "
        "({} bytes)",
        per_iteration, ctx_.limits.max_log_bytes));
  }
  const auto piece_bytes = std::min(ctx_.job.log_fetch_bytes, ctx_.limits.max_log_bytes);
  for (const auto& [from, to] : log_fetch_pieces(w0, t, per_iteration, piece_bytes)) {
    co_await fetch_log_piece(agent, gradient, d, floats, from, to, into);
  }
}

awaitable<void> region_restore::fetch_log_piece(actor_ref agent, bool gradient, int d,
                                                std::size_t floats, std::int64_t from,
                                                std::int64_t to, log_store& into) {
  const int mbs = ctx_.job.train.micro_batches;
  auto fill = [&](wire::FetchLog::Builder b) {
    b.setFromIteration(from);
    b.setToIteration(to);
    b.setGradient(gradient);
    b.setReplica(std::uint32_t(d));
    b.setMicroBatches(std::uint32_t(mbs));
    b.setFloatsEach(floats);
  };
  auto r = co_await ctx_.system.ask<wire::FetchLog, wire::LogData>(agent, fetch_timeout, fill);
  if (!r.ok()) throw std::runtime_error("fetching a neighbour's log failed: " + r.err().message);
  if (r->get().getError().size() > 0) {
    throw std::runtime_error("a neighbour cannot serve its log: " +
                             std::string(r->get().getError()));
  }
  const std::uint64_t lease = r->get().getLease();
  const std::uint64_t each = floats * sizeof(float);
  const std::uint64_t expect = std::uint64_t(to - from + 1) * std::uint64_t(mbs) * each;
  auto desc = transport::read_descriptor(r->get().getTensor());
  if (!desc.ok() || desc->node != agent.node || desc->length != expect) {
    throw std::runtime_error("a neighbour's log answer does not match the request");
  }
  auto buf = std::make_shared<std::vector<std::byte>>(expect);
  auto pulled = co_await pull_chunked(ctx_.io, *desc, *buf, buf, ctx_.limits.pull_chunk_bytes);
  (void)ctx_.system.tell<wire::ReleaseLog>(agent,
                                           [&](wire::ReleaseLog::Builder b) { b.setLease(lease); });
  if (!pulled.ok()) {
    throw std::runtime_error("pulling a neighbour's log failed: " + pulled.err().message);
  }
  ++out_.timing.log_pieces;
  const auto dir = gradient ? log_direction::gradient : log_direction::activation;
  std::size_t off = 0;
  for (std::int64_t it = from; it <= to; ++it) {
    for (int mb = 0; mb < mbs; ++mb, off += each) {
      into.append({std::uint64_t(it), std::uint32_t(mb), dir, std::uint32_t(d)},
                  std::span<const std::byte>(buf->data() + off, each));
    }
  }
}

awaitable<void> region_restore::fetch_logs(std::size_t floats) {
  const std::size_t n = p_.replicas.size();
  up_.resize(n);
  down_.resize(n);
  for (std::size_t r = 0; r < n; ++r) {
    const int d = p_.replicas[r];
    // The region's ends only (a pipelined member inside it takes its neighbours' live).
    if (p_.first_stage > 0 && p_.first_here() == p_.first_stage) {
      const auto src = m_.getSources()[unsigned(d)];
      co_await fetch_log(read_ref(src.getUpstream()), false, d, floats, up_[r]);
    }
    if (p_.last_stage + 1 < ctx_.job.pp && p_.first_here() + p_.k_here() - 1 == p_.last_stage) {
      const auto src = m_.getSources()[unsigned((p_.k - 1) * p_.dp + d)];
      co_await fetch_log(read_ref(src.getDownstream()), true, d, floats, down_[r]);
    }
  }
}

awaitable<void> region_restore::fetch_schedule() {
  for (int d = 0; d < p_.dp; ++d) {
    const actor_ref peer =
        read_ref(m_.getSources()[unsigned((p_.stage - p_.first_stage) * p_.dp + d)].getSurvivor());
    if (!peer.valid() || d == p_.replica) continue;
    // Under expert parallelism only a replica of the same EP rank holds these operators.
    const int ep = std::max(ctx_.job.ep, 1);
    if (d % ep != p_.replica % ep) continue;
    auto r =
        co_await ctx_.system.ask<wire::FetchSchedule, wire::ScheduleState>(peer, fetch_timeout);
    if (!r.ok()) continue;  // that survivor died meanwhile: its loss restarts this restore
    const auto m = r->get();
    if (!m.getHas()) co_return;
    if (m.getCounts().size() > ctx_.limits.max_schedule_windows ||
        m.getSchedules().size() > ctx_.limits.max_schedule_windows) {
      throw std::runtime_error("a survivor's schedule state is too large");
    }
    stage_schedule::state st;
    for (auto v : m.getOrder()) st.order.push_back(v);
    for (auto v : m.getOrderPopularity()) st.order_popularity.push_back(v);
    for (auto c : m.getCounts()) {
      auto& v = st.counts[c.getWindow()];
      for (auto x : c.getCounts()) v.push_back(x);
    }
    for (auto w : m.getSchedules()) {
      auto& v = st.schedules[w.getWindow()];
      for (auto sl : w.getSlots()) {
        sim::schedule_slot slot;
        for (auto x : sl.getActive()) slot.active.push_back(x);
        for (auto x : sl.getFrozen()) slot.frozen.push_back(x);
        v.push_back(std::move(slot));
      }
    }
    st.reorders = m.getReorders();
    for (auto x : m.getDecayed()) st.decayed.push_back(x);
    for (auto x : m.getPending()) st.pending.push_back(x);
    st.pending_iteration = m.getPendingIteration();
    st.pending_window = m.getPendingWindow();
    out_.schedule = std::move(st);
    co_return;
  }
}

std::shared_ptr<engine::expert_router> region_restore::replay_router() {
  // One stage replica replayed here (a single-stage region, or one stage of a pipelined one:
  // with several, one thread serving several routers could wait on a peer that waits on it).
  if (models_.size() != 1 || models_[0]->experts() == nullptr) {
    throw std::runtime_error(
        "malformed Restore from the coordinator (a group replay under expert parallelism "
        "replays one stage replica with experts on each member)");
  }
  engine::stage_setup sd = setup_;
  sd.stage = p_.stage;
  sd.replica = p_.replica;
  auto router = std::make_shared<engine::expert_router>(ctx_.system, ctx_.io, sd);
  router->attach(models_[0]->experts());
  router->set_actor(ctx_.system.spawn<engine::expert_router_actor>(router, ctx_.io).ref);
  models_[0]->set_expert_exchange(router.get());
  // A newer generation (a member lost) ends this replay's waits on the router too.
  ctx_.inbox->when_superseded(p_.generation, [weak = std::weak_ptr(router), g = p_.generation] {
    if (auto r = weak.lock()) {
      r->stop(fmt::format("the group replay of generation {} was superseded", g));
    }
  });
  return router;
}

awaitable<void> region_restore::name_router(engine::expert_router& router) {
  const auto me = std::uint32_t(p_.replica);
  for (std::uint32_t d = 0; d < p_.group.size(); ++d) {
    if (d == me) continue;
    (void)ctx_.system.tell<wire::ReplayExperts>(p_.group[d], [&](wire::ReplayExperts::Builder b) {
      b.setGeneration(p_.generation);
      b.setReplica(me);
      actors::write_ref(b.initRouter(), router.actor());
    });
  }
  // The routers of this replica's EP group, by EP rank.
  const int ep = std::max(ctx_.job.ep, 1), base = p_.replica / ep * ep;
  std::vector<actor_ref> peers;
  for (int k = 0; k < ep; ++k) {
    const auto d = std::uint32_t(base + k);
    actor_ref peer = router.actor();  // (a co_await inside ?: is miscompiled by GCC 12)
    if (d != me) peer = co_await ctx_.inbox->take_router(p_.generation, d, ctx_.limits.group_wait);
    peers.push_back(peer);
  }
  router.set_peers(std::move(peers));
}

awaitable<void> region_restore::replay() {
  // Sparse-to-dense conversion of the region, then all-active replay up to the target.
  conversion_input in;
  in.stage = p_.first_here();
  in.region_stages = p_.k_here();
  in.stages = ctx_.job.pp;
  in.micro_batches = ctx_.job.train.micro_batches;
  in.target_iteration = p_.target;
  in.windows = std::move(slots_);
  // A survivor's own sends, checked bit for bit (only where it replays its replica alone).
  if (ctx_.own_log != nullptr && p_.replicas.size() == 1 && p_.k_here() == 1) {
    in.own = {ctx_.own_log};
  }
  for (std::size_t i = 0; i < in.windows.size(); ++i) {
    in.window_replicas.push_back(m_.getSources()[unsigned(p_.source(i))].getSlotsFrom());
  }
  for (std::size_t r = 0; r < p_.replicas.size(); ++r) {
    in.upstream.push_back(&up_[r]);
    in.downstream.push_back(&down_[r]);
  }
  in.steps = &p_.steps;
  in.train = ctx_.job.train;
  in.initial_iteration = p_.first;
  std::unique_ptr<group_reducer> group;
  std::shared_ptr<engine::expert_router> router;
  // However the replay ends: the router's actor stops and the model lets go of it. After a
  // finished replay every member pulled all it needed (group->finish()), so no rows or
  // answers of it are in flight.
  struct router_guard {
    region_restore& self;
    std::shared_ptr<engine::expert_router> router;
    ~router_guard() {
      self.models_[0]->set_expert_exchange(nullptr);
      self.ctx_.system.stop(router->actor());
    }
  };
  std::optional<router_guard> router_done;
  std::vector<engine::stage_model*> ptrs;
  for (auto& m : models_) ptrs.push_back(m.get());
  if (!p_.group.empty()) {
    const group_layout layout = group_layout_of(ptrs, ctx_.job.ep);
    group = std::make_unique<group_reducer>(ctx_.system, ctx_.io, ctx_.inbox, p_.generation,
                                            std::uint32_t(p_.replica), p_.group, layout,
                                            ctx_.limits.pull_chunk_bytes, ctx_.limits.group_wait);
    in.first_replica = std::size_t(p_.replica);
    in.reduce = [&](std::int64_t it, std::span<float> g) { group->reduce(it, g); };
    if (layout.ep > 1) {
      router = replay_router();
      router_done.emplace(*this, router);
      co_await name_router(*router);
      in.experts_begin = [&](std::int64_t it) { router->begin_epoch(std::uint64_t(it) + 1); };
      in.experts_end = [&](std::int64_t) { router->drain(); };
    }
  }
  // A pipelined region: the tensors with this stage's region neighbours pass live.
  std::unique_ptr<boundary_exchange> live;
  if (p_.pipelined()) {
    if (!ctx_.boundaries) throw std::logic_error("a pipelined restore without a boundary inbox");
    const auto j = std::size_t(p_.stage - p_.first_stage);
    const actor_ref before = j > 0 ? p_.pipeline[j - 1] : actor_ref{};
    const actor_ref after = j + 1 < p_.pipeline.size() ? p_.pipeline[j + 1] : actor_ref{};
    live = std::make_unique<boundary_exchange>(
        ctx_.system, ctx_.io, ctx_.boundaries, p_.generation, before, after,
        models_[0]->boundary_floats(), ctx_.job.train.micro_batches, ctx_.limits.pull_chunk_bytes,
        ctx_.limits.group_wait);
    in.live_before = before.valid();
    in.live_after = after.valid();
    if (router) live->set_idle([&router] { router->serve_pending(); });
    in.take_live = [&](std::int64_t it, int mb, log_direction dir) {
      return live->take(it, mb, dir == log_direction::gradient);
    };
  }
  auto own = std::make_unique<log_store>();
  const int s = p_.stage;
  const auto me = std::size_t(p_.replica);
  in.on_sent = [&](int st, std::int64_t it, int mb, log_direction dir, std::size_t d,
                   std::span<const float> x) {
    if (st == s && d == me) {
      own->append({std::uint64_t(it), std::uint32_t(mb), dir, std::uint32_t(d)}, std::as_bytes(x));
    }
    const bool gradient = dir == log_direction::gradient;
    if (live && (gradient ? in.live_before : in.live_after)) live->send(it, mb, gradient, x);
  };
  // Every stage outside the region is paused while it replays: its GEMMs may take the host's
  // cores (BLIS gives the same bits for any thread count; tests/models/model_test.cpp), shared
  // with the other replays the coordinator runs on this host at the same time.
  const int threads = replay_threads(ctx_.job, p_.host_share);
  out_.timing.replay_threads = threads;
  co_await off_thread([&] {
    with_gemm_threads(threads, ctx_.job.train.blis_threads,
                      [&] { (void)sparse_to_dense(ptrs, in); });
  });
  if (group) co_await group->finish();
  if (live) co_await live->finish();
  const auto done = sclock::now();
  out_.timing.pull_s = std::chrono::duration<double>(pulled_at_ - started_).count();
  out_.timing.replay_s = std::chrono::duration<double>(done - pulled_at_).count();
  out_.timing.iterations_replayed = p_.target - p_.first;
  out_.log = std::move(own);
}

// A durable Restore of a window written at another layout (recovery/layout_change.hpp).
awaitable<restored_stage> restore_layout(restore_context& ctx, engine::wire::Restore::Reader m,
                                         const engine::stage_factory& factory,
                                         engine::stage_setup setup) {
  const auto started = sclock::now();
  layout_restore in;
  in.from = {m.getWindowStages(), m.getWindowReplicas(), std::max(m.getWindowEp(), 1)};
  if (in.from.stages < 1 || in.from.stages > engine::max_job_workers || in.from.replicas < 1 ||
      in.from.replicas > engine::max_job_workers || in.from.replicas % in.from.ep != 0) {
    throw std::runtime_error("malformed Restore from the coordinator (the window's layout)");
  }
  in.root = ctx.job.baseline.dir;
  in.window = m.getWindow();
  in.first_iteration = m.getFirstIteration();
  in.w_sparse = m.getWSparse();
  in.target_iteration = m.getTargetIteration();
  for (auto r : m.getSteps()) {
    engine::planned_step& st = in.steps[r.getIteration()];
    st.loss_scale = r.getLossScale();
    st.plan.apply = r.getApply();
    st.plan.grad_mul = r.getGradMul();
    st.plan.grad_norm = r.getGradNorm();
  }
  const int threads = replay_threads(ctx.job, m.getHostShare());
  const int stage = setup.stage, replica = setup.replica;
  restored_stage out;
  co_await off_thread([&] {
    ctx.durable->drain();
    with_gemm_threads(threads, ctx.job.train.blis_threads,
                      [&] { out.model = restore_across_layouts(in, factory, setup); });
    // As in any durable restore: windows newer than this one in this role's directory are
    // from a timeline the job left.
    durable_store(durable_window_dir(ctx.job.baseline.dir, stage, replica)).drop_after(in.window);
  });
  out.timing.replay_threads = threads;
  out.timing.replay_s = std::chrono::duration<double>(sclock::now() - started).count();
  out.timing.iterations_replayed = in.target_iteration - in.first_iteration;
  out.w = std::size_t(std::max(in.w_sparse, 1));
  co_return out;
}

}  // namespace

awaitable<restored_stage> restore_region(restore_context ctx, engine::wire::Restore::Reader m,
                                         const engine::stage_factory& factory,
                                         engine::stage_setup setup) {
  restore_plan plan = decode(m, ctx.job, setup, ctx.durable != nullptr);
  if (!plan.group.empty() && plan.group[std::size_t(plan.replica)].node != ctx.system.node()) {
    throw std::runtime_error(
        "malformed Restore from the coordinator (its group names another worker for this one)");
  }
  if (plan.pipelined() &&
      plan.pipeline[std::size_t(plan.stage - plan.first_stage)].node != ctx.system.node()) {
    throw std::runtime_error(
        "malformed Restore from the coordinator (its pipeline names another worker for this one)");
  }
  if (plan.durable && plan.window_pp != 0 &&
      (plan.window_pp != ctx.job.pp || plan.window_dp != ctx.job.dp ||
       std::max(plan.window_ep, 1) != std::max(ctx.job.ep, 1))) {
    co_return co_await restore_layout(ctx, m, factory, std::move(setup));
  }
  // A group replay of an older generation still waiting here ends now (superseded).
  const std::string label = fmt::format("stage {} replica {}", plan.stage, plan.replica);
  if (ctx.inbox) {
    ctx.inbox->begin(plan.generation);
    ctx.inbox->set_label(label);
  }
  if (ctx.boundaries) {
    ctx.boundaries->begin(plan.generation);
    ctx.boundaries->set_label(label);
  }
  region_restore run(std::move(ctx), m, std::move(plan), std::move(setup));
  co_return co_await run.run(factory);
}

}  // namespace moevement::recovery
