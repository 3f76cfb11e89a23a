// Messages that survive a failed connection to a live peer. Every envelope to a peer carries
// this link's session (random per link) and a sequence number; the receiver hands each one on
// once, in order, and acknowledges what it handed on (carried on its own envelopes, or in an
// explicit ack when it has none to send); the sender keeps what is not acknowledged and sends
// it again, first and in order, on the next connection to that peer. So a message is never
// lost to a connection that fails and is dialled again, and never applied twice.
// Pure bookkeeping, one per link, on the link's thread.
#pragma once

#include <capnp/common.h>
#include <kj/array.h>

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "transport/link.hpp"

namespace moevement::transport {

class delivery_book {
 public:
  using words = std::shared_ptr<kj::Array<capnp::word>>;
  struct stamped {
    std::uint64_t seq = 0;
    words message;
  };
  // What an envelope's header says about the stream it belongs to.
  struct header {
    std::uint64_t session = 0;      // the sender's
    std::uint64_t seq = 0;          // in the sender's stream to this receiver
    std::uint64_t ack_session = 0;  // the receiver's session the sender has heard from
    std::uint64_t ack_seq = 0;      // the last of it the sender handed on
  };
  // Unacknowledged messages kept per peer at most (the oldest go first past it, counted).
  static constexpr std::size_t max_unacked = 65536;
  // Handed-on messages after which an explicit ack goes out (nothing carried one back).
  static constexpr std::uint64_t ack_every = 64;

  explicit delivery_book(std::uint64_t session) : session_(session) {}
  std::uint64_t session() const { return session_; }

  // ---- sending
  // Numbers a message to `peer`, keeps it until acknowledged; the header to send it with.
  header stamp(node_id peer, words message);
  // The header to send a kept message again with (the ack it carries is today's).
  header restamp(node_id peer, std::uint64_t seq);
  // Everything not yet acknowledged by `peer`, oldest first: to send again on a new connection.
  std::vector<stamped> unacked(node_id peer) const;

  // ---- receiving
  // An envelope from `peer` with header `h`: its ack is applied; true when the message is to
  // be handed on (new), false for a copy already handed on (a resend).
  bool accept(node_id peer, const header& h);
  // An explicit ack from `peer` (of this link's `session`, up to `seq`).
  void acked(node_id peer, std::uint64_t session, std::uint64_t seq);
  // Whether `peer` should be sent an explicit ack now; then ack_header() is its content.
  bool ack_due(node_id peer) const;
  header ack_header(node_id peer);

  // `peer` is gone for good (declared lost, or said goodbye): everything about it dropped.
  void forget(node_id peer);

  std::uint64_t duplicates() const { return duplicates_; }
  std::uint64_t gaps() const { return gaps_; }
  std::uint64_t overflowed() const { return overflowed_; }

 private:
  struct stream {
    // Sending.
    std::uint64_t next_seq = 1;
    std::deque<stamped> unacked;
    // Receiving.
    std::uint64_t peer_session = 0;  // 0: not heard from yet
    std::uint64_t delivered = 0;     // the last seq handed on
    std::uint64_t acked_back = 0;    // the last seq we acknowledged (carried or explicit)
  };
  void drop_acked(stream& s, std::uint64_t session, std::uint64_t seq);

  std::uint64_t session_;
  std::map<node_id, stream> streams_;
  std::uint64_t duplicates_ = 0, gaps_ = 0, overflowed_ = 0;
};

}  // namespace moevement::transport
