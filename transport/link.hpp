// link: how one process's actor system reaches the others. One link per process; two
// implementations: ucx_link (real UCX endpoints between processes) and loopback_link
// (in-process, for unit tests; can simulate a crash, a hang and a goodbye).
//
// Threading: a link belongs to one asio::io_context thread. Every method is called on it and
// every handler runs on it, posted (never inline from a UCX callback and never inline from
// send()), so a handler may call send() again.
#pragma once

#include <capnp/common.h>
#include <kj/array.h>

#include <cstdint>
#include <functional>
#include <string>

#include "base/result.hpp"
#include "transport/envelope.hpp"

namespace moevement::transport {

using node_id = std::uint32_t;

enum class peer_loss {
  goodbye,  // the peer said goodbye before closing: a clean shutdown, not a failure
  crash,    // the connection failed (process died, endpoint error)
  // A connection this node dialled failed before the peer welcomed it: nothing listens there
  // any more (the process is gone), or the peer refused our job token.
  refused,
};

struct link_handlers {
  // One validated envelope from a peer. Malformed input never reaches here: the link
  // counts it (link_stats::malformed) and, where it can, answers with an error.
  std::function<void(node_id from, incoming_envelope envelope)> on_message;
  // A peer is gone, or its connection failed. Fires once per peer per loss (until revive()).
  // After a goodbye or forget() sends to it fail fast; after a failed connection (crash,
  // refused) a
  // link may keep them for the peer's next connection (ucx_link does: delivery_book.hpp)
  // until revive() or forget() decides.
  // A hung peer is NOT reported here (transports cannot see it): the actor layer's
  // heartbeats detect hangs and call forget() on the link.
  std::function<void(node_id peer, peer_loss why, const std::string& detail)> on_peer_lost;
};

struct link_stats {
  std::uint64_t sent = 0;
  std::uint64_t received = 0;
  std::uint64_t malformed = 0;  // envelopes rejected by decode() or by admission
  std::uint64_t send_errors = 0;
};

class link {
 public:
  virtual ~link() = default;

  virtual node_id self() const = 0;
  virtual void set_handlers(link_handlers handlers) = 0;
  // Queues one serialized envelope (outgoing_envelope::to_words()) for a peer. Per-peer
  // order is FIFO. An error, at once, if the peer is unknown or known to be lost.
  virtual result<void> send(node_id to, kj::Array<capnp::word> message) = 0;
  // Declares a peer lost (e.g. heartbeats timed out): drops its connection, fails its
  // in-flight sends, and reports on_peer_lost(crash) once if not reported already.
  virtual void forget(node_id peer) = 0;
  // A peer whose connection failed (reported through on_peer_lost(crash)) that the caller
  // still counts alive: the next send dials it afresh (and it is heard again), and a later
  // failure is reported again. No effect on a peer that is not lost.
  virtual void revive(node_id peer) = 0;
  // Where to reach a peer (a link that needs addresses keeps it; a peer that dialled us is
  // reachable over that connection without one), and whether a revive() can dial it: false
  // when only the peer can reconnect.
  virtual void add_peer(node_id /*peer*/, const std::string& /*host*/, std::uint16_t /*port*/) {}
  virtual bool can_dial(node_id /*peer*/) const { return true; }
  // Tells every connected peer that this process is shutting down cleanly.
  virtual void say_goodbye() = 0;
  virtual link_stats stats() const = 0;
};

}  // namespace moevement::transport
