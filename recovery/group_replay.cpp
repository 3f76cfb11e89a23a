#include "recovery/group_replay.hpp"

#include <fmt/format.h>
#include <asio/co_spawn.hpp>
#include <asio/redirect_error.hpp>
#include <asio/use_awaitable.hpp>

#include <cstdio>
#include <cstring>
#include <future>
#include <optional>
#include <stdexcept>

#include "engine/stage_model.hpp"
#include "recovery/worker_tasks.hpp"

namespace moevement::recovery {

using asio::awaitable;

namespace {
// A replay's wait that goes on this long says on the worker's stderr what it waits for (a
// peer's message that never came, a pull that never ended), and again as often after.
constexpr std::chrono::seconds report_after{30};
}  // namespace

void group_inbox::wake_all() {
  for (asio::steady_timer* t : waiters_) t->cancel();
}

void group_inbox::begin(std::uint64_t generation) {
  if (generation <= generation_) return;
  generation_ = generation;
  std::erase_if(got_, [&](const auto& e) { return std::get<0>(e.first) < generation; });
  std::erase_if(routers_, [&](const auto& e) { return e.first.first < generation; });
  std::vector<std::function<void()>> stops;
  for (auto it = on_superseded_.begin(); it != on_superseded_.end() && it->first < generation;) {
    stops.push_back(std::move(it->second));
    it = on_superseded_.erase(it);
  }
  for (auto& stop : stops) stop();
  wake_all();
}

void group_inbox::when_superseded(std::uint64_t generation, std::function<void()> stop) {
  if (generation < generation_) {
    stop();
    return;
  }
  on_superseded_.emplace(generation, std::move(stop));
}

bool group_inbox::put_router(std::uint64_t generation, std::uint32_t replica,
                             actors::actor_ref router) {
  if (generation < generation_ || size() >= max_entries_ || !router.valid()) {
    ++refused_;
    return false;
  }
  routers_[{generation, replica}] = router;
  wake_all();
  return true;
}

awaitable<actors::actor_ref> group_inbox::take_router(std::uint64_t generation,
                                                      std::uint32_t replica,
                                                      std::chrono::steady_clock::duration timeout) {
  co_return co_await wait_for<actors::actor_ref>(
      generation, timeout,
      [&]() -> std::optional<actors::actor_ref> {
        const auto it = routers_.find({generation, replica});
        if (it == routers_.end()) return std::nullopt;
        const actors::actor_ref r = it->second;
        routers_.erase(it);
        return r;
      },
      fmt::format("replica {} of the recovery group never named its expert router", replica));
}

bool group_inbox::put(std::uint64_t generation, std::int64_t iteration, std::uint32_t replica,
                      const transport::bulk_descriptor& d) {
  // A newer generation than begun here is kept: the coordinator's word of it (or this
  // worker's Restore) may still be on its way.
  if (generation < generation_ || got_.size() >= max_entries_) {
    ++refused_;
    return false;
  }
  got_[{generation, iteration, replica}] = d;
  wake_all();
  return true;
}

std::string group_inbox::describe() const {
  std::string held;
  int n = 0;
  for (const auto& [key, d] : got_) {
    if (n++ == 8) {
      held += fmt::format(" and {} more", got_.size() - 8);
      break;
    }
    held += fmt::format(" (generation {}, iteration {}, from {})", std::get<0>(key),
                        std::get<1>(key), std::get<2>(key));
  }
  return fmt::format("the inbox is at generation {}, has refused {}, holds{}", generation_,
                     refused_, held.empty() ? " nothing" : held);
}

template <class T, class Ready>
awaitable<T> group_inbox::wait_for(std::uint64_t generation,
                                   std::chrono::steady_clock::duration timeout, Ready ready,
                                   const std::string& what) {
  const auto began = std::chrono::steady_clock::now();
  const auto deadline = began + timeout;
  auto report = began + report_after;
  asio::steady_timer timer(io_);
  for (;;) {
    if (generation < generation_) {
      throw std::runtime_error(
          fmt::format("the group replay of generation {} was superseded by generation {}",
                      generation, generation_));
    }
    if (std::optional<T> got = ready()) co_return *got;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) throw std::runtime_error(what);
    if (now >= report) {
      fmt::print(stderr, "group replay{} (generation {}): waited {:.0f} s so far: {}; {}\n",
                 label_.empty() ? "" : " of " + label_, generation,
                 std::chrono::duration<double>(now - began).count(), what, describe());
      report = now + report_after;
    }
    timer.expires_at(std::min(deadline, report));
    waiters_.insert(&timer);
    // Out of the set however this frame ends (also destroyed while it waits).
    struct unlist {
      std::set<asio::steady_timer*>& set;
      asio::steady_timer* t;
      ~unlist() { set.erase(t); }
    } guard{waiters_, &timer};
    asio::error_code ec;  // cancelled: something arrived (or a newer generation began)
    co_await timer.async_wait(asio::redirect_error(asio::use_awaitable, ec));
  }
}

