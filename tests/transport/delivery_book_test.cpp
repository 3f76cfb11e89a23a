// The delivery book alone: two books, a sender's and a receiver's, with the wire between them
// played by hand (each envelope's header handed to the other side, or not: lost).

#include "transport/delivery_book.hpp"

#include <gtest/gtest.h>

namespace moevement::transport {
namespace {

using namespace std::chrono_literals;
using verdict = delivery_book::verdict;
using clock = delivery_book::clock;

constexpr node_id sender_node = 1, receiver_node = 2;

delivery_book::words message() {
  return std::make_shared<kj::Array<capnp::word>>(kj::heapArray<capnp::word>(1));
}

struct pair_of_books {
  delivery_book sender{0x5e, {}};
  delivery_book receiver{0x7e, {}};
  clock::time_point now = clock::now();
  std::vector<std::uint64_t> handed_on;

  delivery_book::header send() { return sender.stamp(receiver_node, message()); }
  verdict arrive(const delivery_book::header& h) {
    const auto v = receiver.accept(sender_node, h, now);
    if (v == verdict::deliver) handed_on.push_back(h.seq);
    return v;
  }
  // The receiver asks again (if due); the sender answers with everything it keeps, which all
  // arrives. False when no request was due.
  bool repair() {
    auto ask = receiver.resend_request(sender_node, now);
    if (!ask) return false;
    if (sender.resend_requested(receiver_node, *ask, now)) {
      for (const auto& k : sender.unacked(receiver_node))
        arrive(sender.restamp(receiver_node, k.seq));
    }
    return true;
  }
};

TEST(delivery_book, messages_are_handed_on_once_in_order_and_copies_dropped) {
  pair_of_books b;
  const auto one = b.send(), two = b.send();
  EXPECT_EQ(b.arrive(one), verdict::deliver);
  EXPECT_EQ(b.arrive(two), verdict::deliver);
  EXPECT_EQ(b.arrive(one), verdict::duplicate);
  EXPECT_EQ(b.handed_on, (std::vector<std::uint64_t>{1, 2}));
  EXPECT_EQ(b.receiver.duplicates(), 1u);
  EXPECT_EQ(b.receiver.early(), 0u);
}

// The hole this book had: a message lost on a live connection was skipped, the next one's
// number taken as the stream going on (the gap counted, nothing more).
TEST(delivery_book, a_message_lost_in_the_middle_is_asked_for_again_and_nothing_skips_it) {
  pair_of_books b;
  const auto one = b.send(), two = b.send(), three = b.send();
  EXPECT_EQ(three.oldest, 1u) << "the header says what the sender still keeps";
  EXPECT_EQ(b.arrive(one), verdict::deliver);
  (void)two;  // lost on the wire
  EXPECT_EQ(b.arrive(three), verdict::early) << "handed on past a missing message";
  ASSERT_TRUE(b.repair());
  EXPECT_EQ(b.handed_on, (std::vector<std::uint64_t>{1, 2, 3}));
  EXPECT_EQ(b.receiver.early(), 1u);
  EXPECT_EQ(b.receiver.gaps(), 0u);
  // The request carried the ack of 1: the sender keeps 2 and 3 only, until they are acked.
  EXPECT_EQ(b.sender.unacked(receiver_node).size(), 2u);
}

TEST(delivery_book, the_first_message_of_a_stream_lost_is_asked_for_again) {
  pair_of_books b;
  const auto one = b.send(), two = b.send();
  (void)one;  // lost: the receiver has never heard of this sender
  EXPECT_EQ(b.arrive(two), verdict::early) << "a new stream started past its first message";
  ASSERT_TRUE(b.repair());
  EXPECT_EQ(b.handed_on, (std::vector<std::uint64_t>{1, 2}));
}

TEST(delivery_book, one_request_per_gap_until_resend_after_has_passed) {
  pair_of_books b;
  const auto one = b.send();
  (void)one;
  const auto two = b.send(), three = b.send();
  EXPECT_EQ(b.arrive(two), verdict::early);
  ASSERT_TRUE(b.receiver.resend_request(sender_node, b.now).has_value());
  EXPECT_EQ(b.arrive(three), verdict::early);
  EXPECT_FALSE(b.receiver.resend_request(sender_node, b.now).has_value())
      << "every message after the gap asked for the whole stream again";
  EXPECT_TRUE(b.receiver.resend_requests_due(b.now).empty());
  b.now += delivery_timing{}.resend_after;
  // A request lost too (or its answer) is asked again, with nothing more arriving.
  const auto due = b.receiver.resend_requests_due(b.now);
  ASSERT_EQ(due.size(), 1u) << "a request lost too was never asked again";
  EXPECT_EQ(due[0].second.ack_seq, 0u);
  // The gap filled by a probe of the oldest, the rest dropped behind it is asked for once
  // nothing more came for resend_after.
  EXPECT_EQ(b.arrive(b.sender.restamp(receiver_node, 1)), verdict::deliver);
  EXPECT_FALSE(b.receiver.resend_request(sender_node, b.now).has_value());
  b.now += delivery_timing{}.resend_after;
  const auto next = b.receiver.resend_request(sender_node, b.now);
  ASSERT_TRUE(next.has_value()) << "the rest dropped after the gap was never asked for";
  EXPECT_EQ(next->ack_seq, 1u);
  ASSERT_TRUE(b.sender.resend_requested(receiver_node, *next, b.now));
  for (const auto& k : b.sender.unacked(receiver_node)) {
    EXPECT_EQ(b.arrive(b.sender.restamp(receiver_node, k.seq)), verdict::deliver);
  }
  EXPECT_EQ(b.handed_on, (std::vector<std::uint64_t>{1, 2, 3}));
  EXPECT_FALSE(b.receiver.resend_request(sender_node, b.now + 1h).has_value());
}

// A lost last message shows no gap to the receiver: the sender finds it, its oldest kept
// message waiting resend_after for an ack, and sends it again (a probe).
// A peer repeating one resend request (a flood of them, or a bug): answered once, then again
// only once it got further or resend_after later. (Each copy resent everything kept.)
TEST(delivery_book, one_resend_request_repeated_is_answered_once_per_resend_after) {
  pair_of_books b;
  for (int i = 0; i < 3; ++i) b.send();
  delivery_book::header ask{};
  ask.ack_session = 0x5e;
  ask.ack_seq = 0;
  EXPECT_TRUE(b.sender.resend_requested(receiver_node, ask, b.now));
  for (int i = 0; i < 100; ++i) EXPECT_FALSE(b.sender.resend_requested(receiver_node, ask, b.now));
  ask.ack_seq = 1;  // further: answered at once
  EXPECT_TRUE(b.sender.resend_requested(receiver_node, ask, b.now));
  EXPECT_FALSE(b.sender.resend_requested(receiver_node, ask, b.now + 100ms));
  EXPECT_TRUE(b.sender.resend_requested(receiver_node, ask, b.now + 501ms));
}

TEST(delivery_book, a_lost_last_message_goes_again_once_unacknowledged_for_resend_after) {
  pair_of_books b;
  const auto one = b.send();
  (void)one;  // lost
  EXPECT_TRUE(b.sender.probes_due(b.now).empty()) << "its wait starts at the first look";
  b.now += delivery_timing{}.resend_after - 1ms;
  EXPECT_TRUE(b.sender.probes_due(b.now).empty()) << "probed before resend_after";
  b.now += 1ms;
  auto probes = b.sender.probes_due(b.now);
  ASSERT_EQ(probes.size(), 1u);
  EXPECT_EQ(probes[0].first, receiver_node);
  EXPECT_EQ(b.arrive(b.sender.restamp(receiver_node, probes[0].second.seq)), verdict::deliver);
  EXPECT_TRUE(b.sender.probes_due(b.now).empty()) << "probed twice in one interval";
  // The receiver acknowledges within ack_delay; acknowledged, nothing is probed again.
  EXPECT_FALSE(b.receiver.ack_due(sender_node, b.now));
  b.now += delivery_timing{}.ack_delay;
  ASSERT_TRUE(b.receiver.ack_due(sender_node, b.now));
  EXPECT_EQ(b.receiver.acks_due(b.now), std::vector<node_id>{sender_node});
  const auto ack = b.receiver.ack_header(sender_node);
  b.sender.acked(receiver_node, ack.ack_session, ack.ack_seq);
  EXPECT_TRUE(b.sender.unacked(receiver_node).empty());
  b.now += 10 * delivery_timing{}.resend_after;
  EXPECT_TRUE(b.sender.probes_due(b.now).empty());
  EXPECT_FALSE(b.receiver.ack_due(sender_node, b.now)) << "acked twice";
}

// A probe of a message handed on already (its ack was lost, or slow): the copy is dropped
// and answered with an ack, so the sender stops keeping it.
TEST(delivery_book, a_copy_is_answered_with_an_ack) {
  pair_of_books b;
  const auto one = b.send();
  EXPECT_EQ(b.arrive(one), verdict::deliver);
  (void)b.receiver.ack_header(sender_node);  // this ack is lost
  EXPECT_FALSE(b.receiver.ack_due(sender_node, b.now + 1h));
  EXPECT_EQ(b.arrive(b.sender.restamp(receiver_node, 1)), verdict::duplicate);
  EXPECT_TRUE(b.receiver.ack_due(sender_node, b.now + delivery_timing{}.ack_delay));
}

// Messages the sender no longer keeps (it forgot the receiver, or kept more than max_unacked)
// cannot come again: the stream goes on from the oldest it keeps, the skipped ones counted.
TEST(delivery_book, messages_the_sender_no_longer_keeps_are_skipped_and_counted) {
  pair_of_books b;
  EXPECT_EQ(b.arrive(b.send()), verdict::deliver);
  (void)b.send();
  (void)b.send();  // both lost, then forgotten
  b.sender.forget(receiver_node);
  const auto four = b.send();
  EXPECT_EQ(four.seq, 4u) << "numbering starts again after a forget";
  EXPECT_EQ(four.oldest, 4u);
  EXPECT_EQ(b.arrive(four), verdict::deliver);
  EXPECT_EQ(b.receiver.gaps(), 2u);
  EXPECT_EQ(b.handed_on, (std::vector<std::uint64_t>{1, 4}));
}

TEST(delivery_book, acks_and_requests_of_another_life_of_the_sender_are_ignored) {
  pair_of_books b;
  (void)b.send();
  delivery_book::header stale{0x7e, 0, /*ack_session=*/0x99, /*ack_seq=*/1, 0};
  b.sender.acked(receiver_node, stale.ack_session, stale.ack_seq);
  EXPECT_EQ(b.sender.unacked(receiver_node).size(), 1u);
  EXPECT_FALSE(b.sender.resend_requested(receiver_node, stale, b.now));
  EXPECT_EQ(b.sender.unacked(receiver_node).size(), 1u);
}

// A new process on the sender's node (a new session): its stream starts afresh, and what the
// receiver kept for the old one is dropped.
TEST(delivery_book, a_new_session_starts_a_new_stream) {
  pair_of_books b;
  EXPECT_EQ(b.arrive(b.send()), verdict::deliver);
  (void)b.receiver.stamp(sender_node, message());  // kept for the old process
  delivery_book restarted{0x5f, {}};
  const auto first = restarted.stamp(receiver_node, message());
  EXPECT_EQ(b.arrive(first), verdict::deliver);
  EXPECT_EQ(b.handed_on, (std::vector<std::uint64_t>{1, 1}));
  // What the receiver kept stays until acked: some of it may have gone to the new process.
  EXPECT_EQ(b.receiver.unacked(sender_node).size(), 1u);
}

// A go-back-N answer that arrives in pieces (each rendezvous envelope is handed on alone)
// asks for nothing more: an ask per piece sent the whole stream again each time.
TEST(delivery_book, an_answer_handed_on_in_pieces_asks_for_nothing_more) {
  pair_of_books b;
  std::vector<delivery_book::header> sent;
  for (int i = 0; i < 10; ++i) sent.push_back(b.send());
  for (int i = 1; i < 10; ++i) EXPECT_EQ(b.arrive(sent[i]), verdict::early);  // 1 lost
  auto ask = b.receiver.resend_request(sender_node, b.now);
  ASSERT_TRUE(ask.has_value());
  ASSERT_TRUE(b.sender.resend_requested(receiver_node, *ask, b.now));
  int asks = 0;
  for (const auto& k : b.sender.unacked(receiver_node)) {
    EXPECT_EQ(b.arrive(b.sender.restamp(receiver_node, k.seq)), verdict::deliver);
    if (b.receiver.resend_request(sender_node, b.now)) ++asks;
  }
  EXPECT_EQ(asks, 0) << "pieces of an answer asked for the stream again";
  EXPECT_EQ(b.handed_on.size(), 10u);
  // A hole inside the answer (one of it lost too) is asked for at once.
  std::vector<delivery_book::header> more;
  for (int i = 0; i < 4; ++i) more.push_back(b.send());
  EXPECT_EQ(b.arrive(more[1]), verdict::early);  // 11 lost
  ask = b.receiver.resend_request(sender_node, b.now);
  ASSERT_TRUE(ask.has_value());
  EXPECT_EQ(ask->ack_seq, 10u);
  EXPECT_EQ(b.arrive(b.sender.restamp(receiver_node, 11)), verdict::deliver);
  EXPECT_EQ(b.arrive(b.sender.restamp(receiver_node, 12)), verdict::deliver);
  EXPECT_EQ(b.arrive(more[3]), verdict::early);  // 13 lost again
  ask = b.receiver.resend_request(sender_node, b.now);
  ASSERT_TRUE(ask.has_value()) << "a hole in the answer waited for resend_after";
  EXPECT_EQ(ask->ack_seq, 12u);
}

// Probes of a peer that answers nothing (stopped) back off: resend_after, twice that, ...
TEST(delivery_book, probes_of_a_silent_peer_back_off) {
  pair_of_books b;
  (void)b.send();
  (void)b.sender.probes_due(b.now);  // the first look
  const auto step = delivery_timing{}.resend_after;
  std::vector<int> gaps;
  int since = 0;
  for (int t = 0; t < 40; ++t) {
    b.now += step;
    ++since;
    if (!b.sender.probes_due(b.now).empty()) {
      gaps.push_back(since);
      since = 0;
    }
  }
  EXPECT_EQ(gaps, (std::vector<int>{1, 2, 4, 8, 16})) << "probes did not back off";
}

// A goodbye says the last message numbered for the receiver: it is acted on only once every
// one before it was handed on (those missing are asked for); after its time they are counted.
TEST(delivery_book, a_goodbye_waits_for_the_messages_numbered_before_it) {
  pair_of_books b;
  const auto one = b.send(), two = b.send();
  EXPECT_EQ(b.arrive(one), verdict::deliver);
  const auto bye = b.sender.goodbye_header(receiver_node);
  EXPECT_EQ(bye.seq, 2u);
  EXPECT_EQ(b.receiver.missing_before_goodbye(sender_node, bye), 1u);
  auto ask = b.receiver.resend_request(sender_node, b.now);
  ASSERT_TRUE(ask.has_value()) << "the message missing at the goodbye was never asked for";
  EXPECT_EQ(ask->ack_seq, 1u);
  EXPECT_EQ(b.arrive(two), verdict::deliver);
  EXPECT_EQ(b.receiver.missing_before_goodbye(sender_node, bye), 0u);
  // A goodbye that comes before anything of its session (its first messages on another
  // connection): all the sender keeps is still to come.
  pair_of_books c;
  const auto first = c.send(), second = c.send();
  const auto early_bye = c.sender.goodbye_header(receiver_node);
  EXPECT_EQ(c.receiver.missing_before_goodbye(sender_node, early_bye), 2u);
  EXPECT_EQ(c.arrive(first), verdict::deliver);
  EXPECT_EQ(c.arrive(second), verdict::deliver);
  EXPECT_EQ(c.receiver.missing_before_goodbye(sender_node, early_bye), 0u);
  // A sender that keeps nothing for us (all acked, or forgotten) leaves nothing to wait for.
  c.sender.acked(receiver_node, c.sender.session(), 2);
  EXPECT_EQ(c.receiver.missing_before_goodbye(sender_node, c.sender.goodbye_header(receiver_node)),
            0u);
  pair_of_books d;
  (void)d.send();
  d.sender.forget(receiver_node);
  EXPECT_EQ(d.receiver.missing_before_goodbye(sender_node, d.sender.goodbye_header(receiver_node)),
            0u)
      << "a goodbye waited for messages its sender forgot";
}

}  // namespace
}  // namespace moevement::transport
