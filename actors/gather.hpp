// Ask-all: the same request type to many actors at once, under one deadline, the replies in
// target order. What a coordinator does when it asks every stage something: the slowest
// answer sets the wait, not the sum of them, and a lost target costs one deadline, not one
// per target.
//
//   auto replies = co_await ask_all<Abort, AbortAck>(sys, stages, 5s,
//       [&](std::size_t i, Abort::Builder b) { b.setEpoch(epoch); }, self());
//   for (std::size_t i = 0; i < replies.size(); ++i) if (!replies[i].ok()) ...
//
// Every ask is sent before the first reply is awaited. An invalid ref gets an error result
// and no send. `fill(i, builder)` writes the request to target i just before it is sent, on
// the same thread, while the caller is suspended in ask_all (so it may refer to the caller's
// locals); a fill that throws is that target's error. If the awaiting actor stops, ask_all
// returns at once with errors for the asks not yet answered; asks already sent end by their
// deadline and their replies are dropped.
#pragma once

#include <asio/co_spawn.hpp>
#include <asio/post.hpp>
#include <asio/this_coro.hpp>

#include <memory>
#include <vector>

#include "actors/system.hpp"

namespace moevement::actors {

namespace detail {

template <class Resp>
struct gather_state : std::enable_shared_from_this<gather_state<Resp>> {
  std::vector<result<reply<Resp>>> results;
  std::size_t left = 0;
  bool cancelled = false;  // the awaiting coroutine gave up: fills must not run any more
  unique_function<void()> waiter;

  void finish_one() {
    if (--left == 0 && waiter) std::exchange(waiter, {})();
  }
};

template <class Req, class Resp, class Fill>
awaitable<void> ask_one(actor_system& sys, std::shared_ptr<gather_state<Resp>> st, std::size_t i,
                        actor_ref to, clock::duration timeout, Fill* fill, actor_ref from) {
  if (st->cancelled) {
    st->results[i] = error{"ask not sent: the asking actor stopped"};
  } else {
    auto one = [fill, i](typename Req::Builder b) { (*fill)(i, b); };
    try {
      st->results[i] = co_await sys.ask<Req, Resp>(to, timeout, std::move(one), from);
    } catch (const std::exception& e) {
      st->results[i] = error{std::string("ask not sent: ") + e.what()};
    } catch (const kj::Exception& e) {
      st->results[i] = error{std::string("ask not sent: ") + e.getDescription().cStr()};
    }
  }
  st->finish_one();
}

}  // namespace detail

template <class Req, class Resp, class Fill>
awaitable<std::vector<result<reply<Resp>>>> ask_all(actor_system& sys,
                                                    std::vector<actor_ref> targets,
                                                    clock::duration timeout, Fill fill,
                                                    actor_ref from = {}) {
  auto st = std::make_shared<detail::gather_state<Resp>>();
  st->results.reserve(targets.size());
  for (std::size_t i = 0; i < targets.size(); ++i) {
    st->results.emplace_back(error{"ask abandoned: the asking actor stopped"});
  }
  st->left = targets.size() + 1;  // + 1: this coroutine's own, released once all are sent
  auto ex = co_await asio::this_coro::executor;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (!targets[i].valid()) {
      st->results[i] = error{"no actor to ask (the role has no live actor)"};
      --st->left;
      continue;
    }
    asio::co_spawn(ex,
                   detail::ask_one<Req, Resp, Fill>(sys, st, i, targets[i], timeout, &fill, from),
                   [](std::exception_ptr) {});
  }
  if (--st->left != 0) {
    detail::gather_state<Resp>* raw = st.get();
    co_await asio::async_initiate<const asio::use_awaitable_t<>&, void()>(
        [raw](auto handler) {
          auto slot = asio::get_associated_cancellation_slot(handler);
          if (slot.is_connected()) {
            // Weak: the slot may outlive this wait (and the state) if it is emitted later.
            slot.assign([weak = raw->weak_from_this()](asio::cancellation_type) {
              auto st = weak.lock();
              if (!st) return;
              st->cancelled = true;
              if (st->waiter) std::exchange(st->waiter, {})();
            });
          }
          // Resumed from a posted call, never inside the last ask's completion.
          raw->waiter = [h = std::move(handler)]() mutable {
            auto ex2 = asio::get_associated_executor(h);
            asio::post(ex2, std::move(h));
          };
        },
        asio::use_awaitable);
  }
  if (!st->cancelled) co_return std::move(st->results);  // every ask ended: no writer left
  // Asks still out write into st->results later: the caller gets errors of its own.
  std::vector<result<reply<Resp>>> out;
  out.reserve(targets.size());
  for (std::size_t i = 0; i < targets.size(); ++i) {
    out.emplace_back(error{"ask abandoned: the asking actor stopped"});
  }
  co_return out;
}

// Inside an actor: the asks go out with the actor as the sender.
template <class Req, class Resp, class Fill>
awaitable<std::vector<result<reply<Resp>>>> ask_all(actor& self, std::vector<actor_ref> targets,
                                                    clock::duration timeout, Fill fill) {
  return ask_all<Req, Resp>(self.system(), std::move(targets), timeout, std::move(fill),
                            self.self());
}

}  // namespace moevement::actors