awaitable<transport::bulk_descriptor> group_inbox::take(std::uint64_t generation,
                                                        std::int64_t iteration,
                                                        std::uint32_t replica,
                                                        std::chrono::steady_clock::duration timeout,
                                                        std::optional<std::int64_t> ended,
                                                        std::string_view what) {
  // (Named, not a temporary in the co_await: g++ 12 may destroy those twice; `what` is copied
  // before the first wait, its caller's string may be gone after.)
  const std::string never =
      what.empty()
          ? fmt::format("replica {} of the recovery group never sent its gradients of iteration {}",
                        replica, iteration)
          : std::string(what);
  co_return co_await wait_for<transport::bulk_descriptor>(
      generation, timeout,
      [&]() -> std::optional<transport::bulk_descriptor> {
        const auto it = got_.find({generation, iteration, replica});
        if (it == got_.end()) {
          // A peer's announcements come in order: its end before this one is a replay that
          // stopped short of it.
          if (ended && got_.contains({generation, *ended, replica})) {
            throw std::runtime_error(
                fmt::format("replica {} of the recovery group ended its replay without sending its "
                            "gradients of iteration {} (the members replayed different iterations)",
                            replica, iteration));
          }
          return std::nullopt;
        }
        const transport::bulk_descriptor d = it->second;
        got_.erase(it);
        return d;
      },
      never);
}

group_exchange::group_exchange(std::shared_ptr<group_inbox> gradients,
                               std::shared_ptr<group_inbox> boundaries)
    : inbox_(std::move(gradients)), boundaries_(std::move(boundaries)) {
  on<wire::ReplayGradients>(&group_exchange::gradients);
  on<wire::ReplayBoundary>(&group_exchange::boundary);
  on<engine::wire::ReplayGeneration>(&group_exchange::generation);
  on<wire::ReplayExperts>(&group_exchange::experts);
}

awaitable<void> group_exchange::experts(wire::ReplayExperts::Reader m) {
  if (!m.hasRouter() ||
      !inbox_->put_router(m.getGeneration(), m.getReplica(), actors::read_ref(m.getRouter()))) {
    ++refused_;
  }
  co_return;
}

awaitable<void> group_exchange::generation(engine::wire::ReplayGeneration::Reader m) {
  inbox_->begin(m.getGeneration());
  boundaries_->begin(m.getGeneration());
  co_return;
}

awaitable<void> group_exchange::boundary(wire::ReplayBoundary::Reader m) {
  auto d = transport::read_descriptor(m.getTensor());
  if (!d.ok() || m.getMicroBatch() > (1u << 20) ||
      !boundaries_->put(m.getGeneration(), m.getIteration(),
                        boundary_exchange::tag(int(m.getMicroBatch()), m.getGradient()), *d)) {
    ++refused_;
  }
  co_return;
}

