// Messages that survive a failed connection to a live peer. Every envelope to a peer carries
// this link's session (random per link) and a sequence number; the receiver hands each one on
// once, in order, and acknowledges what it handed on (carried on its own envelopes, or in an
// explicit ack when it has none to send); the sender keeps what is not acknowledged and sends
// it again, first and in order, on the next connection to that peer. So a message is never
// lost to a connection that fails and is dialled again, and never applied twice.
//
// Nor to one lost on a connection that stays up (a send that completed with an error, a
// message the other end dropped): an envelope also says the oldest number its sender still
// keeps, so the receiver sees a gap, drops what comes after it and asks for everything from
// the gap again (go-back-N); a lost last message is found by its sender, whose oldest kept
// message goes again when nothing was acknowledged for `resend_after` (the receiver
// acknowledges within `ack_delay` of handing anything on, and answers a copy with an ack).
// Pure bookkeeping, one per link, on the link's thread; the caller passes the time.
#pragma once

#include <capnp/common.h>
#include <kj/array.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "transport/link.hpp"

namespace moevement::transport {

// When the book acknowledges and sends again (ucx_link_options::delivery).
struct delivery_timing {
  // An explicit ack goes out this long after a message was handed on unacknowledged.
  std::chrono::milliseconds ack_delay{20};
  // Nothing acknowledged for this long: the oldest kept message goes again; a resend asked
  // for and not come is asked again after it.
  std::chrono::milliseconds resend_after{500};
};

class delivery_book {
 public:
  using clock = std::chrono::steady_clock;
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
    std::uint64_t oldest = 0;       // the oldest number the sender still keeps (at most seq)
  };
  // What the receiver does with an envelope.
  enum class verdict {
    deliver,    // the next one: hand it on
    duplicate,  // handed on already (a copy sent again): drop it
    early,      // one before it is missing: drop it, and ask for the stream again from the gap
  };
  using timing = delivery_timing;
  // Unacknowledged messages kept per peer at most (the oldest go first past it, counted).
  static constexpr std::size_t max_unacked = 65536;
  // Handed-on messages after which an explicit ack goes out at once.
  static constexpr std::uint64_t ack_every = 64;
  // Probes of an unanswered peer (stopped, say) wait resend_after, then twice that, ... up to
  // 2^max_backoff times it.
  static constexpr unsigned max_backoff = 4;

  explicit delivery_book(std::uint64_t session, timing t = {}) : session_(session), timing_(t) {}
  std::uint64_t session() const { return session_; }

  // ---- sending
  // Numbers a message to `peer`, keeps it until acknowledged; the header to send it with.
  header stamp(node_id peer, words message);
  // The header to send a kept message again with (the ack it carries is today's).
  header restamp(node_id peer, std::uint64_t seq);
  // Everything not yet acknowledged by `peer`, oldest first: to send again on a new connection.
  std::vector<stamped> unacked(node_id peer) const;
  // A resend request from `peer` (an ack of what it handed on, `h.ack_*`): true when it was
  // for this link's session, and everything still unacked is to go again (unacked(peer)).
  bool resend_requested(node_id peer, const header& h, clock::time_point now);
  // Peers whose oldest kept message waited `resend_after` for an ack: it goes again (a probe).
  std::vector<std::pair<node_id, stamped>> probes_due(clock::time_point now);

  // ---- receiving
  // An envelope from `peer` with header `h`: its ack is applied, and what to do with it.
  verdict accept(node_id peer, const header& h, clock::time_point now);
  // The resend request to send `peer` now: when one of its messages is missing (a later one
  // came) and either none was asked for yet, or a new gap showed behind the one asked for, or
  // nothing was handed on for `resend_after` since the last request (it, or its answer, was
  // lost too). An answer that arrives in pieces asks for nothing more.
  std::optional<header> resend_request(node_id peer, clock::time_point now);
  // Every peer's resend request due now (a request or its answer lost too is asked again).
  std::vector<std::pair<node_id, header>> resend_requests_due(clock::time_point now);
  // An explicit ack from `peer` (of this link's `session`, up to `seq`).
  void acked(node_id peer, std::uint64_t session, std::uint64_t seq);
  // Whether `peer` should be sent an explicit ack now; then ack_header() is its content.
  bool ack_due(node_id peer, clock::time_point now) const;
  header ack_header(node_id peer);
  // Peers owed an explicit ack now (see ack_due).
  std::vector<node_id> acks_due(clock::time_point now) const;

  // The goodbye to send `peer`: its seq is the last one numbered for it, `oldest` the oldest
  // it still keeps (above seq: none).
  header goodbye_header(node_id peer);
  // A goodbye from `peer` (header `h`): how many of its messages before it are still to come
  // (0: the goodbye can be acted on). The missing ones are then known, and asked for.
  std::uint64_t missing_before_goodbye(node_id peer, const header& h);
  // The session `peer`'s stream to us is in (0: not heard from).
  std::uint64_t peer_session(node_id peer) const;
  // Messages never handed on at a goodbye that came without them: counted as skipped.
  void give_up_before_goodbye(std::uint64_t missing) { gaps_ += missing; }

  // `peer` is gone for good (declared lost, or said goodbye): everything about it dropped.
  void forget(node_id peer);

  // Messages kept for every peer, not yet acknowledged.
  std::size_t kept() const;
  std::uint64_t duplicates() const { return duplicates_; }
  // Messages skipped for good: the sender no longer kept them (past max_unacked, a forget), or
  // said goodbye without them.
  std::uint64_t gaps() const { return gaps_; }
  std::uint64_t early() const { return early_; }
  std::uint64_t overflowed() const { return overflowed_; }

 private:
  struct stream {
    // Sending.
    std::uint64_t next_seq = 1;
    std::deque<stamped> unacked;
    clock::time_point progress_at{};  // the oldest's last ack or probe; {}: not looked at yet
    // The last resend request answered: its ack, and when ({}: none yet).
    std::uint64_t answered_ack = 0;
    clock::time_point answered_at{};
    // Receiving.
    std::uint64_t peer_session = 0;  // 0: not heard from yet
    std::uint64_t delivered = 0;     // the last seq handed on
    std::uint64_t acked_back = 0;    // the last seq we acknowledged (carried or explicit)
    bool owe_ack = false;            // a copy came: the sender should hear where we are
    clock::time_point owed_since{};  // the first handed-on message (or copy) not acknowledged
    std::uint64_t seen = 0;          // the highest seq that came (early ones too)
    std::uint64_t asked_from = 0;    // our last resend request: from this seq, at asked_at
    clock::time_point asked_at{};    // (0: none since the stream was last whole)
    clock::time_point delivered_at{};
    bool new_hole = false;  // an early one came after the gap asked for was filled
    // Sending: probes sent since the last ack (each waits twice as long, up to max_backoff).
    unsigned probes = 0;
  };
  void drop_acked(stream& s, std::uint64_t session, std::uint64_t seq);
  static void owe(stream& s, clock::time_point now);

  std::uint64_t session_;
  timing timing_;
  std::map<node_id, stream> streams_;
  std::uint64_t duplicates_ = 0, gaps_ = 0, early_ = 0, overflowed_ = 0;
};

}  // namespace moevement::transport
