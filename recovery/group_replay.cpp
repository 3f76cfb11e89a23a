#include "recovery/group_replay.hpp"

#include <fmt/format.h>
#include <asio/co_spawn.hpp>
#include <asio/redirect_error.hpp>
#include <asio/use_awaitable.hpp>

#include <cstring>
#include <future>
#include <stdexcept>

#include "engine/stage_model.hpp"
#include "recovery/worker_tasks.hpp"

namespace moevement::recovery {

using asio::awaitable;

void group_inbox::wake_all() {
  for (asio::steady_timer* t : waiters_) t->cancel();
}

void group_inbox::begin(std::uint64_t generation) {
  if (generation <= generation_) return;
  generation_ = generation;
  std::erase_if(got_, [&](const auto& e) { return std::get<0>(e.first) < generation; });
  wake_all();
}

bool group_inbox::put(std::uint64_t generation, std::int64_t iteration, std::uint32_t replica,
                      const transport::bulk_descriptor& d) {
  // A newer generation than begun here is kept: the coordinator's word of it (or this
  // worker's Restore) may still be on its way.
  if (generation < generation_ || got_.size() >= max_entries_) return false;
  got_[{generation, iteration, replica}] = d;
  wake_all();
  return true;
}

awaitable<transport::bulk_descriptor> group_inbox::take(
    std::uint64_t generation, std::int64_t iteration, std::uint32_t replica,
    std::chrono::steady_clock::duration timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  asio::steady_timer timer(io_);
  for (;;) {
    if (generation < generation_) {
      throw std::runtime_error(
          fmt::format("the group replay of generation {} was superseded by generation {}",
                      generation, generation_));
    }
    const auto it = got_.find({generation, iteration, replica});
    if (it != got_.end()) {
      const transport::bulk_descriptor d = it->second;
      got_.erase(it);
      co_return d;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      throw std::runtime_error(
          fmt::format("replica {} of the recovery group never sent its gradients of iteration {}",
                      replica, iteration));
    }
    timer.expires_at(deadline);
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

group_exchange::group_exchange(std::shared_ptr<group_inbox> inbox) : inbox_(std::move(inbox)) {
  on<wire::ReplayGradients>(&group_exchange::gradients);
  on<engine::wire::ReplayGeneration>(&group_exchange::generation);
}

awaitable<void> group_exchange::generation(engine::wire::ReplayGeneration::Reader m) {
  inbox_->begin(m.getGeneration());
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
                             std::size_t floats, std::uint64_t pull_chunk_bytes,
                             std::chrono::steady_clock::duration wait)
    : system_(system),
      io_(io),
      inbox_(std::move(inbox)),
      generation_(generation),
      replica_(replica),
      peers_(std::move(peers)),
      floats_(floats),
      chunk_(pull_chunk_bytes),
      wait_(wait),
      buffers_{io_.allocate(std::max<std::size_t>(floats, 1) * sizeof(float)),
               io_.allocate(std::max<std::size_t>(floats, 1) * sizeof(float))},
      incoming_(std::make_shared<std::vector<float>>(floats)) {
  if (replica_ >= peers_.size()) throw std::invalid_argument("group_reducer: replica outside");
}

template <class Task>
void group_reducer::on_actor_thread(Task task) {
  if (system_.io().get_executor().running_in_this_thread()) {
    throw std::logic_error("group_reducer::reduce on the actor thread (it would wait for itself)");
  }
  // Owned by the completion handler: if the io_context goes first (the process stopping),
  // the handler is destroyed and the promise broken, which ends the wait below.
  auto done = std::make_shared<std::promise<void>>();
  auto finished = done->get_future();
  asio::co_spawn(system_.io(), std::move(task), [done](std::exception_ptr e) {
    if (e) {
      done->set_exception(e);
    } else {
      done->set_value();
    }
  });
  finished.get();
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
  const transport::bulk_descriptor desc = co_await inbox_->take(generation_, iteration, d, wait_);
  if (desc.node != peers_[d].node || desc.length != floats_ * sizeof(float)) {
    throw std::runtime_error(fmt::format(
        "replica {} of the recovery group announced gradients that do not match the replay "
        "({} bytes on node {}, expected {} on node {})",
        d, desc.length, desc.node, floats_ * sizeof(float), peers_[d].node));
  }
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
  const transport::bulk_region& buf = buffers_[std::size_t(iteration) % 2];
  const std::span<float> mine(reinterpret_cast<float*>(buf.memory().data()), floats_);
  std::memcpy(mine.data(), grads.data(), grads.size_bytes());
  const transport::bulk_descriptor desc = buf.describe(0, floats_ * sizeof(float));
  on_actor_thread(announce(iteration, desc));
  // The fold as training does it: g_0, then + g_1, + g_2, ... (engine::accumulate).
  for (std::uint32_t d = 0; d < peers_.size(); ++d) {
    std::span<const float> g = mine;
    if (d != replica_) {
      on_actor_thread(pull(iteration, d));
      g = *incoming_;
    }
    if (d == 0) {
      std::memcpy(grads.data(), g.data(), g.size_bytes());
    } else {
      engine::accumulate(grads, g);
    }
  }
}

}  // namespace moevement::recovery