awaitable<void> group_exchange::gradients(wire::ReplayGradients::Reader m) {
  // Checked against what the replay expects (the peer's node, the length) when it is taken.
  auto d = transport::read_descriptor(m.getTensor());
  if (!d.ok() || !inbox_->put(m.getGeneration(), m.getIteration(), m.getReplica(), *d)) {
    ++refused_;
  }
  co_return;
}

group_reducer::group_reducer(actors::actor_system& system, engine::bulk_io& io,
                             std::shared_ptr<group_inbox> inbox, std::uint64_t generation,
                             std::uint32_t replica, std::vector<actors::actor_ref> peers,
                             group_layout layout, std::uint64_t pull_chunk_bytes,
                             std::chrono::steady_clock::duration wait)
    : system_(system),
      io_(io),
      inbox_(std::move(inbox)),
      generation_(generation),
      replica_(replica),
      peers_(std::move(peers)),
      layout_(layout),
      floats_(layout.floats()),
      chunk_(pull_chunk_bytes),
      wait_(wait),
      buffers_{io_.allocate(std::max<std::size_t>(floats_, 1) * sizeof(float)),
               io_.allocate(std::max<std::size_t>(floats_, 1) * sizeof(float))},
      incoming_() {
  if (replica_ >= peers_.size()) throw std::invalid_argument("group_reducer: replica outside");
}

namespace {

// Runs `task` on the actor thread and waits for it, from the replay's thread; `idle` (if set)
// runs there every millisecond meanwhile.
template <class Task>
void wait_on_actor_thread(actors::actor_system& system, Task task,
                          const std::function<void()>& idle = {},
                          const std::function<std::string()>& what = {},
                          const std::string& label = {}) {
  if (system.io().get_executor().running_in_this_thread()) {
    throw std::logic_error("a group replay waits on the actor thread (it would wait for itself)");
  }
  // Owned by the completion handler: if the io_context goes first (the process stopping),
  // the handler is destroyed and the promise broken, which ends the wait below.
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  asio::co_spawn(system.io(), std::move(task), [done](std::exception_ptr e) {
    if (e) {
      done->set_exception(e);
    } else {
      done->set_value();
    }
  });
  // The inbox reports a message that does not come; this, a wait that does not end at all
  // (a pull whose answer never comes).
  const auto began = std::chrono::steady_clock::now();
  auto report = began + report_after;
  const auto step = idle ? std::chrono::milliseconds(1) : std::chrono::milliseconds(100);
  while (finished.wait_for(step) != std::future_status::ready) {
    if (idle) idle();
    if (const auto now = std::chrono::steady_clock::now(); what && now >= report) {
      fmt::print(stderr, "group replay{}: waited {:.0f} s so far for {}\n",
                 label.empty() ? "" : " of " + label,
                 std::chrono::duration<double>(now - began).count(), what());
      report = now + report_after;
    }
  }
  finished.get();
}

}  // namespace

template <class Task>
void group_reducer::on_actor_thread(Task task, std::function<std::string()> what) {
  wait_on_actor_thread(system_, std::move(task), {}, what, inbox_->label());
}

awaitable<void> group_reducer::announce(std::int64_t iteration,
                                        const transport::bulk_descriptor& mine) {
  for (std::uint32_t d = 0; d < peers_.size(); ++d) {
    if (d == replica_) continue;
    (void)system_.tell<wire::ReplayGradients>(peers_[d], [&](wire::ReplayGradients::Builder b) {
      b.setGeneration(generation_);
      b.setIteration(iteration);
      b.setReplica(replica_);
      transport::write_descriptor(b.initTensor(), mine);
    });
  }
  co_return;
}

