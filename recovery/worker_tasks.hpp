// Two building blocks of the policies' actors (moevement_policy, baseline_policy): heavy work
// on a thread of its own, and large pulls in pieces.
#pragma once

#include <asio/co_spawn.hpp>
#include <asio/thread_pool.hpp>
#include <asio/use_awaitable.hpp>

#include <algorithm>
#include <cstdint>
#include <exception>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>

#include "engine/bulk_io.hpp"

namespace moevement::recovery {

// Runs fn on a thread of its own and waits (the actor thread keeps heartbeating); an
// exception in fn comes back as a std::runtime_error: itself where it is one (its type kept:
// engine::snapshot_lost, engine::replay_mismatch), else one with its message.
template <class F>
asio::awaitable<void> off_thread(F&& fn) {
  std::string error;
  std::exception_ptr failure;
  asio::thread_pool pool(1);
  auto task = [&]() -> asio::awaitable<void> {
    try {
      fn();
    } catch (const std::runtime_error&) {
      failure = std::current_exception();
    } catch (const std::exception& e) {
      error = e.what();
    }
    co_return;
  };
  co_await asio::co_spawn(pool.get_executor(), std::move(task), asio::use_awaitable);
  if (failure) std::rethrow_exception(failure);
  if (!error.empty()) throw std::runtime_error(error);
}

// Pulls what `from` names into `into` in pieces of at most `chunk` bytes, one after the
// other, so that no single transfer holds the event loops (heartbeats) for long.
inline asio::awaitable<result<void>> pull_chunked(engine::bulk_io& io,
                                                  transport::bulk_descriptor from,
                                                  std::span<std::byte> into,
                                                  std::shared_ptr<void> keep, std::uint64_t chunk) {
  if (into.size() != from.length) co_return error{"pull: size mismatch"};
  for (std::uint64_t off = 0; off < from.length; off += chunk) {
    transport::bulk_descriptor piece = from;
    piece.offset = from.offset + off;
    piece.length = std::min(chunk, from.length - off);
    auto r = co_await io.pull(piece, into.subspan(off, piece.length), keep);
    if (!r.ok()) co_return r;
  }
  co_return result<void>{};
}

}  // namespace moevement::recovery
