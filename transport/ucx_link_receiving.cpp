// link_state: receiving active messages: the hello, envelopes and their in-order delivery, and
// keeping the streams whole (acks, resend requests and their answers, probes, held goodbyes).
#include "transport/ucx_link_state.hpp"

namespace moevement::transport::detail {

ucs_status_t link_state::on_am(void* arg, const void* header, std::size_t header_len, void* data,
                               std::size_t len, const ucp_am_recv_param_t* param) {
  auto* a = static_cast<std::pair<link_state*, am_id>*>(arg);
  return a->first->receive(a->second, header, header_len, data, len, param);
}

ucs_status_t link_state::receive(am_id id, const void* header, std::size_t header_len, void* data,
                                 std::size_t len, const ucp_am_recv_param_t* param) {
  last_activity = clock::now();
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  std::uint64_t key = 0;
  if (header_len < key_bytes) {
    ++stats.malformed;  // we cannot tell which connection it came on
    return UCS_OK;      // drops it (a rendezvous is completed empty for the sender)
  }
  std::memcpy(&key, header, key_bytes);
  header = static_cast<const std::byte*>(header) + key_bytes;
  header_len -= key_bytes;
  auto it = by_key.find(key);
  if (it == by_key.end()) {
    LINK_TRACE("am {} on an unknown connection dropped", unsigned(id));
    return UCS_OK;  // a connection closed meanwhile
  }
  connection& c = *conns.at(it->second);
  switch (id) {
    case am_hello:
      return on_hello(c, header, header_len, len, rndv);
    case am_welcome: {
      hello_header h{};
      if (!c.outgoing || c.welcomed || rndv || !read_header(header, header_len, h) ||
          h.magic != wire_magic || h.version != wire_version || h.node != c.peer || len != 0) {
        ++stats.malformed;
        post_fail(c.serial, "bad welcome (is another node listening at that address?)");
        return UCS_OK;
      }
      c.welcomed = true;
      LINK_TRACE("welcomed by node {} on conn {}", c.peer, c.serial);
      if (!c.held.empty()) post_release_held(c.serial);  // not inside progress
      return UCS_OK;
    }
    case am_closed:
      LINK_TRACE("node {} closed conn {}", c.peer, c.serial);
      post_fail(c.serial, "the peer closed the connection", /*linger=*/true);
      return UCS_OK;
    default:
      break;
  }
  if (!c.welcomed) {
    LINK_TRACE("am {} before the first message on conn {} dropped", unsigned(id), c.serial);
    ++stats.malformed;  // the peer sends nothing else before it
    return UCS_OK;
  }
  switch (id) {
    case am_envelope:
      return on_envelope(c, header, header_len, data, len, rndv);
    case am_ack: {
      delivery_book::header h{};
      if (!read_header(header, header_len, h) || len != 0) {
        ++stats.malformed;
        return UCS_OK;
      }
      book.acked(c.peer, h.ack_session, h.ack_seq);
      return UCS_OK;
    }
    case am_resend: {
      delivery_book::header h{};
      if (!read_header(header, header_len, h) || len != 0 || h.seq != 0) {
        ++stats.malformed;
        return UCS_OK;
      }
      asio::post(io, [w = weak_from_this(), peer = c.peer, h] {  // sends: not inside progress
        if (auto s = w.lock()) s->answer_resend(peer, h);
      });
      return UCS_OK;
    }
    case am_goodbye: {
      LINK_TRACE("goodbye from node {} on conn {} (header {} B, data {} B)", c.peer, c.serial,
                 header_len, len);
      auto in = std::make_shared<inbound>();
      if (!read_header(header, header_len, in->stream) || len != 0) {
        ++stats.malformed;
        return UCS_OK;
      }
      in->what = inbound::kind::goodbye;
      in->ready = true;
      c.inbox.push_back(in);
      post_deliver(c.serial);
      return UCS_OK;
    }
    case am_bulk_request: {
      bulk_request_header h{};
      if (!read_header(header, header_len, h) || len != 0) {
        ++stats.malformed;
        return UCS_OK;
      }
      asio::post(io, [w = weak_from_this(), serial = c.serial, h] {
        if (auto s = w.lock()) s->serve_pull(serial, h);
      });
      return UCS_OK;
    }
    case am_bulk_data:
    case am_bulk_rkey:
    case am_bulk_error:
    case am_bulk_lease:
      return on_bulk_reply(c, id, header, header_len, data, len, rndv);
    case am_bulk_revoke:
    case am_bulk_release: {
      region_header h{};
      if (!read_header(header, header_len, h) || len != 0) {
        ++stats.malformed;
        return UCS_OK;
      }
      // Not inside progress: a release may unmap a region, a revocation may send.
      asio::post(io, [w = weak_from_this(), serial = c.serial, region = h.region, id] {
        auto s = w.lock();
        if (!s) return;
        if (id == am_bulk_revoke) {
          s->on_revoke(serial, region);
        } else {
          s->on_release(serial, region);
        }
      });
      return UCS_OK;
    }
    default:
      LINK_TRACE("unknown am {} on conn {} dropped", unsigned(id), c.serial);
      ++stats.malformed;
      return UCS_OK;
  }
}

ucs_status_t link_state::on_hello(connection& c, const void* header, std::size_t header_len,
                                  std::size_t len, bool rndv) {
  hello_header h{};
  if (c.outgoing || c.hello_seen) {  // a second hello (or one on our own connection): ignored
    ++counters.bad_hellos;
    ++stats.malformed;
    return UCS_OK;
  }
  if (rndv || len != 0 || !read_header(header, header_len, h) || h.magic != wire_magic ||
      h.version != wire_version || h.node != c.peer) {
    ++counters.bad_hellos;
    ++stats.malformed;
    post_fail(c.serial, "bad hello");
    return UCS_OK;
  }
  c.hello_seen = true;
  LINK_TRACE("hello from node {} on conn {}", h.node, c.serial);
  const std::uint64_t serial = c.serial;
  asio::post(io, [w = weak_from_this(), serial] {  // sends go out from a posted handler
    auto s = w.lock();
    if (!s) return;
    if (connection* conn = s->find_conn(serial)) {
      // The welcome first: until it is sent, every send waits in `held` (send_when_welcomed).
      s->send_control(*conn, am_welcome, hello_header{wire_magic, wire_version, s->opt.self});
      conn->welcomed = true;
      s->release_held(serial);
    }
  });
  return UCS_OK;
}

ucs_status_t link_state::on_envelope(connection& c, const void* header, std::size_t header_len,
                                     void* data, std::size_t len, bool rndv) {
  delivery_book::header stream{};
  if (len > opt.limits.max_bytes || len < sizeof(capnp::word) || len % sizeof(capnp::word) ||
      !read_header(header, header_len, stream) || stream.seq == 0 || stream.session == 0 ||
      stream.oldest == 0 || stream.oldest > stream.seq) {
    ++stats.malformed;
    return UCS_OK;  // a rendezvous is dropped without moving its bytes
  }
  auto in = std::make_shared<inbound>();
  in->stream = stream;
  in->buffer = std::make_shared_for_overwrite<capnp::word[]>(len / sizeof(capnp::word));
  in->bytes = len;
  c.inbox.push_back(in);
  if (!rndv) {
    // Eager data lives only during this callback: one copy of a small message into an
    // aligned buffer, which the envelope then reads in place.
    std::memcpy(static_cast<void*>(in->buffer.get()), data, len);
    in->ready = true;
    // Handed out by pump() once progress has returned (no handler runs inside a UCX
    // callback), without a trip through the io_context queue.
    if (!c.deliver_posted) {
      c.deliver_posted = true;
      ready.push_back(c.serial);
    }
    return UCS_OK;
  }
  // Rendezvous: the bytes go straight into our aligned buffer (no copy), started outside
  // progress.
  asio::post(io, [w = weak_from_this(), serial = c.serial, in, data] {
    auto s = w.lock();
    if (!s) return;
    if (s->find_conn(serial) == nullptr) {
      ucp_am_data_release(s->worker.handle(), data);
      return;
    }
    auto p = std::make_unique<pending_request>();
    p->keep = in;
    p->done = [s = s.get(), serial, in](ucs_status_t st) {
      if (st == UCS_OK) {
        in->ready = true;
      } else {
        in->failed = true;
      }
      s->post_deliver(serial);
    };
    ucp_request_param_t param = s->request_params(p.get(), /*recv_am=*/true);
    s->track(ucp_am_recv_data_nbx(s->worker.handle(), data, in->buffer.get(), in->bytes, &param),
             std::move(p));
    s->kick();
  });
  return UCS_INPROGRESS;
}

void link_state::deliver_ready() {
  if (ready.empty()) return;
  auto serials = std::move(ready);
  ready.clear();
  for (auto serial : serials) deliver(serial);
}

void link_state::post_deliver(std::uint64_t serial) {
  if (connection* c = find_conn(serial)) {
    if (c->deliver_posted) return;
    c->deliver_posted = true;
  }
  asio::post(io, [w = weak_from_this(), serial] {
    if (auto s = w.lock()) s->deliver(serial);
  });
}

void link_state::post_fail(std::uint64_t serial, std::string detail, bool linger) {
  asio::post(io, [w = weak_from_this(), serial, detail = std::move(detail), linger] {
    if (auto s = w.lock()) s->fail_connection(serial, detail, linger);
  });
}

void link_state::deliver(std::uint64_t serial) {
  connection* c = find_conn(serial);
  if (c != nullptr) c->deliver_posted = false;
  while (c != nullptr && !c->inbox.empty() &&
         (c->inbox.front()->ready || c->inbox.front()->failed)) {
    auto in = std::move(c->inbox.front());
    c->inbox.pop_front();
    const node_id from = c->peer;
    if (in->failed) {
      // Its bytes never came (the connection is failing): nothing after it may be handed
      // on, or it would be skipped for good. The connection goes; the next one resends.
      c->inbox.clear();
      post_fail(serial, "a message's bytes failed to arrive");
      return;
    }
    if (in->what == inbound::kind::goodbye) {
      auto& pe = peers[from];
      if (!pe.goodbye) {
        pe.goodbye = in;
        pe.goodbye_until = clock::now() + 4 * opt.delivery.resend_after;
        pe.goodbye_heard = book.peer_session(from);
      }
      settle_goodbye(from);
      c = find_conn(serial);  // gone if the goodbye was acted on
      continue;
    }
    const auto verdict = book.accept(from, in->stream, clock::now());
    if (verdict == delivery_book::verdict::duplicate) {
      ++counters.duplicates;  // sent again (a failed connection, a probe), handed on already
      continue;
    }
    if (verdict == delivery_book::verdict::early) {
      // One before it went missing on a live connection: this one comes again with it.
      ++counters.early;
      LINK_TRACE("envelope {} from node {} ahead of a missing one, dropped", in->stream.seq, from);
      continue;
    }
    auto env = incoming_envelope::decode(
        std::as_bytes(std::span(in->buffer.get(), in->bytes / sizeof(capnp::word))), opt.limits);
    if (!env.ok()) {
      ++stats.malformed;
      continue;
    }
    ++stats.received;
    env->hold(in->buffer);
    if (handlers.on_message) {
      try {
        handlers.on_message(from, std::move(*env));
      } catch (const kj::Exception&) {
        ++stats.malformed;  // a payload field failed lazy validation in the handler
      }
    }
    c = find_conn(serial);  // the handler may have forgotten the peer
  }
  // One went missing (a later one came): the stream again from it, once per gap. (Not once
  // this link is leaving: see check_delivery.)
  if (c != nullptr && !said_goodbye) {
    if (auto ask = book.resend_request(c->peer, clock::now())) {
      ++counters.resend_requests;
      send_when_welcomed(*c,
                         [this, h = *ask](connection& conn) { send_control(conn, am_resend, h); });
    }
  }
  // Nothing of ours carried the acknowledgement back for a while: an explicit one.
  if (c != nullptr && !said_goodbye && book.ack_due(c->peer, clock::now())) {
    ++counters.acks_sent;
    const auto ack = book.ack_header(c->peer);
    send_when_welcomed(*c, [this, ack](connection& conn) { send_control(conn, am_ack, ack); });
  }
  if (c != nullptr) settle_goodbye(c->peer);  // last: it may drop the connection
}

void link_state::settle_goodbye(node_id peer) {
  auto pe = peers.find(peer);
  if (pe == peers.end() || !pe->second.goodbye) return;
  const std::uint64_t said_by = pe->second.goodbye->stream.session;
  const std::uint64_t heard = book.peer_session(peer);
  if (pe->second.lost || (heard != said_by && heard != pe->second.goodbye_heard)) {
    // Lost meanwhile (lose_peer settled it), or a new process on that node spoke since: the
    // old one's goodbye is nothing to it.
    pe->second.goodbye.reset();
    return;
  }
  const std::uint64_t missing = book.missing_before_goodbye(peer, pe->second.goodbye->stream);
  if (missing > 0 && clock::now() < pe->second.goodbye_until) {
    LINK_TRACE("goodbye from node {} held: {} of its messages still to come", peer, missing);
    return;
  }
  if (missing > 0) book.give_up_before_goodbye(missing);
  pe->second.goodbye.reset();
  book.forget(peer);
  lose_peer(peer, peer_loss::goodbye, "the peer said goodbye");
}

void link_state::answer_resend(node_id peer, const delivery_book::header& h) {
  if (!book.resend_requested(peer, h, clock::now())) return;
  connection* c = sendable_conn(peer);
  if (c == nullptr) return;  // the next connection sends them all anyway
  ++counters.resends_answered;
  auto kept = book.unacked(peer);
  counters.resent += kept.size();
  LINK_TRACE("node {} asked for {} envelopes again from {}", peer, kept.size(), h.ack_seq + 1);
  for (auto& k : kept) (void)send_envelope(*c, book.restamp(peer, k.seq), k.message);
}

void link_state::check_delivery() {
  // Leaving: nothing more is asked or acknowledged (peers may be leaving too, and UCX 1.13's
  // TCP transport has asserted in the error path of a send to one that just went: the fewer
  // sends to leaving peers, the better). Resends asked of us are still answered.
  if (said_goodbye) return;
  const auto now = clock::now();
  for (node_id peer : book.acks_due(now)) {
    if (connection* c = sendable_conn(peer)) {
      ++counters.acks_sent;
      send_control(*c, am_ack, book.ack_header(peer));
    }
  }
  std::vector<node_id> leaving;
  for (const auto& [peer, pe] : peers) {
    if (pe.goodbye) leaving.push_back(peer);
  }
  for (node_id peer : leaving) settle_goodbye(peer);
  for (auto& [peer, h] : book.resend_requests_due(now)) {
    if (connection* c = sendable_conn(peer, /*even_leaving=*/true)) {  // what it said before
      ++counters.resend_requests;
      send_control(*c, am_resend, h);
    }
  }
  for (auto& [peer, k] : book.probes_due(now)) {
    if (connection* c = sendable_conn(peer)) {
      ++counters.probes;
      LINK_TRACE("envelope {} to node {} unacknowledged too long: sent again", k.seq, peer);
      (void)send_envelope(*c, book.restamp(peer, k.seq), k.message);
    }
  }
}

connection* link_state::sendable_conn(node_id peer, bool even_leaving) {
  auto pe = peers.find(peer);
  if (pe == peers.end() || pe->second.lost) return nullptr;
  if (!even_leaving && pe->second.goodbye &&
      book.peer_session(peer) == pe->second.goodbye->stream.session) {
    return nullptr;  // leaving: it needs no ack, and answers no probe
  }
  connection* c = find_conn(pe->second.send_conn);
  if (c != nullptr && c->welcomed && c->held.empty()) return c;
  if (c != nullptr) return nullptr;  // what it holds goes first
  for (auto& [serial, other] : conns) {
    if (other->peer == peer && other->welcomed && other->held.empty()) return other.get();
  }
  return nullptr;
}

}  // namespace moevement::transport::detail