awaitable<void> group_reducer::pull(std::int64_t iteration, std::uint32_t d) {
  const transport::bulk_descriptor desc =
      co_await inbox_->take(generation_, iteration, d, wait_, done_);
  if (desc.node != peers_[d].node || desc.length != floats_ * sizeof(float)) {
    throw std::runtime_error(fmt::format(
        "replica {} of the recovery group announced gradients that do not match the replay "
        "({} bytes on node {}, expected {} on node {})",
        d, desc.length, desc.node, floats_ * sizeof(float), peers_[d].node));
  }
  pulling_ = true;
  struct not_pulling {  // however the pull ends (it throws, or the replay is dropped)
    std::atomic<bool>& flag;
    ~not_pulling() { flag = false; }
  } pulled_or_not{pulling_};
  auto pulled = co_await pull_chunked(io_, desc, std::as_writable_bytes(std::span(*incoming_)),
                                      incoming_, chunk_);
  if (!pulled.ok()) {
    throw std::runtime_error(
        fmt::format("pulling replica {}'s replay gradients failed: {}", d, pulled.err().message));
  }
}

awaitable<void> group_reducer::finish() {
  co_await announce(done_, buffers_[0].describe_all());  // a marker: never pulled
  for (std::uint32_t d = 0; d < peers_.size(); ++d) {
    if (d != replica_) (void)co_await inbox_->take(generation_, done_, d, wait_);
  }
}

void group_reducer::reduce(std::int64_t iteration, std::span<float> grads) {
  if (grads.size() != floats_) throw std::invalid_argument("group_reducer: gradient size");
  // Made here, on the replay's thread: zero-filling a stage's worth of gradients on the actor
  // thread held its heartbeats (every stage of a job rebuilt at once on two cores).
  if (!incoming_) incoming_ = std::make_shared<std::vector<float>>(floats_);
  const transport::bulk_region& buf = buffers_[std::size_t(iteration) % 2];
  const std::span<float> mine(reinterpret_cast<float*>(buf.memory().data()), floats_);
  std::memcpy(mine.data(), grads.data(), grads.size_bytes());
  const transport::bulk_descriptor desc = buf.describe(0, floats_ * sizeof(float));
  on_actor_thread(announce(iteration, desc), [&] {
    return fmt::format("generation {}: announcing iteration {} to the group", generation_,
                       iteration);
  });
  // The fold as training does it: g_0, then + g_1, + g_2, ... (engine::accumulate); under
  // expert parallelism each expert block only over its copies' sources (fold_group).
  for (std::uint32_t d = 0; d < peers_.size(); ++d) {
    std::span<const float> g = mine;
    if (d != replica_) {
      on_actor_thread(pull(iteration, d), [&] {
        return fmt::format("generation {}: replica {}'s gradients of iteration {} (announced: {})",
                           generation_, d, iteration, pulling_.load() ? "yes, pulling" : "no");
      });
      g = *incoming_;
    }
    fold_group(layout_, replica_, d, g, grads.first(layout_.dense + layout_.block));
  }
}

boundary_exchange::boundary_exchange(actors::actor_system& system, engine::bulk_io& io,
                                     std::shared_ptr<group_inbox> inbox, std::uint64_t generation,
                                     actors::actor_ref before, actors::actor_ref after,
                                     std::size_t floats, int micro_batches,
                                     std::uint64_t pull_chunk_bytes,
                                     std::chrono::steady_clock::duration wait)
    : system_(system),
      io_(io),
      inbox_(std::move(inbox)),
      generation_(generation),
      before_(before),
      after_(after),
      floats_(floats),
      micro_batches_(micro_batches),
      chunk_(pull_chunk_bytes),
      wait_(wait),
      incoming_(std::make_shared<std::vector<float>>(floats)) {
  if (micro_batches_ < 1 || floats_ == 0) throw std::invalid_argument("boundary_exchange: shape");
  const std::size_t bytes = std::size_t(micro_batches_) * floats_ * sizeof(float);
  if (after_.valid()) activations_ = io_.allocate(bytes);
  if (before_.valid()) gradients_ = io_.allocate(bytes);
}

