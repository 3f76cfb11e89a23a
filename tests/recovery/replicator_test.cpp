// The replicator's bad input, on the deterministic scheduler: a StoreSlots longer than
// max_store_batch is dropped untouched (no answer, nothing held), an offer whose descriptor no
// exporter could have written is refused with a reason, and the replicator goes on serving.
#include "recovery/replicator.hpp"

#include <gtest/gtest.h>

#include <asio/io_context.hpp>

#include <string>
#include <vector>

#include "actors/deterministic.hpp"
#include "transport/ucx_link.hpp"

namespace moevement::recovery {
namespace {

using namespace std::chrono_literals;
using actors::awaitable;

// The agent's side: every answer it is sent, as (slots answered, the messages' reasons).
class answers : public actors::actor {
 public:
  using interface =
      actors::interface<actors::tell_t<wire::SlotStored>, actors::tell_t<wire::SlotsStored>>;
  answers() {
    on<wire::SlotStored>(&answers::one);
    on<wire::SlotsStored>(&answers::many);
  }
  int messages = 0;
  std::vector<std::string> errors;  // per slot answered, in order ("" when stored)

 private:
  awaitable<void> one(wire::SlotStored::Reader m) {
    ++messages;
    errors.push_back(m.getOk() ? "" : std::string(m.getError().cStr()));
    co_return;
  }
  awaitable<void> many(wire::SlotsStored::Reader m) {
    ++messages;
    for (auto a : m.getAnswers()) errors.push_back(a.getOk() ? "" : a.getError().cStr());
    co_return;
  }
};

// An offer of slot `slot` of window 1 whose descriptor says `length` bytes on `node`.
void offer(wire::StoreSlot::Builder b, actors::actor_ref from, std::uint32_t slot,
           std::uint32_t node, std::uint64_t length) {
  write_slot_key(b.initKey(), 0, 0, 1, slot);
  actors::write_ref(b.initFrom(), from);
  transport::write_descriptor(b.initTensor(), {node, 1, 0, length});
}

// A replicator's node 0 on the deterministic scheduler, with a real link for its bulk path
// (whose io_context nothing runs: no pull gets anywhere). Declared in this order, a pull left
// waiting on the link's io_context ends before the scheduler it returns to.
struct one_node {
  actors::deterministic d;
  asio::io_context bulk_io_context;
  transport::ucx_link link{bulk_io_context, [] {
                             transport::ucx_link_options o;
                             o.self = 0;
                             o.job_token = "replicator-test";
                             return o;
                           }()};
  engine::bulk_io bulk{link};
};

TEST(replicator, an_over_long_batch_is_dropped_and_bad_offers_are_refused_saying_why) {
  one_node n;
  auto& d = n.d;
  auto& bulk = n.bulk;
  policy_limits limits;
  limits.max_store_batch = 2;
  limits.max_slot_bytes = 1 << 20;
  auto& sys = d.add(0);
  d.run_body([&]() -> awaitable<void> {
    auto rep = sys.spawn<replicator>(bulk, limits);
    auto agent = sys.spawn<answers>();
    const std::uint64_t too_long = limits.max_slot_bytes + 1;
    // Three slots where two may come at once: dropped, none answered (each would be, refused:
    // their memory is another node's).
    EXPECT_TRUE(rep.tell<wire::StoreSlots>([&](wire::StoreSlots::Builder b) {
                     auto l = b.initSlots(3);
                     for (unsigned i = 0; i < 3; ++i) offer(l[i], agent.ref, i, 9, 4096);
                   })
                    .ok());
    // Two: each answered, in one message, with why it was refused.
    EXPECT_TRUE(rep.tell<wire::StoreSlots>([&](wire::StoreSlots::Builder b) {
                     auto l = b.initSlots(2);
                     offer(l[0], agent.ref, 3, 0, too_long);  // past max_slot_bytes
                     offer(l[1], agent.ref, 4, 9, 4096);      // memory of another node
                   })
                    .ok());
    // One alone, of no length: refused too, answered alone.
    EXPECT_TRUE(
        rep.tell<wire::StoreSlot>([&](wire::StoreSlot::Builder b) { offer(b, agent.ref, 5, 0, 0); })
            .ok());
    co_await sys.sleep_for(100ms);
    const auto* a = sys.local_actor<answers>(agent.ref);
    const auto* r = sys.local_actor<replicator>(rep.ref);
    EXPECT_TRUE(sys.alive(rep.ref));
    EXPECT_EQ(a->messages, 2);  // nothing for the batch that was too long
    EXPECT_EQ(a->errors, (std::vector<std::string>{"malformed StoreSlot", "malformed StoreSlot",
                                                   "malformed StoreSlot"}));
    EXPECT_EQ(r->bytes_held(), 0u);
  });
}

// A StoreSlot's flip bit (`--inject flip:...,target=slot`) is taken only where the job was
// launched with such a flip: from the wire alone, any member could corrupt another's copies.
TEST(replicator, a_flip_from_the_wire_is_taken_only_where_the_job_injects_one) {
  for (const bool accept : {false, true}) {
    one_node n;
    auto& d = n.d;
    auto& bulk = n.bulk;
    policy_limits limits;
    limits.accept_copy_flips = accept;
    auto& sys = d.add(0);
    d.run_body([&]() -> awaitable<void> {
      auto rep = sys.spawn<replicator>(bulk, limits);
      auto agent = sys.spawn<answers>();
      EXPECT_TRUE(rep.tell<wire::StoreSlot>([&](wire::StoreSlot::Builder b) {
                       offer(b, agent.ref, 1, 0, 4096);
                       b.setFlipBit(9);
                     })
                      .ok());
      co_await sys.sleep_for(1ms);
      EXPECT_EQ(sys.local_actor<replicator>(rep.ref)->flips_pending(), accept ? 1u : 0u)
          << (accept ? "an injected flip was dropped" : "a flip from the wire was taken");
    });
  }
}

}  // namespace
}  // namespace moevement::recovery
