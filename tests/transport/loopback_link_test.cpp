// The in-process link the actor tests run on: real serialization, posted delivery, FIFO per
// peer, and the three ways a peer goes away (crash, hang, goodbye), plus forget().
#include "transport/loopback_link.hpp"

#include <gtest/gtest.h>

#include <vector>

namespace moevement::transport {
namespace {

struct recorder {
  std::vector<std::pair<node_id, envelope_header>> messages;
  std::vector<std::pair<node_id, peer_loss>> losses;
  link_handlers handlers() {
    link_handlers h;
    h.on_message = [this](node_id from, incoming_envelope env) {
      messages.emplace_back(from, env.header());
    };
    h.on_peer_lost = [this](node_id peer, peer_loss why, const std::string&) {
      losses.emplace_back(peer, why);
    };
    return h;
  }
};

kj::Array<capnp::word> make(std::uint64_t corr) {
  outgoing_envelope out({{1, 1, 5}, {2, 1, 6}, 0, corr, 0});
  out.init_payload<wire::ActorAddress>().setActor(corr);
  return out.to_words();
}

TEST(loopback_link, delivers_serialized_envelopes_later_and_in_order) {
  asio::io_context io;
  loopback_hub hub(io);
  auto a = hub.attach(1);
  auto b = hub.attach(2);
  recorder rb;
  b->set_handlers(rb.handlers());
  for (std::uint64_t i = 1; i <= 5; ++i) ASSERT_TRUE(a->send(2, make(i)).ok());
  EXPECT_TRUE(rb.messages.empty());  // posted, never inline
  io.run();
  ASSERT_EQ(rb.messages.size(), 5u);
  for (std::uint64_t i = 0; i < 5; ++i) {
    EXPECT_EQ(rb.messages[i].first, 1u);
    EXPECT_EQ(rb.messages[i].second.correlation_id, i + 1);
    EXPECT_EQ(rb.messages[i].second.sender, (actor_address{1, 1, 5}));
  }
  EXPECT_EQ(a->stats().sent, 5u);
  EXPECT_EQ(b->stats().received, 5u);
  EXPECT_FALSE(a->send(7, make(1)).ok());  // unknown peer: error at once
  EXPECT_FALSE(a->send(1, make(1)).ok());  // not to itself
  EXPECT_EQ(a->stats().send_errors, 2u);
}

TEST(loopback_link, malformed_bytes_are_counted_and_dropped) {
  asio::io_context io;
  loopback_hub hub(io);
  auto a = hub.attach(1);
  auto b = hub.attach(2);
  recorder rb;
  b->set_handlers(rb.handlers());
  const std::byte junk[16] = {std::byte{0x05}, std::byte{0}, std::byte{0}, std::byte{0}};
  hub.inject(1, 2, junk);
  hub.inject(1, 2, std::span(junk).first(5));  // not whole words
  io.run();
  EXPECT_TRUE(rb.messages.empty());
  EXPECT_EQ(b->stats().malformed, 2u);
}

TEST(loopback_link, crash_is_reported_once_to_every_other_node) {
  asio::io_context io;
  loopback_hub hub(io);
  auto a = hub.attach(1);
  auto b = hub.attach(2);
  auto c = hub.attach(3);
  recorder ra, rb, rc;
  a->set_handlers(ra.handlers());
  b->set_handlers(rb.handlers());
  c->set_handlers(rc.handlers());
  ASSERT_TRUE(c->send(2, make(1)).ok());
  hub.crash(3);
  hub.crash(3);
  io.run();
  EXPECT_TRUE(rb.messages.empty() || rb.messages.size() == 1u);
  ASSERT_EQ(ra.losses.size(), 1u);
  EXPECT_EQ(ra.losses[0], std::make_pair(node_id{3}, peer_loss::crash));
  ASSERT_EQ(rb.losses.size(), 1u);
  EXPECT_TRUE(rc.losses.empty());
  EXPECT_FALSE(a->send(3, make(1)).ok());  // fail fast to a crashed peer
  EXPECT_FALSE(c->send(1, make(1)).ok());  // and a crashed node sends nothing
}

TEST(loopback_link, a_hung_node_goes_silent_without_any_report) {
  asio::io_context io;
  loopback_hub hub(io);
  auto a = hub.attach(1);
  auto b = hub.attach(2);
  recorder ra, rb;
  a->set_handlers(ra.handlers());
  b->set_handlers(rb.handlers());
  hub.hang(2);
  EXPECT_TRUE(a->send(2, make(1)).ok());  // the transport cannot tell
  EXPECT_TRUE(b->send(1, make(2)).ok());
  io.run();
  EXPECT_TRUE(ra.messages.empty());
  EXPECT_TRUE(rb.messages.empty());
  EXPECT_TRUE(ra.losses.empty());
  // forget(): sends fail from now on and the loss is reported once, as a crash.
  a->forget(2);
  EXPECT_FALSE(a->send(2, make(3)).ok());
  a->forget(2);
  io.restart();
  io.run();
  ASSERT_EQ(ra.losses.size(), 1u);
  EXPECT_EQ(ra.losses[0], std::make_pair(node_id{2}, peer_loss::crash));
}

TEST(loopback_link, goodbye_is_reported_as_goodbye) {
  asio::io_context io;
  loopback_hub hub(io);
  auto a = hub.attach(1);
  auto b = hub.attach(2);
  recorder ra;
  a->set_handlers(ra.handlers());
  b->say_goodbye();
  io.run();
  ASSERT_EQ(ra.losses.size(), 1u);
  EXPECT_EQ(ra.losses[0], std::make_pair(node_id{2}, peer_loss::goodbye));
  EXPECT_FALSE(a->send(2, make(1)).ok());
  EXPECT_FALSE(b->send(1, make(1)).ok());
}

}  // namespace
}  // namespace moevement::transport