awaitable<void> boundary_exchange::announce(std::int64_t iteration, int mb, bool gradient,
                                            transport::bulk_descriptor d) {
  const actors::actor_ref to = gradient ? before_ : after_;
  (void)system_.tell<wire::ReplayBoundary>(to, [&](wire::ReplayBoundary::Builder b) {
    b.setGeneration(generation_);
    b.setIteration(iteration);
    b.setMicroBatch(std::uint32_t(mb));
    b.setGradient(gradient);
    transport::write_descriptor(b.initTensor(), d);
  });
  co_return;
}

awaitable<void> boundary_exchange::pull(std::int64_t iteration, int mb, bool gradient) {
  const actors::actor_ref from = gradient ? after_ : before_;
  const std::string never = fmt::format(
      "the stage {} never sent its {} of iteration {}, micro-batch {}",
      gradient ? "after" : "before", gradient ? "gradient" : "activation", iteration, mb);
  const transport::bulk_descriptor desc =
      co_await inbox_->take(generation_, iteration, tag(mb, gradient), wait_, std::nullopt, never);
  if (desc.node != from.node || desc.length != floats_ * sizeof(float)) {
    throw std::runtime_error(fmt::format(
        "the region member of the stage {} announced a {} that does not match the replay ({} "
        "bytes on node {}, expected {} on node {})",
        gradient ? "after" : "before", gradient ? "gradient" : "activation", desc.length, desc.node,
        floats_ * sizeof(float), from.node));
  }
  auto pulled = co_await pull_chunked(io_, desc, std::as_writable_bytes(std::span(*incoming_)),
                                      incoming_, chunk_);
  if (!pulled.ok()) {
    throw std::runtime_error(fmt::format("pulling a region neighbour's {} failed: {}",
                                         gradient ? "gradient" : "activation",
                                         pulled.err().message));
  }
}

std::vector<float> boundary_exchange::take(std::int64_t iteration, int mb, bool gradient) {
  if (!(gradient ? after_ : before_).valid() || mb < 0 || mb >= micro_batches_) {
    throw std::invalid_argument("boundary_exchange::take: no such neighbour or micro-batch");
  }
  wait_on_actor_thread(
      system_, pull(iteration, mb, gradient), idle_,
      [&] {
        return fmt::format("generation {}: the stage {}'s {} of iteration {}, micro-batch {}",
                           generation_, gradient ? "after" : "before",
                           gradient ? "gradient" : "activation", iteration, mb);
      },
      inbox_->label());
  return *incoming_;
}

void boundary_exchange::send(std::int64_t iteration, int mb, bool gradient,
                             std::span<const float> t) {
  const transport::bulk_region& buf = gradient ? gradients_ : activations_;
  if (!(gradient ? before_ : after_).valid() || mb < 0 || mb >= micro_batches_ ||
      t.size() != floats_) {
    throw std::invalid_argument("boundary_exchange::send: no such neighbour, or a bad tensor");
  }
  const std::size_t offset = std::size_t(mb) * floats_ * sizeof(float);
  std::memcpy(buf.memory().data() + offset, t.data(), t.size_bytes());
  wait_on_actor_thread(
      system_, announce(iteration, mb, gradient, buf.describe(offset, floats_ * sizeof(float))));
}

awaitable<void> boundary_exchange::finish() {
  // Markers, never pulled: to the stage after as if an activation, to the one before as if a
  // gradient; and each neighbour's own marker the same way round.
  const std::uint64_t one = floats_ * sizeof(float);
  if (after_.valid()) co_await announce(done_, 0, false, activations_.describe(0, one));
  if (before_.valid()) co_await announce(done_, 0, true, gradients_.describe(0, one));
  if (before_.valid()) (void)co_await inbox_->take(generation_, done_, tag(0, false), wait_);
  if (after_.valid()) (void)co_await inbox_->take(generation_, done_, tag(0, true), wait_);
}

}  // namespace moevement::recovery
